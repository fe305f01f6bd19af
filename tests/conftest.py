"""Shared fixtures, and each test's tier marker from its folder (``tests/unit`` -> ``unit``, ...). Ray token
auth is disabled for the suite (one test turns it on deliberately), and every Ray instance gets a temp dir
of its own: the default /tmp/ray is shared with anything else on the machine."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator

import pytest

os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# A job killed with its run's lease unreleased is taken over once its beat stood still for 2.5 beats: 2.5 s
# here (12.5 s by default), so that resubmissions after a kill do not each wait the default.
os.environ.setdefault("CLUSTER_LEASE_BEAT_S", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tests.support.storage import moto_s3  # noqa: E402, F401  (a real moto_server S3 on loopback)

TIERS = ("unit", "multiprocess", "ray", "cluster", "gpu")  # one folder of tests/ each


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its folder's tier, unless it names a tier itself (a test in tests/ray that starts
    no Ray says ``multiprocess``)."""
    tests_dir = os.path.join(REPO, "tests")
    for item in items:
        folder = os.path.relpath(str(item.path), tests_dir).split(os.sep)[0]
        if folder in TIERS and not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(folder)


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A real local Ray with 4 CPUs, shut down after the module."""
    import ray

    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=temp,
        configure_logging=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}},
    )
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def tiny_overrides(tmp_path: object) -> list[str]:
    """Overrides that make the tiny char-LM job small enough for a test."""
    return [
        f"storage={tmp_path}/runs",
        "task_args.max_chars=40000",
        "task_args.d_model=32",
        "task_args.n_layers=1",
        "task_args.context=32",
        "training.global_batch_size=32",
        "training.log_every_steps=1",
        "failures.hang_timeout_floor_s=60",
    ]
