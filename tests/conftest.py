"""Shared fixtures, and each test's tier marker from its folder (``tests/unit`` -> ``unit``, ...). Ray token
auth is disabled for the suite (one test turns it on deliberately), and every Ray instance gets a temp dir
of its own: the default /tmp/ray is shared with anything else on the machine."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
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
FAST_TIERS = ("unit", "multiprocess")
"""Tiers in ``pytest -m fast`` (tests/README.md), but for their tests marked ``slow``; the smoke tests of
tests/ray/test_smoke.py say ``fast`` themselves."""


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its folder's tier, unless it names a tier itself (a test in tests/ray that starts
    no Ray says ``multiprocess``), and with ``fast`` when its tier is in the fast tier and it is not slow."""
    tests_dir = os.path.join(REPO, "tests")
    for item in items:
        folder = os.path.relpath(str(item.path), tests_dir).split(os.sep)[0]
        if folder in TIERS and not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(folder)
        tier = next((t for t in TIERS if item.get_closest_marker(t)), None)
        if tier in FAST_TIERS and not item.get_closest_marker("slow"):
            item.add_marker("fast")


class SessionRay:
    """One real local Ray (4 CPUs) for every test of the session that asks for ``ray_local``: started when
    first asked for, checked healthy before each module that uses it (alive, every CPU free again: nothing a
    test leaked holds resources) and started anew when a test broke it; shut down before a test that does
    not use it (it may start a Ray of its own: an embedded one, a cluster), and at the session's end."""

    def __init__(self) -> None:
        self.temp: str | None = None

    def ensure(self) -> None:
        import ray

        if ray.is_initialized() and self.temp is not None and self.healthy():
            return
        self.stop()
        if ray.is_initialized():
            ray.shutdown()  # a Ray some other fixture left: not ours to keep
        self.temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
        if os.environ.get("CLUSTER_TEST_SESSION_RAY") == "plain":
            ray.init(
                num_cpus=4,
                include_dashboard=False,
                _temp_dir=self.temp,
                configure_logging=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}},
            )
            return
        from cluster.api import local_ray

        # The embedded Ray a user's `python -m jobs.train` starts (cluster/api/local_ray.py: its quiet
        # settings, no runtime_env, so actors take the workers Ray prestarts), in a temp folder of the
        # session's own; its workers inherit this environment, the repository on PYTHONPATH included.
        path = os.environ.get("PYTHONPATH")
        saved = {"RAY_TMPDIR": os.environ.get("RAY_TMPDIR"), "PYTHONPATH": path}
        os.environ.update(RAY_TMPDIR=self.temp, PYTHONPATH=REPO if not path else f"{REPO}{os.pathsep}{path}")
        try:
            local_ray.start(4)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def healthy(self, wait_s: float = 15.0) -> bool:
        """Every node alive and every CPU free (actors and placement groups a test ended are given back
        within seconds); False if not within ``wait_s``."""
        import ray

        deadline = time.monotonic() + wait_s
        while True:
            try:
                alive = all(n.get("Alive") for n in ray.nodes())
                total, free = ray.cluster_resources(), ray.available_resources()
            except Exception as exc:  # a Ray that no longer answers: started anew by the caller
                logging.getLogger("cluster.tests").warning("the session's Ray does not answer: %s", exc)
                return False
            if alive and free.get("CPU", 0.0) >= total.get("CPU", 0.0) - 1e-6:
                return True
            if time.monotonic() > deadline:
                logging.getLogger("cluster.tests").warning(
                    "the session's Ray is not clean (free %s of %s): starting it anew", free, total
                )
                return False
            time.sleep(0.2)

    def stop(self) -> None:
        import ray

        if self.temp is None:
            return
        if ray.is_initialized():
            from cluster.api import local_ray

            local_ray.shutdown()
        shutil.rmtree(self.temp, ignore_errors=True)
        self.temp = None


@pytest.fixture(scope="session")
def session_ray() -> Iterator[SessionRay]:
    owner = SessionRay()
    try:
        yield owner
    finally:
        owner.stop()


@pytest.fixture(scope="module")
def ray_local(session_ray: SessionRay) -> None:
    """The session's real local Ray with 4 CPUs (:class:`SessionRay`), healthy when the module starts."""
    session_ray.ensure()


@pytest.fixture(autouse=True)
def _no_session_ray_unless_asked(request: pytest.FixtureRequest) -> None:
    """A test that does not use ``ray_local`` gets no Ray in this process (it may start its own)."""
    if "ray_local" in request.fixturenames or "ray" not in sys.modules:
        return
    owner = request.getfixturevalue("session_ray")
    owner.stop()


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
        "failures.hot_spare=false",  # no rank dies in these jobs (tests/support/faults.py: NO_SPARE)
    ]
