"""The embedded Ray of ``cluster.local_ray``: what it starts, and that shutdown leaves nothing behind."""

from __future__ import annotations

import os
import time

import pytest

from cluster import local_ray

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


def _descendants(root: int) -> set[int]:
    """Live, non-zombie processes below ``root``."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parent[int(name)] = int(fields[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier and pid not in found}
        found |= frontier
    return found


def test_embedded_ray_runs_actors_without_api_server_and_stops_everything() -> None:
    import ray
    import ray._private.worker as ray_worker

    assert not ray.is_initialized()
    before = _descendants(os.getpid())
    os.environ["CLUSTER_PROBE_VAR"] = "seen"
    local_ray.start(2)
    try:
        started = set(ray_worker._global_node.all_processes)
        assert "dashboard" not in started  # Ray's API server is not started (nothing to serve without it)
        assert {"gcs_server", "raylet"} <= started

        @ray.remote(num_cpus=1)
        class Probe:
            def env(self) -> tuple[str, list[str]]:
                import sys

                return os.environ.get("CLUSTER_PROBE_VAR", ""), list(sys.path)

        # no runtime_env: workers inherit the driver's environment and get its working directory on sys.path
        value, path = ray.get(Probe.remote().env.remote(), timeout=60)
        assert value == "seen"
        assert os.getcwd() in path
        ours = _descendants(os.getpid()) - before
        assert ours  # GCS, raylet, agents, workers
    finally:
        os.environ.pop("CLUSTER_PROBE_VAR", None)
        local_ray.shutdown()
    deadline = time.monotonic() + 30
    while (_descendants(os.getpid()) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not (_descendants(os.getpid()) - before), "processes of the embedded Ray survived shutdown"
    assert not ray.is_initialized()
