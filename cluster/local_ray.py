"""The embedded single-machine Ray that ``train()`` starts when no cluster is given, started and stopped
with less waiting than a plain ``ray.init()`` / ``ray.shutdown()``.

Ray's own waits dominate a short local job on a small machine (measured on 2 cores, Ray 2.60.0):

- ``ray.init(include_dashboard=False)`` still starts Ray's API server process (for Ray's usage statistics and
  nothing else) and waits 0.8-1.0 s for it to come up before it even starts the raylet. We do not
  start it: without the dashboard it serves nothing this job uses (the GCS answers everything the driver
  asks: nodes, resources, actors).
- Before starting the raylet, ``ray.init`` imports the dashboard's dependencies (aiohttp, OpenTelemetry, ...)
  into the driver only to learn whether they are installed: 0.65 s. We locate them instead
  (``importlib.util.find_spec``, under a millisecond); a missing one still gives Ray's minimal-install answer.
- The raylet, given port 0 for its agents, blocks until the dashboard agent (about a second of imports) and
  the runtime-env agent have bound ports and written them to files, and only then registers the node. We
  give it free ports from above the kernel's ephemeral range (no outgoing connection can be handed one
  before the agent binds it); it registers at once and the agents bind them as they come up.
- ``ray.init`` asks the GCS for its new node with a call that retries once a second, while the raylet
  registers 0.6-1.7 s after it starts: 1.0 or 2.0 s spent where 0.6-1.7 would do. We poll for the node
  every 20 ms first, then make Ray's own call, which then answers at once.
- The raylet connects to the object store it has just started on another thread; when the store is not
  listening yet, the retry comes 1000 ms later. On a busy 2-core machine that was one start in four; the
  embedded Ray retries every 50 ms (with 200 attempts, the same 10 s budget).
- ``ray.shutdown`` sends SIGTERM to the autoscaler monitor and waits a full second before SIGKILL, because
  the monitor does not exit on SIGTERM in time. A local cluster has nothing to autoscale, so no monitor is
  started (as ``ray start --no-monitor``); should one run anyway, it is SIGKILLed before ``ray.shutdown``.

Together, until two actors answer (``python -m benchmarks.diag_start``, medians of 6): plain ``ray.init`` 4.7 s,
this module 2.3 s.

All of this reaches into ``ray._private`` of the pinned Ray version. Each part is guarded: if Ray's internals
differ, the plain behaviour is used and only the time is lost.

While training, Ray's own processes take CPU from the workers, and on a machine whose cores the workers fill
each such tick stalls every rank (the others wait for the preempted one at the next all-reduce). Measured over
40 s of the benchmark workload (2 workers on 2 cores, ``/proc`` ticks of 10 ms): the dashboard agent 38,
the log monitor 31, the raylet 27, the driver 23, the GCS 18, the autoscaler monitor 4. The embedded Ray
turns off what only feeds parts it does not run (see ``_SYSTEM_CONFIG`` and ``_QUIET_ENV``) and starts no
autoscaler monitor (one machine has nothing to autoscale), which brings those 141 ticks to 61-75
(``python -m benchmarks.diag_background``). A variable the user has set keeps the user's value.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import random
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

_POLL_S = 0.02

# Ray settings (``RayConfig``) of the embedded Ray. The dashboard, the state API and a metrics scraper are
# what read these, and the embedded Ray runs none of them.
_SYSTEM_CONFIG: dict[str, Any] = {
    "task_events_report_interval_ms": 0,  # every process sends task events to the GCS once a second
    "enable_metrics_collection": False,  # every process exports metrics to the dashboard agent
    # The raylet's OOM guard reads the memory of every process 4 times a second (Ray's 250 ms): a fifth of
    # the raylet's CPU while the workers train. Once a second still stops a runaway worker in time.
    "memory_monitor_refresh_ms": 1000,
    # Ray starts worker processes at niceness 15, below its daemons; the training ranks should not yield to
    # them (scaling.worker_niceness). Lowering niceness later needs CAP_SYS_NICE; starting at 0 needs nothing.
    "worker_niceness": 0,
    # The raylet connects to its own object store (started on another thread a moment earlier) and every
    # worker to the raylet over a Unix socket; a socket not yet listening is retried after this many ms.
    # Ray's 1000 ms made one start in four on a loaded 2-core machine wait a full second (raylet log:
    # plasma store created -> ObjectManager started 1.001 s later; 0.05 s with this). Same 10 s in all.
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
_embedded = False  # start() ran and its Ray is still up


def start(num_cpus: int) -> None:
    """Start an embedded local Ray (never attaching to another ``ray start`` on this machine)."""
    import ray

    global _embedded
    # No runtime_env: Ray puts the driver's working directory on the workers' sys.path, and the worker
    # processes inherit this process's environment (PYTHONPATH included) through the raylet started
    # here. A runtime_env would make Ray start job-specific processes for the actors instead of using the
    # ones it prestarts during ray.init (measured: actors up 1.9 s -> 1.25 s on 2 cores).
    system_config = _system_config(os.environ)
    with (
        _fast_node_registration(),
        _no_api_server(),
        _no_monitor(),
        _cheap_dependency_check(),
        _agent_ports(),
        _env(_QUIET_ENV),
    ):
        ray.init(
            address="local",  # not /tmp/ray/ray_current_cluster: someone else's `ray start`
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
            _system_config=system_config,
        )
    _embedded = True


def _system_config(environ: Mapping[str, str]) -> dict[str, Any]:
    """The embedded defaults, less every setting the user gave Ray through ``RAY_<name>`` (and its group)."""
    user = {k for k in _SYSTEM_CONFIG if f"RAY_{k}" in environ}
    for group in _SYSTEM_CONFIG_GROUPS:
        if user & set(group):
            user |= set(group)
    return {k: v for k, v in _SYSTEM_CONFIG.items() if k not in user}


def shutdown() -> None:
    """``ray.shutdown()``; for the embedded Ray of :func:`start`, every process it started is gone when
    this returns. A driver connected to a cluster only disconnects: nothing of the cluster is touched."""
    import ray

    global _embedded
    if _embedded:
        for process in _monitor_processes():
            with contextlib.suppress(Exception):
                process.kill()
                process.wait(timeout=5)
    _embedded = False
    ray.shutdown()


def _monitor_processes() -> list[Any]:
    try:
        import ray._private.ray_constants as constants
        import ray._private.worker as ray_worker

        node = ray_worker._global_node
        infos: list[Any] = node.all_processes.get(constants.PROCESS_TYPE_MONITOR, []) if node is not None else []
        return [info.process for info in infos]
    except Exception:  # pragma: no cover - Ray internals changed: plain shutdown
        return []


@contextlib.contextmanager
def _fast_node_registration() -> Iterator[None]:
    try:
        import ray._private.services as services
        from ray._raylet import GcsClient  # type: ignore[attr-defined]

        original: Callable[[str, str], Any] = services.get_node
    except Exception:  # pragma: no cover - Ray internals changed: plain ray.init
        yield
        return

    def get_node(gcs_address: str, node_id: str) -> Any:
        with contextlib.suppress(Exception):
            client = GcsClient(address=gcs_address)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if any(key.hex() == node_id for key in client.get_all_node_info(timeout=5)):
                    break
                time.sleep(_POLL_S)
        return original(gcs_address, node_id)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = original


@contextlib.contextmanager
def _replaced(module: str, path: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """Inside: ``module.path`` (e.g. ``Node.start_monitor``) is ``make(original)``; restored on the way out.
    Where Ray's internals differ (no such module or attribute), nothing is replaced: plain ``ray.init``."""
    try:
        owner: Any = importlib.import_module(module)
        *parents, name = path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        replacement = make(original)
    except Exception:  # pragma: no cover - Ray internals changed
        yield
        return
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _no_api_server() -> contextlib.AbstractContextManager[None]:
    def make(original: Callable[..., None]) -> Callable[..., None]:
        def start_api_server(self: Any, *, include_dashboard: bool | None, raise_on_failure: bool) -> None:
            if include_dashboard is False:
                self._webui_url = ""  # no dashboard: nothing to serve, nothing to wait for
                return
            original(self, include_dashboard=include_dashboard, raise_on_failure=raise_on_failure)

        return start_api_server

    return _replaced("ray._private.node", "Node.start_api_server", make)


# What ``ray.dashboard.optional_deps`` imports to learn whether the dashboard agent can run in full.
_DASHBOARD_DEPS = ("aiohttp", "aiohttp_cors", "grpc", "opencensus", "opentelemetry.exporter.prometheus",
                   "opentelemetry.proto", "prometheus_client", "pydantic")


def dashboard_dependency_error() -> ImportError | None:
    """Ray's ``get_dashboard_dependency_error``, answered by locating the packages instead of importing them."""
    for name in _DASHBOARD_DEPS:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return ImportError(f"No module named {name!r}")
    return None


def _cheap_dependency_check() -> contextlib.AbstractContextManager[None]:
    """``ray.init`` imports the dashboard's dependencies in the driver (aiohttp, OpenTelemetry, ...: 0.65 s on
    2 cores) only to learn whether they are installed, before it starts the raylet; locating them is enough."""
    return _replaced("ray._private.utils", "get_dashboard_dependency_error", lambda _: dashboard_dependency_error)


# The ports of the two agents the raylet starts, in ``RayParams``.
_AGENT_PORTS = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port", "runtime_env_agent_port")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports that are free now and above the kernel's ephemeral range, so that no outgoing
    connection is given one in the moment before the agent binds it; [] where that range reaches 65535."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            high = int(fh.read().split()[1])
    except (OSError, ValueError, IndexError):
        return []
    candidates = list(range(high + 1, 65536))
    random.shuffle(candidates)
    ports: list[int] = []
    for port in candidates[:200]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    return []


@contextlib.contextmanager
def _agent_ports() -> Iterator[None]:
    """Give the raylet its agents' ports. Given 0, the raylet starts the dashboard and runtime-env agents and
    blocks until each has bound a port and written it to a file; the dashboard agent imports for about a
    second first. Given the ports, it goes on registering the node while the agents start."""
    chosen: dict[str, int] = {}

    def make_init(original: Callable[..., None]) -> Callable[..., None]:
        def init(self: Any, ray_params: Any, head: bool = False, **kwargs: Any) -> None:
            if head and not chosen:
                for name, port in zip(_AGENT_PORTS, _free_ports(len(_AGENT_PORTS))):
                    setattr(ray_params, name, port)
                    chosen[name] = port
            original(self, ray_params, head=head, **kwargs)

        return init

    def make_start(original: Callable[..., Any]) -> Callable[..., Any]:
        def start_ray_process(command: list[str], process_type: str, *args: Any, **kwargs: Any) -> Any:
            if process_type == "raylet" and "dashboard_agent_listen_port" in chosen:
                # ray.init passes the raylet every agent port but this one; without it the raylet still waits
                command = [*command, f"--dashboard_agent_listen_port={chosen['dashboard_agent_listen_port']}"]
            return original(command, process_type, *args, **kwargs)

        return start_ray_process

    with (
        _replaced("ray._private.node", "Node.__init__", make_init),
        _replaced("ray._private.services", "start_ray_process", make_start),
    ):
        yield


def _no_monitor() -> contextlib.AbstractContextManager[None]:
    def start_monitor(self: Any) -> None:
        """No autoscaler monitor: one machine has nothing to autoscale (as ``ray start --no-monitor``)."""

    return _replaced("ray._private.node", "Node.start_monitor", lambda _: start_monitor)


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
