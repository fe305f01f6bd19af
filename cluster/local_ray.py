"""The embedded single-machine Ray that ``train()`` starts when no cluster is given, started and stopped
with less waiting than a plain ``ray.init()`` / ``ray.shutdown()``.

Three of Ray's own waits dominate a short local job on a small machine (measured on 2 cores, Ray 2.60.0):

- ``ray.init(include_dashboard=False)`` still starts Ray's API server process (for Ray's usage statistics and
  nothing else) and waits 0.8-1.0 s for it to come up before it even starts the raylet. We do not
  start it: without the dashboard it serves nothing this job uses (the GCS answers everything the driver
  asks: nodes, resources, actors).
- ``ray.init`` asks the GCS for its new node with a call that retries once a second, while the raylet
  registers 0.6-1.7 s after it starts: 1.0 or 2.0 s spent where 0.6-1.7 would do. We poll for the node
  every 20 ms first, then make Ray's own call, which then answers at once.
- ``ray.shutdown`` sends SIGTERM to the autoscaler monitor and waits a full second before SIGKILL, because
  the monitor does not exit on SIGTERM in time. A local cluster has nothing to autoscale and the monitor
  keeps no state, so we SIGKILL it before calling ``ray.shutdown``.

All three reach into ``ray._private`` of the pinned Ray version. Each is guarded: if Ray's internals differ,
the plain behaviour is used and only the time is lost.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

_POLL_S = 0.02
_embedded = False  # start() ran and its Ray is still up


def start(num_cpus: int) -> None:
    """Start an embedded local Ray (never attaching to another ``ray start`` on this machine)."""
    import ray

    global _embedded
    # No runtime_env: Ray puts the driver's working directory on the workers' sys.path, and the worker
    # processes inherit this process's environment (PYTHONPATH included) through the raylet started
    # here. A runtime_env would make Ray start job-specific processes for the actors instead of using the
    # ones it prestarts during ray.init (measured: actors up 1.9 s -> 1.25 s on 2 cores).
    with _fast_node_registration(), _no_api_server():
        ray.init(
            address="local",  # not /tmp/ray/ray_current_cluster: someone else's `ray start`
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
    _embedded = True


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
def _no_api_server() -> Iterator[None]:
    try:
        from ray._private.node import Node

        original = Node.start_api_server
    except Exception:  # pragma: no cover - Ray internals changed: plain ray.init
        yield
        return

    def start_api_server(self: Any, *, include_dashboard: bool | None, raise_on_failure: bool) -> None:
        if include_dashboard is False:
            self._webui_url = ""  # no dashboard: nothing to serve, nothing to wait for
            return
        original(self, include_dashboard=include_dashboard, raise_on_failure=raise_on_failure)

    Node.start_api_server = start_api_server  # type: ignore[method-assign]
    try:
        yield
    finally:
        Node.start_api_server = original  # type: ignore[method-assign]
