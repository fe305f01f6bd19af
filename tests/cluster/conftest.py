"""Shared by the multi-node tests on one machine: a real Ray of several nodes (ray.cluster_utils.Cluster,
fast health checks), and the helpers that read a run's events and wait on them."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cluster.inspect import read_events
from cluster.run.storage import Storage
from tests.conftest import REPO


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A head with no CPUs (nothing trains there) that marks a node dead within about 3 s of its last
    health check; the test adds the nodes it needs. Shut down after the test.

    Ray settings as the embedded Ray's (``cluster.api.local_ray``: no task events, no metrics, the quiet
    daemons) and no runtime_env: every node's raylet inherits this environment (the repository on
    PYTHONPATH), so actors take the workers each node prestarts instead of a job-specific start each
    (side by side, an 8-rank job on three nodes: benchmarks/LOG.md)."""
    import ray
    from ray.cluster_utils import Cluster

    from cluster.api.local_ray import _QUIET_ENV, _SYSTEM_CONFIG

    temp = tempfile.mkdtemp(prefix="rc", dir="/tmp")
    # Cluster writes the head's address to <RAY_TMPDIR or /tmp>/ray/ray_current_cluster, and fails where
    # that folder does not exist (a fresh machine): give it the test's own
    monkeypatch.setenv("RAY_TMPDIR", temp)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", REPO if not path else f"{REPO}{os.pathsep}{path}")
    for name, value in _QUIET_ENV.items():
        monkeypatch.setenv(name, value)
    os.makedirs(os.path.join(temp, "ray"), exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "temp_dir": temp,
            "_system_config": {
                **_SYSTEM_CONFIG,
                "health_check_period_ms": 1000,
                "health_check_timeout_ms": 1000,
                "health_check_failure_threshold": 3,
            },
        },
    )
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def events(run_url: str, kind: str) -> list[dict]:
    return [e for e in read_events(Storage(run_url)) if e["event"] == kind]


def wait_for(cond: Callable[[], bool], timeout: float = 120) -> None:
    """Poll ``cond`` until it holds; a run's files that are not there yet (or half-written) count as not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except (FileNotFoundError, json.JSONDecodeError, IndexError):
            pass
        time.sleep(0.05)
    raise TimeoutError("condition not reached")
