"""A driver that dies on a running Ray cluster (a real `ray start --head`, jobs through `ray job submit`):
its ranks outlive it; the next submission of the run adopts them (same processes, no step recomputed,
final weights bitwise equal to a fault-free run); never resubmitted, they stop by themselves within
`failures.orphan_timeout_s` and free their placement group.

    pytest tests/cluster/test_driver_failover.py -m cluster
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator

import pytest
import torch

from cluster.inspect import read_events
from cluster.run.checkpoint import CheckpointStore
from cluster.run.goodput import run_goodput
from cluster.run.storage import Storage
from tests.cluster.rayproc import RAY, Head, owned_pids, run
from tests.cluster.test_job_submit import small, submit, workers_alive

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ORPHAN_S = 30


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    """A real head of its own (temp dir, HOME, ports); every process of it is killed by PID at the end,
    the detached ranks and placement groups with it."""
    temp = tempfile.mkdtemp(prefix="hf", dir="/tmp")
    home = tempfile.mkdtemp(prefix="hfhome", dir="/tmp")
    h = Head(temp, home)
    try:
        h.start()
        yield h
    finally:
        try:
            h.stop()
            assert owned_pids([temp]) == [], "processes of the test's Ray head are still alive"
        finally:
            shutil.rmtree(temp, ignore_errors=True)
            shutil.rmtree(home, ignore_errors=True)
            assert not os.path.exists(temp)


@pytest.fixture(scope="module")
def storage_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="hfruns", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def job(storage: str, name: str, *extra: str) -> list[str]:
    """Two epochs long enough (about 390 steps each) to kill the driver in the middle of one."""
    return small(
        storage,
        name,
        "task_args.max_chars=400000",
        "training.epochs=2",
        "checkpoint.every_steps=50",
        f"failures.orphan_timeout_s={ORPHAN_S}",
        *extra,
    )


def driver_at(storage: str, name: str, step: int, timeout: float = 150) -> int:
    """The driver's pid (its `driver.json`) once a checkpoint at ``step`` or later is committed."""
    store = CheckpointStore(Storage(os.path.join(storage, name)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(c.step >= step for c in store.list()):
            with open(os.path.join(storage, name, "driver.json")) as fh:
                return int(json.load(fh)["pid"])
        time.sleep(0.05)
    raise AssertionError(f"the job never reached step {step}")


def events(storage: str, name: str) -> list[dict]:  # type: ignore[type-arg]
    return read_events(Storage(os.path.join(storage, name)))


def final_weights(storage: str, name: str) -> dict[str, torch.Tensor]:
    latest = CheckpointStore(Storage(os.path.join(storage, name))).load_latest()
    assert latest is not None
    weights: dict[str, torch.Tensor] = latest.files["model.pt"]
    return weights


def placement_groups(h: Head) -> list[dict]:  # type: ignore[type-arg]
    proc = run([RAY, "list", "placement-groups", "--address", h.address, "--format", "json"], h.env, 60)
    assert proc.returncode == 0, proc.stdout[-2000:]
    text = proc.stdout[proc.stdout.index("[") :]
    return [pg for pg in json.loads(text) if pg.get("state") != "REMOVED"]


@pytest.mark.timeout(600)
def test_a_killed_driver_s_ranks_are_adopted_by_the_next_submission(head: Head, storage_dir: str) -> None:
    """SIGKILL the driver mid-epoch and resubmit: the same rank processes go on from the step they reached
    (no step recomputed, no group started anew) and the final weights equal a fault-free run's, bit for
    bit."""
    ref = submit(head, *job(storage_dir, "reference"))
    assert ref.returncode == 0, ref.stdout[-6000:]

    first = submit(head, *job(storage_dir, "adopted"), options=("--no-wait",), timeout=120)
    assert first.returncode == 0, first.stdout[-4000:]
    pid = driver_at(storage_dir, "adopted", 50)
    os.kill(pid, signal.SIGKILL)
    ranks = workers_alive(head)
    assert len(ranks) == 2, "the ranks died with their driver"

    second = submit(head, *job(storage_dir, "adopted"))
    assert second.returncode == 0, second.stdout[-6000:]
    assert "adopted 2 ranks at step" in second.stdout, second.stdout[-6000:]
    ev = events(storage_dir, "adopted")
    starts = [e for e in ev if e["event"] == "group_started"]
    (adopted,) = [e for e in ev if e["event"] == "adopted"]
    assert sorted(adopted["pids"]) == sorted(starts[0]["pids"])  # the same processes
    assert [e["resume_source"] for e in starts] == ["fresh", "adopted"]  # nothing started anew
    assert [e for e in ev if e["event"] == "finished"]
    ledger = run_goodput(os.path.join(storage_dir, "adopted"))
    assert ledger is not None and ledger.steps["recomputed"] == 0, ledger
    ours, theirs = final_weights(storage_dir, "adopted"), final_weights(storage_dir, "reference")
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    assert workers_alive(head) == [] and placement_groups(head) == []


@pytest.mark.timeout(300)
def test_ranks_no_driver_comes_back_for_stop_within_the_orphan_timeout(head: Head, storage_dir: str) -> None:
    """SIGKILL the driver and never resubmit: its ranks stop and their placement group is freed within
    `failures.orphan_timeout_s`, and they commit nothing meanwhile."""
    first = submit(
        head, *job(storage_dir, "orphan", "training.epochs=50"), options=("--no-wait",), timeout=120
    )
    assert first.returncode == 0, first.stdout[-4000:]
    pid = driver_at(storage_dir, "orphan", 50)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    assert workers_alive(head), "the ranks died with their driver"
    assert placement_groups(head)
    store = CheckpointStore(Storage(os.path.join(storage_dir, "orphan")))
    deadline = killed + ORPHAN_S + 30
    while workers_alive(head) or placement_groups(head):
        assert time.monotonic() < deadline, (workers_alive(head), placement_groups(head))
        time.sleep(1)
    gone_s = time.monotonic() - killed
    assert gone_s >= ORPHAN_S - 5, gone_s
    late = [c.step for c in store.list() if c.manifest.get("committed_at", 0) > time.time() - gone_s + 16]
    assert late == [], f"checkpoints committed after the driver died: {late}"
