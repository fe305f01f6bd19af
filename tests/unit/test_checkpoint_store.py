"""Checkpoint store on memory:// and a local folder: commit, latest, retention, torn checkpoints ignored."""

from __future__ import annotations

import uuid

import pytest
import torch

from cluster.core.errors import StorageError
from cluster.run.checkpoint import (
    DISCARDED,
    MANIFEST,
    QUARANTINE,
    CheckpointStore,
    CheckpointUnreadableError,
    CheckpointWriter,
    serialize,
    step_dir,
)
from cluster.run.storage import Storage

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["memory", "local"])
def store(request: pytest.FixtureRequest, tmp_path: object) -> CheckpointStore:
    root = f"memory://ckpt-{uuid.uuid4().hex}/run" if request.param == "memory" else f"{tmp_path}/run"
    return CheckpointStore(Storage(root))


def commit(store: CheckpointStore, step: int) -> None:
    files = {
        "model.pt": serialize({"w": torch.full((4,), float(step))}),
        "train_state.pt": serialize({"step": step}),
    }
    store.commit(step, files, {"epoch": step // 10})


def test_commit_list_latest(store: CheckpointStore) -> None:
    assert store.load_latest() is None
    for step in (5, 10, 15):
        commit(store, step)
    assert [i.step for i in store.list()] == [5, 10, 15]
    latest = store.load_latest()
    assert latest is not None
    assert latest.info.step == 15
    assert torch.equal(latest.files["model.pt"]["w"], torch.full((4,), 15.0))
    assert latest.skipped == []
    assert store.list()[-1].manifest["files"]["model.pt"]["size"] > 0


def test_torn_checkpoint_without_manifest_is_ignored(store: CheckpointStore) -> None:
    commit(store, 10)
    # a write that died before its manifest: files present, no manifest.json
    store.storage.write_bytes(f"{step_dir(20)}/model.pt", b"partial")
    assert store.steps_on_storage() == [10, 20]
    assert [i.step for i in store.list()] == [10]
    latest = store.load_latest()
    assert latest is not None
    assert latest.info.step == 10


def test_corrupt_latest_falls_back_and_is_reported(store: CheckpointStore) -> None:
    commit(store, 10)
    commit(store, 20)
    data = bytearray(store.storage.read_bytes(f"{step_dir(20)}/model.pt"))
    data[len(data) // 2] ^= 0xFF
    store.storage.write_bytes(f"{step_dir(20)}/model.pt", bytes(data))
    latest = store.load_latest()
    assert latest is not None
    assert latest.info.step == 10
    assert latest.skipped and latest.skipped[0][0] == 20
    assert "checksum" in latest.skipped[0][1]


def test_retention_keeps_last_k_and_cleans_torn_leftovers(store: CheckpointStore) -> None:
    store.storage.write_bytes(f"{step_dir(3)}/model.pt", b"torn")
    for step in (5, 10, 15, 20):
        commit(store, step)
    deleted = store.retain(keep_last=2)
    assert sorted(deleted) == [3, 5, 10]
    assert [i.step for i in store.list()] == [15, 20]
    assert store.steps_on_storage() == [15, 20]


def test_retention_never_deletes_a_newer_in_flight_write(store: CheckpointStore) -> None:
    commit(store, 10)
    store.storage.write_bytes(f"{step_dir(30)}/model.pt", b"being written")
    store.retain(keep_last=1)
    assert 30 in store.steps_on_storage()


@pytest.mark.parametrize("async_save", [True, False])
def test_writer_commits_in_order_and_reports(store: CheckpointStore, async_save: bool) -> None:
    writer = CheckpointWriter(store, keep_last=2, async_save=async_save)
    w = torch.zeros(1000)
    for step in (1, 2, 3):
        w += 1
        stall = writer.save(
            step, 0, {"world_size": 1}, {"model.pt": {"w": w}, "train_state.pt": {"step": step}}
        )
        assert stall >= 0
    writer.close()
    records = writer.drain()
    assert [r.step for r in records] == [1, 2, 3]
    assert all(r.error is None for r in records)
    assert [i.step for i in store.list()] == [2, 3]
    # the snapshot was taken at save time, not when the background write ran
    loaded = store.load_step(3)
    assert torch.equal(loaded["model.pt"]["w"], torch.full((1000,), 3.0))
    assert torch.equal(store.load_step(2)["model.pt"]["w"], torch.full((1000,), 2.0))


def test_failed_write_is_recorded_and_never_committed(tmp_path: object) -> None:
    class Broken(Storage):
        def write_bytes(self, rel: str, data: bytes) -> None:
            if rel.endswith("model.pt"):
                raise OSError("disk full")
            super().write_bytes(rel, data)

    store = CheckpointStore(Broken(f"{tmp_path}/run", retries=0))
    writer = CheckpointWriter(store, keep_last=2)
    writer.save(1, 0, {}, {"model.pt": {"w": torch.ones(2)}, "train_state.pt": {}})
    writer.close()
    (record,) = writer.drain()
    assert record.error is not None
    assert "disk full" in record.error
    assert store.list() == []


def scored(
    store: CheckpointStore, step: int, value: float | None, metric: str = "loss", mode: str = "min"
) -> None:
    meta: dict[str, object] = {"epoch": 0}
    if value is not None:
        meta["score"] = {"metric": metric, "mode": mode, "value": value}
    store.commit(step, {"model.pt": serialize({"w": torch.full((2,), float(step))})}, meta)


def test_retention_keeps_the_best_scored_checkpoint_besides_the_newest(store: CheckpointStore) -> None:
    for step, value in [(5, 0.9), (10, 0.4), (15, None), (20, 0.4), (25, float("nan")), (30, 0.6)]:
        scored(store, step, value)
    assert store.retain(keep_last=2, keep_best=True) == [5, 15, 20]  # 10: the first to reach 0.4
    assert [i.step for i in store.list()] == [10, 25, 30]
    assert store.retain(keep_last=1) == [10, 25]  # without keep_best, only the newest


def test_the_best_follows_the_newest_score_s_metric_and_mode(store: CheckpointStore) -> None:
    from cluster.run.checkpoint import best_of

    scored(store, 5, 0.1, "loss", "min")
    scored(store, 10, 0.7, "acc", "max")
    scored(store, 15, 0.9, "acc", "max")
    scored(store, 20, 0.8, "acc", "max")
    best = best_of(store.list())
    assert best is not None and best.step == 15  # not step 5's lower loss: another metric
    assert best_of([]) is None


def test_load_best_and_its_errors(tmp_path: object) -> None:
    from cluster import load_checkpoint
    from cluster.core.errors import CheckpointError

    store = CheckpointStore(Storage(f"{tmp_path}/run"))
    scored(store, 5, None)
    with pytest.raises(
        CheckpointError, match=r"no checkpoint of .* carries an evaluation score \(1 committed\)"
    ):
        load_checkpoint(f"{tmp_path}/run", step="best")
    scored(store, 10, 2.0, "acc", "max")
    scored(store, 15, 1.0, "acc", "max")
    ckpt = load_checkpoint(f"{tmp_path}/run", step="best")
    assert ckpt.step == 10 and torch.equal(ckpt.model["w"], torch.full((2,), 10.0))
    Storage(f"{tmp_path}/run").write_bytes(f"{step_dir(10)}/model.pt", b"torn")
    with pytest.raises(CheckpointError, match="fails its checksum"):
        load_checkpoint(f"{tmp_path}/run", step="best")  # asked for by name: never silently another one


def test_weights_that_are_not_finite_are_never_committed_and_the_good_ones_are_kept(
    store: CheckpointStore,
) -> None:
    writer = CheckpointWriter(store, keep_last=1, async_save=False)
    writer.save(5, 0, {}, {"model.pt": {"w": torch.ones(3)}})
    for step, bad in [(10, float("nan")), (15, float("inf"))]:
        writer.save(step, 0, {}, {"model.pt": {"w": torch.tensor([1.0, bad, 2.0]), "n": torch.tensor(3)}})
    records = writer.drain()
    assert len(records) == 3 and records[0].error is None
    assert all("are not finite (NaN or inf in 'w'): not committed" in (r.error or "") for r in records[1:])
    assert [i.step for i in store.list()] == [5]  # keep_last=1 did not delete the good one for them
    assert store.steps_on_storage() == [5]  # nothing of the refused ones was written
    lenient = CheckpointWriter(store, keep_last=1, async_save=False, refuse_nonfinite=False)
    lenient.save(20, 0, {}, {"model.pt": {"w": torch.tensor([float("nan")])}})  # failures.stop_on_nan=false
    assert lenient.drain()[0].error is None and [i.step for i in store.list()] == [20]


def test_discard_after_deletes_every_newer_step_folder_committed_or_torn(store: CheckpointStore) -> None:
    for step in (4, 8, 10):
        commit(store, step)
    store.storage.write_bytes(f"{step_dir(12)}/model.pt", b"torn")  # a write cut short: no manifest
    assert store.discard_after(8) == [10, 12]
    assert store.steps_on_storage() == [4, 8]
    assert [i.step for i in store.list()] == [4, 8]
    assert store.discard_after(8) == []


def test_keep_every_keeps_the_milestones_besides_the_newest(store: CheckpointStore) -> None:
    for step in range(0, 45, 5):
        commit(store, step)
    deleted = store.retain(keep_last=2, keep_every=20)
    assert [i.step for i in store.list()] == [20, 35, 40]  # 40 is both; step 0 is no milestone
    assert deleted == [0, 5, 10, 15, 25, 30]


def test_retention_counts_only_verified_and_quarantines_a_corrupt_newest(store: CheckpointStore) -> None:
    """Issue 31: the newest checkpoint rots, the run resumes from the one before and commits again; retention
    used to count the rotten one and delete every checkpoint that verified."""
    for step in (50, 100):
        commit(store, step)
    store.storage.write_bytes(f"{step_dir(100)}/model.pt", b"bitrot")
    commit(store, 60)  # the run resumed from 50 and trained on
    assert store.retain(keep_last=1) == [50]
    assert store.last_quarantined and store.last_quarantined[0][0] == 100
    assert "fails its checksum" in store.last_quarantined[0][1]
    latest = store.load_latest()
    assert latest is not None and latest.info.step == 60 and latest.skipped == []
    assert store.steps_on_storage() == [60]
    # moved aside, not deleted: the evidence is kept, out of every reader's way
    assert store.storage.read_bytes(f"{QUARANTINE}/step_000000100/model.pt") == b"bitrot"
    assert store.storage.exists(f"{QUARANTINE}/step_000000100/{MANIFEST}")


def test_retention_keeps_keep_last_verified_ones_past_corrupt_ones(store: CheckpointStore) -> None:
    for step in (10, 20, 30, 40):
        commit(store, step)
    fresh = CheckpointStore(store.storage)  # a new process: nothing trusted, every kept one read back
    store.storage.write_bytes(f"{step_dir(30)}/model.pt", b"rot")
    store.storage.write_bytes(f"{step_dir(40)}/{MANIFEST}", b"{not json")
    assert fresh.retain(keep_last=2) == []  # 20 and 10 are the two newest that verify
    assert sorted(s for s, _ in fresh.last_quarantined) == [30, 40]
    assert [i.step for i in fresh.list()] == [10, 20]
    assert fresh.storage.listdir(QUARANTINE) == ["step_000000030", "step_000000040"]


def test_retention_keeps_the_best_that_verifies(store: CheckpointStore) -> None:
    for step, value in [(5, 0.1), (10, 0.2), (15, 0.9), (20, 0.8)]:
        scored(store, step, value)
    fresh = CheckpointStore(store.storage)
    store.storage.write_bytes(f"{step_dir(5)}/model.pt", b"rot")  # the best rotted: the next best is kept
    assert fresh.retain(keep_last=1, keep_best=True) == [15]
    assert [i.step for i in fresh.list()] == [10, 20] and fresh.last_quarantined[0][0] == 5


def test_a_quarantined_step_is_never_overwritten(store: CheckpointStore) -> None:
    for _ in range(2):
        commit(store, 10)
        commit(store, 20)
        store.storage.write_bytes(f"{step_dir(20)}/model.pt", b"rot")
        commit(store, 15)
        store.retain(keep_last=1)
    assert store.storage.listdir(QUARANTINE) == ["step_000000020", "step_000000020.2"]


def test_a_read_outage_is_never_taken_for_no_checkpoint(store: CheckpointStore) -> None:
    """Issue 31: a read that fails after its retries used to make load_latest return None (a fresh start)."""
    commit(store, 50)
    store.read_verified = _outage  # type: ignore[method-assign]
    with pytest.raises(
        CheckpointUnreadableError, match=r"cannot read the checkpoint at .*step_000000050: outage"
    ):
        store.load_latest()
    assert isinstance(CheckpointUnreadableError("x"), StorageError)


def _outage(info: object) -> dict[str, bytes]:
    raise StorageError("outage")


def test_discard_after_sets_aside_the_best_and_milestones_newer_than_the_point(
    store: CheckpointStore,
) -> None:
    for step, value in [(10, 0.5), (20, 0.1), (30, 0.4), (40, 0.3), (50, None)]:
        scored(store, step, value)
    assert store.discard_after(10, keep_every=40) == [20, 30, 40, 50]
    assert sorted(store.last_set_aside) == [20, 40]  # the best (0.1) and the milestone
    assert store.steps_on_storage() == [10]
    assert store.storage.listdir(DISCARDED) == ["step_000000020", "step_000000040"]
    latest = store.load_latest()
    assert latest is not None and latest.info.step == 10  # neither shadows the rollback point
    scored(store, 20, 0.2)
    assert store.discard_after(10, keep_best=False) == [20] and store.steps_on_storage() == [10]


@pytest.mark.parametrize("async_save", [True, False])
def test_the_step_rows_up_to_a_commit_are_written_beside_it_and_only_once_it_committed(
    tmp_path: object, async_save: bool
) -> None:
    from cluster.run.logs import COMMIT_ROWS, read_metric_parts

    class NoModel(Storage):  # the second commit's weights never land
        def write_bytes(self, rel: str, data: bytes) -> None:
            if rel.startswith("checkpoints/") and "4" in rel.split("/")[1] and rel.endswith("model.pt"):
                raise OSError("disk full")
            super().write_bytes(rel, data)

    store = CheckpointStore(NoModel(f"{tmp_path}/run", retries=0))
    writer = CheckpointWriter(store, keep_last=5, async_save=async_save)
    writer.rows_seq = 7

    def rows(*steps: int) -> list[dict[str, object]]:
        return [{"global_step": s, "loss": float(s), "checkpoint_stall_s": 0.0} for s in steps]

    files = {"model.pt": {"w": torch.ones(2)}, "train_state.pt": {}}
    writer.save(2, 0, {"attempt": 1}, files, rows=rows(1, 2))
    writer.save(4, 0, {"attempt": 1}, files, rows=rows(3, 4))  # fails: its rows are not written
    writer.close()
    assert [r.error is None for r in writer.drain()] == [True, False]
    (part,) = read_metric_parts(store.storage, COMMIT_ROWS)
    seq, table = part
    written = table.to_pylist()
    assert seq == 7
    assert [(r["kind"], r["global_step"], r["attempt"]) for r in written] == [
        ("step", 1, None),
        ("step", 2, None),
    ]
    assert written[0]["checkpoint_stall_s"] == 0.0 and written[1]["checkpoint_stall_s"] > 0.0  # the commit's
    assert store.storage.listdir("metrics") == []  # a reader of metrics/ sees each row once (the driver's)
