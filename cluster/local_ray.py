"""The embedded single-machine Ray that ``train()`` starts when no cluster is given.

Only what Ray supports is used: ``ray.init`` arguments, Ray's system config (``_system_config``, the same
settings as ``RAY_<name>`` environment variables) and environment variables that Ray's own daemons read.
Nothing of ``ray._private`` is replaced, so a new Ray release cannot break this start silently.

While training, Ray's own processes take CPU from the workers, and on a machine whose cores the workers fill
each such tick stalls every rank (the others wait for the preempted one at the next all-reduce). The embedded
Ray therefore turns off what only feeds parts it does not run (the dashboard, the state API, a metrics
scraper): see ``_SYSTEM_CONFIG`` and ``_QUIET_ENV``. A setting the user has made keeps the user's value.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

# Ray settings (``RayConfig``) of the embedded Ray. The dashboard, the state API and a metrics scraper are
# what read these, and the embedded Ray runs none of them.
_SYSTEM_CONFIG: dict[str, Any] = {
    "task_events_report_interval_ms": 0,  # every process sends task events to the GCS once a second
    "enable_metrics_collection": False,  # every process exports metrics to the dashboard agent
    # The raylet's OOM guard reads the memory of every process 4 times a second (Ray's 250 ms), a visible
    # share of the raylet's CPU while the workers train. Once a second still stops a runaway worker in time.
    "memory_monitor_refresh_ms": 1000,
    # Ray starts worker processes at niceness 15, below its daemons; the training ranks should not yield to
    # them (scaling.worker_niceness). Lowering niceness later needs CAP_SYS_NICE; starting at 0 needs nothing.
    "worker_niceness": 0,
    # The raylet connects to its own object store (started on another thread a moment earlier) and every
    # worker to the raylet over a Unix socket; a socket not yet listening is retried after this many ms.
    # Ray's 1000 ms makes a start on a loaded machine wait a whole second now and then; the budget stays 10 s.
    "raylet_client_connect_timeout_milliseconds": 50,
    "raylet_client_num_connect_attempts": 200,
}
# Settings that only make sense together: a user's value for one of them drops the embedded defaults of all.
_SYSTEM_CONFIG_GROUPS = [("raylet_client_connect_timeout_milliseconds", "raylet_client_num_connect_attempts")]
# Read from the environment by Ray's Python daemons, which inherit it from ``ray.init``.
_QUIET_ENV = {
    # The log monitor globs the log folder 10 times a second while it follows fewer than this many files;
    # with 0 it globs every LOG_NAME_UPDATE_INTERVAL_S. New files are still followed from their first line.
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "1",
    # The dashboard agent's per-process CPU and memory sampling, shown only by the dashboard.
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
}


def start(num_cpus: int) -> None:
    """Start an embedded local Ray (never attaching to another ``ray start`` on this machine)."""
    import ray

    # No runtime_env: Ray puts the driver's working directory on the workers' sys.path, and the worker
    # processes inherit this process's environment (PYTHONPATH included) through the raylet started
    # here. A runtime_env would make Ray start job-specific processes for the actors instead of using the
    # ones it prestarts during ray.init.
    with _env(_QUIET_ENV):
        ray.init(
            address="local",  # not /tmp/ray/ray_current_cluster: someone else's `ray start`
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
            _system_config=_system_config(os.environ),
        )


def _system_config(environ: Mapping[str, str]) -> dict[str, Any]:
    """The embedded defaults, less every setting the user gave Ray through ``RAY_<name>`` (and its group)."""
    user = {k for k in _SYSTEM_CONFIG if f"RAY_{k}" in environ}
    for group in _SYSTEM_CONFIG_GROUPS:
        if user & set(group):
            user |= set(group)
    return {k: v for k, v in _SYSTEM_CONFIG.items() if k not in user}


def shutdown() -> None:
    """``ray.shutdown()``: stops the embedded Ray of :func:`start`; a driver connected to a cluster only
    disconnects, nothing of the cluster is touched."""
    import ray

    ray.shutdown()


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """Set the variables the user has not set, for the processes started inside; then restore."""
    added = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)
