"""The embedded Ray of ``cluster.api.local_ray``: its settings reach Ray, and shutdown leaves nothing
behind."""

from __future__ import annotations

import base64
import json
import os
import time

import pytest

from cluster.api import local_ray

pytestmark = pytest.mark.timeout(120)


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


def test_embedded_ray_uses_only_supported_settings_runs_actors_and_stops_everything() -> None:
    import ray

    assert not ray.is_initialized()
    before = _descendants(os.getpid())
    os.environ["CLUSTER_PROBE_VAR"] = "seen"
    os.environ["LOG_NAME_UPDATE_INTERVAL_S"] = "3"  # a user's own setting wins over the embedded Ray's
    local_ray.start(2)
    try:
        # The quiet settings reach Ray's processes: the system config is what the GCS was started with
        # (base64 JSON in the GCS server's --config_list), the environment is in its daemons'; the driver's
        # own environment
        # is left as it was.
        gcs = _process_with_arg("--config_list=", "gcs_server")
        with open(f"/proc/{gcs}/cmdline", "rb") as fh:
            args = fh.read().decode(errors="replace").split("\0")
        encoded = next(a for a in args if a.startswith("--config_list=")).split("=", 1)[1]
        config = json.loads(base64.b64decode(encoded))
        assert config["task_events_report_interval_ms"] == 0
        assert config["enable_metrics_collection"] is False
        assert config["worker_niceness"] == 0
        assert config["raylet_client_connect_timeout_milliseconds"] == 50
        log_monitor = _process_with_arg("log_monitor.py", "python")
        with open(f"/proc/{log_monitor}/environ", "rb") as fh:
            env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
        assert env[b"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"] == b"0"
        assert env[b"LOG_NAME_UPDATE_INTERVAL_S"] == b"3"
        assert "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD" not in os.environ

        @ray.remote(num_cpus=1)
        class Probe:
            def env(self) -> tuple[str, list[str], int]:
                import sys

                return (
                    os.environ.get("CLUSTER_PROBE_VAR", ""),
                    list(sys.path),
                    os.getpriority(os.PRIO_PROCESS, 0),
                )

        # no runtime_env: workers inherit the driver's environment and get its working directory on sys.path,
        # and they start at niceness 0 (Ray's default would be 15)
        value, path, nice = ray.get(Probe.remote().env.remote(), timeout=60)
        assert value == "seen"
        assert os.getcwd() in path
        assert nice == 0
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


def _process_with_arg(needle: str, name_part: str) -> int:
    """The PID of a descendant of this process whose command line contains both strings."""
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().decode(errors="replace")
        except OSError:
            continue
        if needle in cmd and name_part in cmd:
            return pid
    raise AssertionError(f"no process of ours runs {name_part} with {needle!r}")
