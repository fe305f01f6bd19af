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


def test_embedded_ray_runs_actors_without_api_server_or_monitor_and_stops_everything() -> None:
    import ray
    import ray._private.worker as ray_worker

    assert not ray.is_initialized()
    before = _descendants(os.getpid())
    os.environ["CLUSTER_PROBE_VAR"] = "seen"
    os.environ["LOG_NAME_UPDATE_INTERVAL_S"] = "3"  # a user's own setting wins over the embedded Ray's
    local_ray.start(2)
    try:
        node = ray_worker._global_node
        started = set(node.all_processes)
        assert "dashboard" not in started  # Ray's API server is not started (nothing to serve without it)
        assert "monitor" not in started  # nor the autoscaler monitor: one machine has nothing to autoscale
        assert {"gcs_server", "raylet", "log_monitor"} <= started
        # The quiet settings reach Ray's processes; the driver's own environment is left as it was.
        assert node._config["task_events_report_interval_ms"] == 0
        assert node._config["enable_metrics_collection"] is False
        assert node._config["raylet_client_connect_timeout_milliseconds"] == 50
        with open(f"/proc/{node.all_processes['log_monitor'][0].process.pid}/environ", "rb") as fh:
            env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
        assert env[b"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"] == b"0"
        assert env[b"LOG_NAME_UPDATE_INTERVAL_S"] == b"3"
        assert "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD" not in os.environ

        @ray.remote(num_cpus=1)
        class Probe:
            def env(self) -> tuple[str, list[str]]:
                import sys

                return os.environ.get("CLUSTER_PROBE_VAR", ""), list(sys.path)

        # no runtime_env: workers inherit the driver's environment and get its working directory on sys.path
        value, path = ray.get(Probe.remote().env.remote(), timeout=60)
        assert value == "seen"
        assert os.getcwd() in path
        # The raylet was given its agents' ports (so it did not block on their port files) and the agents
        # bound exactly those: each agent writes the port it bound to the session folder.
        params = node._ray_params
        given = {name: getattr(params, name) for name in local_ray._AGENT_PORTS}
        assert all(isinstance(p, int) and p > 0 for p in given.values()), given
        with open(f"/proc/{node.all_processes['raylet'][0].process.pid}/cmdline", "rb") as fh:
            raylet_args = fh.read().split(b"\0")
        assert f"--dashboard_agent_listen_port={given['dashboard_agent_listen_port']}".encode() in raylet_args
        assert f"--metrics-agent-port={given['metrics_agent_port']}".encode() in raylet_args
        session, node_id = node.get_session_dir_path(), node.node_id
        for name in ("metrics_agent_port", "dashboard_agent_listen_port", "runtime_env_agent_port"):
            path = os.path.join(session, f"{name}_{node_id}")
            deadline = time.monotonic() + 30
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.1)
            with open(path) as fh:
                assert int(fh.read().strip()) == given[name], name
        # an actor with a runtime_env goes through the runtime-env agent, at the port the raylet was given
        assert ray.get(Probe.options(runtime_env={"env_vars": {"CLUSTER_PROBE_VAR": "env"}}).remote().env.remote(),
                       timeout=60)[0] == "env"
        ours = _descendants(os.getpid()) - before
        assert ours  # GCS, raylet, agents, workers
    finally:
        os.environ.pop("CLUSTER_PROBE_VAR", None)
        os.environ.pop("LOG_NAME_UPDATE_INTERVAL_S", None)
        local_ray.shutdown()
    deadline = time.monotonic() + 30
    while (_descendants(os.getpid()) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not (_descendants(os.getpid()) - before), "processes of the embedded Ray survived shutdown"
    assert not ray.is_initialized()
