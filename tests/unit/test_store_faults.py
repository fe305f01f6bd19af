"""Storage faults on purpose, on a local folder: every write, move and delete of a commit (with the
writer's retention), of retention alone and of discard_after fails once, or crashes the writer, and what a
user trusts survives (tests/support/store_faults.py says what is checked); a read outage raises, never
reads as "no checkpoint". The same walk against S3 is tests/multiprocess/test_store_faults_s3.py."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.core.errors import StorageError
from cluster.run.checkpoint import CheckpointStore, CheckpointUnreadableError, step_dir
from cluster.run.logs import EventLog, read_event_log
from cluster.run.storage import Storage
from tests.support.faultfs import Faults
from tests.support.store_faults import SCENARIOS, Scenario, commit, local_backend, walk

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_every_injection_point_keeps_what_verified(tmp_path: Any, scenario: Scenario) -> None:
    walked = walk(local_backend(str(tmp_path)), scenario)
    assert len(walked) >= 8  # every write, move and delete, each failing once and crashing


def faulty(root: str, faults: Faults, retries: int = 0, budget_s: float = 0.0) -> CheckpointStore:
    storage = Storage(
        f"faultfile://{root}", {"faults": faults}, retries=retries, backoff_s=0.01, retry_budget_s=budget_s
    )
    return CheckpointStore(storage)


def test_a_read_outage_raises_and_never_reads_as_no_checkpoint(tmp_path: Any) -> None:
    root = f"{tmp_path}/run"
    healthy = CheckpointStore(Storage(root))
    for step in (10, 20):
        commit(healthy, step)
    faults = Faults()
    store = faulty(root, faults)
    faults.reads_down = True
    with pytest.raises(CheckpointUnreadableError, match="cannot list the checkpoints"):
        store.load_latest()
    with pytest.raises(StorageError):
        store.list()
    with pytest.raises(StorageError):
        store.retain(keep_last=1)
    assert healthy.steps_on_storage() == [10, 20]  # retention deleted nothing it could not read


def test_a_read_outage_of_the_data_alone_raises_naming_the_checkpoint(tmp_path: Any) -> None:
    root = f"{tmp_path}/run"
    commit(CheckpointStore(Storage(root)), 10)
    faults = Faults()
    faults.read_outage(paths="model.pt")  # the manifest reads; the weights do not
    with pytest.raises(CheckpointUnreadableError, match=rf"cannot read the checkpoint at .*{step_dir(10)}"):
        faulty(root, faults).load_latest()


def test_a_read_outage_shorter_than_the_retry_budget_costs_time_not_the_resume(tmp_path: Any) -> None:
    root = f"{tmp_path}/run"
    commit(CheckpointStore(Storage(root)), 10)
    faults = Faults()
    faults.read_outage(0.3)
    loaded = faulty(root, faults, retries=3, budget_s=30.0).load_latest()
    assert loaded is not None and loaded.info.step == 10


def test_every_injection_point_of_an_event_append_keeps_every_event_appended_before(tmp_path: Any) -> None:
    """The event log (one segment rewritten whole per append, atomically): a write or move that fails once,
    or crashes the writer, during an append never loses an event whose append returned, and the next
    writer (a resubmission) appends after all of them."""
    counter = Faults()
    base = f"{tmp_path}/count"
    log = EventLog(Storage(f"faultfile://{base}", {"faults": counter}, retries=0, retry_budget_s=0.0))
    for i in range(3):
        log.append("checkpoint", step=i)
    points = [(k, n) for k in ("write", "move") for n in range(1, counter.counts[k] + 1)]
    assert points
    for at in points:
        for crash in (False, True):
            root = f"{tmp_path}/{at[0]}{at[1]}{crash}"
            faults = Faults(at, crash=crash)
            writer = EventLog(
                Storage(f"faultfile://{root}", {"faults": faults}, retries=0, retry_budget_s=0.0)
            )
            acked = []
            for i in range(3):
                try:
                    writer.append("checkpoint", step=i)
                    acked.append(i)
                except StorageError:
                    continue
            assert faults.fired
            stored = [r["step"] for r in read_event_log(Storage(root)) if r["event"] == "checkpoint"]
            assert set(acked) <= set(stored), f"{at} crash={crash}: acknowledged {acked}, stored {stored}"
            EventLog(Storage(root)).append("checkpoint", step=99)  # a resubmission appends after them
            after = [r["step"] for r in read_event_log(Storage(root)) if r["event"] == "checkpoint"]
            assert after[:-1] == stored and after[-1] == 99
