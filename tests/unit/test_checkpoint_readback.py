"""Issue 42, item 4: retention keeps what verifies NOW, and a commit's outcome is what a reader will see.

- Bit rot in the newest checkpoint after its commit, then retention in the committing process: the rotten
  one is read back (not trusted), moved aside, and the older ones that verify are kept.
- Silent write corruption (storage acknowledges the write and keeps other bytes): the writer's commit reads
  the checkpoint back, reports the commit failed, and retention deletes nothing for it; on a local folder
  and on object storage (``fault://`` over fsspec's memory filesystem).
- A retention that fails after a good commit is one warning (the ``cluster`` logger), not a failed commit
  (the driver's failed-commit count stays at 0), and runs again at the next commit.
- Retention reads back only the newest checkpoint it keeps, after its commit: in the writer's path that is
  the commit's own read-back (each file of the new checkpoint read once, no older checkpoint read), from a
  fresh process one read of the newest; a rotten newest is moved aside and the next newest read back.
- A manifest published whose folder's fsync fails after the rename is committed; the fsync before the
  rename is retried like every other storage call (a StorageError when it keeps failing, never a raw
  OSError); a temporary manifest never outlives a failed publish.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import stat
import uuid
from collections import Counter
from typing import Any

import pytest
import torch

from cluster.core.errors import StorageError
from cluster.driver.record import RunRecord
from cluster.run.checkpoint import (
    MANIFEST,
    QUARANTINE,
    CheckpointStore,
    CheckpointWriter,
    serialize,
    step_dir,
)
from cluster.run.folder import RunFolder
from cluster.run.storage import Storage
from cluster.spec.load import load_config
from tests.support.faultfs import Faults

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def files(step: int) -> dict[str, bytes]:
    return {
        "model.pt": serialize({"w": torch.full((256,), float(step))}),
        "train_state.pt": serialize({"step": step}),
    }


def state(step: int) -> dict[str, Any]:
    return {"model.pt": {"w": torch.full((256,), float(step))}, "train_state.pt": {"step": step}}


def flip_byte(storage: Storage, rel: str) -> None:
    """Bit rot: one byte of a stored file changes after it was written."""
    data = bytearray(storage.read_bytes(rel))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes(rel, bytes(data))


def verified(storage: Storage) -> list[int]:
    """The steps that verify when read by a fresh reader, ascending."""
    store = CheckpointStore(storage)
    out = []
    for info in store.list():
        if store.verifies(info) is None:
            out.append(info.step)
    return out


def faulty(url: str, faults: Faults, protocol: str = "faultfile", retries: int = 0) -> Storage:
    if protocol == "faultfile":
        return Storage(
            f"faultfile://{url}", {"faults": faults}, retries=retries, backoff_s=0, retry_budget_s=0
        )
    opts = {"faults": faults, "target_protocol": "memory"}
    return Storage(f"fault://{url}", opts, retries=retries, backoff_s=0, retry_budget_s=0)


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    return f"{tmp_path}/run" if request.param == "local" else f"memory://readback-{uuid.uuid4().hex}/run"


def test_bit_rot_after_the_commit_is_read_back_by_retention_in_the_committing_process(root: str) -> None:
    store = CheckpointStore(Storage(root))
    for step in (10, 20, 30):
        store.commit(step, files(step), {"epoch": 0})
    flip_byte(store.storage, f"{step_dir(30)}/model.pt")  # rots after its commit was read back
    store.retain(keep_last=1)
    assert verified(store.storage) == [20], "no checkpoint that verifies was left, or 20 was not kept"
    assert [s for s, _ in store.last_quarantined] == [30]
    loaded = CheckpointStore(Storage(root)).load_latest()
    assert loaded is not None and loaded.info.step == 20


def test_a_rotten_newest_that_is_also_the_best_is_read_and_moved_aside_once(root: str) -> None:
    store = CheckpointStore(Storage(root))
    for step, loss in [(10, 0.5), (20, 0.4), (30, 0.1)]:
        meta = {"epoch": 0, "score": {"metric": "loss", "mode": "min", "value": loss}}
        store.commit(step, files(step), meta)
    flip_byte(store.storage, f"{step_dir(30)}/model.pt")
    assert store.retain(keep_last=1, keep_best=True) == [10]  # 20: the newest and the best that verify
    assert [s for s, _ in store.last_quarantined] == [30]
    assert verified(store.storage) == [20]


@pytest.mark.parametrize("protocol", ["faultfile", "fault"], ids=["folder", "object-store"])
@pytest.mark.parametrize("target", ["model.pt", MANIFEST])
def test_silent_write_corruption_fails_the_commit_and_keeps_the_verified_ones(
    tmp_path: Any, protocol: str, target: str
) -> None:
    url = f"{tmp_path}/run" if protocol == "faultfile" else f"readback-{uuid.uuid4().hex}/run"
    faults = Faults()
    storage = faulty(url, faults, protocol)
    writer = CheckpointWriter(CheckpointStore(storage), keep_last=1, async_save=False)
    writer.save(10, 0, {}, state(10))
    writer.save(20, 0, {}, state(20))
    faults.corrupt_writes(f"{step_dir(30)}/{target}", times=1)
    writer.save(30, 0, {}, state(30))
    records = writer.drain()
    assert faults.corrupted, "the fault never fired"
    assert [r.error is None for r in records] == [True, True, False]
    assert "read back" in (records[-1].error or "")
    healthy = faulty(url, Faults(), protocol)
    assert verified(healthy) == [20]
    loaded = CheckpointStore(healthy).load_latest()
    assert loaded is not None and loaded.info.step == 20 and loaded.skipped == []
    assert healthy.listdir(QUARANTINE) == ["step_000000030"]  # moved aside: out of readers' way, kept
    writer.save(40, 0, {}, state(40))  # storage healthy again: the next commit and retention go through
    (record,) = writer.drain()
    assert record.error is None and verified(healthy) == [40]


def test_a_failed_retention_after_a_good_commit_is_a_warning_not_a_failed_commit(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    faults = Faults()
    storage = faulty(f"{tmp_path}/run", faults)
    writer = CheckpointWriter(CheckpointStore(storage), keep_last=1, async_save=False)
    writer.save(10, 0, {}, state(10))
    faults.fail("delete", step_dir(10), times=1)  # retention cannot delete step 10 (storage refuses once)
    with caplog.at_level(logging.WARNING, logger="cluster"):
        writer.save(20, 0, {}, state(20))
    (first, second) = writer.drain()
    assert first.error is None and second.error is None, second.error
    assert second.url and second.retention_error and "injected failure of delete" in second.retention_error
    warned = [r for r in caplog.records if r.name.startswith("cluster") and "retention" in r.getMessage()]
    assert len(warned) == 1 and "injected failure of delete" in warned[0].getMessage()
    assert verified(storage) == [10, 20]
    cfg = load_config(data={"storage": {"url": f"memory://rec-{uuid.uuid4().hex}"}})
    record = RunRecord(cfg, RunFolder.at(cfg.storage.url), io.StringIO())
    record.commits([first, second])
    assert record.failed_in_a_row == 0 and record.committed == {10: True, 20: True}
    writer.save(30, 0, {}, state(30))  # retention runs again at the next commit
    (third,) = writer.drain()
    assert third.error is None and third.retention_error is None
    assert CheckpointStore(storage).steps_on_storage() == [30]


class FolderFsync:
    """An OS whose fsync of a folder fails (EIO) at the chosen calls: a disk, not the product."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: set[int] | None = None, after: int = 0) -> None:
        self.calls = 0
        self.fail = fail or set()
        self.after = after
        real = os.fsync

        def fsync(fd: int) -> None:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                self.calls += 1
                if self.calls in self.fail or (self.after and self.calls >= self.after):
                    raise OSError(errno.EIO, f"injected fsync failure #{self.calls}")
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


def test_a_manifest_published_when_the_folder_fsync_after_the_rename_fails_is_committed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(Storage(f"{tmp_path}/run", retries=1, backoff_s=0, retry_budget_s=0))
    FolderFsync(monkeypatch, after=2)  # the first (before the rename) passes, every later one fails
    writer = CheckpointWriter(store, keep_last=1, async_save=False)
    with caplog.at_level(logging.WARNING, logger="cluster"):
        writer.save(10, 0, {}, state(10))
    (record,) = writer.drain()
    assert record.error is None, record.error
    assert verified(store.storage) == [10]
    assert any("published" in r.getMessage() for r in caplog.records if r.name.startswith("cluster"))


def test_the_folder_fsync_before_the_rename_is_retried_and_never_a_raw_oserror(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(Storage(f"{tmp_path}/run", retries=1, backoff_s=0, retry_budget_s=0))
    FolderFsync(monkeypatch, fail={1})  # fails once: the retry passes
    store.commit(10, files(10), {"epoch": 0})
    assert verified(store.storage) == [10]
    FolderFsync(monkeypatch, after=1)  # keeps failing: a StorageError, no manifest, no temporary left
    with pytest.raises(StorageError, match="injected fsync failure"):
        store.commit(20, files(20), {"epoch": 0})
    assert sorted(os.listdir(f"{tmp_path}/run/{step_dir(20)}")) == ["model.pt", "train_state.pt"]


def test_a_temporary_manifest_is_removed_when_its_rename_fails(tmp_path: Any) -> None:
    faults = Faults()
    store = CheckpointStore(faulty(f"{tmp_path}/run", faults))
    faults.fail("move", MANIFEST, times=1)
    with pytest.raises(StorageError, match="injected failure of move"):
        store.commit(10, files(10), {"epoch": 0})
    assert sorted(os.listdir(f"{tmp_path}/run/{step_dir(10)}")) == ["model.pt", "train_state.pt"]
    assert store.list() == []


def test_a_temporary_manifest_left_by_a_killed_writer_goes_when_its_step_is_written_again(
    tmp_path: Any,
) -> None:
    storage = Storage(f"{tmp_path}/run")
    left = f"{step_dir(10)}/{MANIFEST}.tmp-4242-17"  # the writer was killed between the write and the rename
    storage.write_bytes(left, b'{"step": 10')
    CheckpointStore(storage).commit(10, files(10), {"epoch": 0})
    assert sorted(storage.listdir(step_dir(10))) == [MANIFEST, "model.pt", "train_state.pt"]


def test_a_commit_reads_its_checkpoint_back(tmp_path: Any) -> None:
    """The read-back is what makes a commit's outcome the reader's: its reads are counted on storage."""
    storage = Storage(f"{tmp_path}/run")
    info = CheckpointStore(storage).commit(10, files(10), {"epoch": 0})
    assert storage.reads == 3 and storage.bytes_read > info.total_bytes  # the manifest and both files


class CountingFS:
    """A storage's own filesystem with every file read (``cat_file``, ``open`` to read) counted by path."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs
        self.reads: Counter[str] = Counter()

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.reads[path] += 1
        return self._fs.cat_file(path, *args, **kwargs)

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if not any(c in mode for c in "wax+"):
            self.reads[path] += 1
        return self._fs.open(path, mode, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def data_reads(self, storage: Storage) -> dict[int, dict[str, int]]:
        """step -> {file: reads} of the checkpoints' data files (manifests left out: retention lists them)."""
        out: dict[int, dict[str, int]] = {}
        base = storage.path.rstrip("/") + "/"
        for path, n in self.reads.items():
            rel = str(path)[len(base) :] if str(path).startswith(base) else str(path).lstrip("/")
            parts = rel.split("/")
            if len(parts) == 3 and parts[1].startswith("step_") and parts[2] != MANIFEST:
                out.setdefault(int(parts[1][5:]), {})[parts[2]] = n
        return out


def counting(storage: Storage) -> CountingFS:
    fs = CountingFS(storage.fs)
    storage.fs = fs  # type: ignore[assignment]
    return fs


def scored_state(step: int, loss: float) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"score": {"metric": "loss", "mode": "min", "value": loss}}, state(step)


def test_a_commit_and_its_retention_read_the_new_checkpoint_once_and_no_older_one(root: str) -> None:
    """keep_last=3 with the best kept: a commit costs its own read-back, retention adds no read."""
    storage = Storage(root)
    writer = CheckpointWriter(CheckpointStore(storage), keep_last=3, keep_best=True, async_save=False)
    for step, loss in [(10, 0.1), (20, 0.5), (30, 0.4), (40, 0.3)]:
        writer.save(step, 0, *scored_state(step, loss))
    fs = counting(storage)
    writer.save(50, 0, *scored_state(50, 0.2))
    (record,) = writer.drain()[-1:]
    assert record.error is None and record.retention_error is None, record
    assert fs.data_reads(storage) == {50: {"model.pt": 1, "train_state.pt": 1}}
    assert CheckpointStore(storage).steps_on_storage() == [10, 30, 40, 50]  # 10: the best; 20 deleted
    assert verified(storage) == [10, 30, 40, 50]


def test_retention_from_a_fresh_process_reads_back_the_newest_once(root: str) -> None:
    storage = Storage(root)
    for step in (10, 20, 30, 40):
        CheckpointStore(storage).commit(step, files(step), {"epoch": 0})
    fs = counting(storage)
    assert CheckpointStore(storage).retain(keep_last=3) == [10]
    assert fs.data_reads(storage) == {40: {"model.pt": 1, "train_state.pt": 1}}


def test_bit_rot_in_the_newest_is_read_back_and_a_verified_one_is_left(root: str) -> None:
    """The run resumed from 20 after 30 rotted: the writer's retention reads 30 back (it is newer than the
    commit just read back), moves it aside, and keeps 25, which its commit read back; 10 and 20 are never
    read, and a verified checkpoint is left."""
    storage = Storage(root)
    for step in (10, 20, 30):
        CheckpointStore(storage).commit(step, files(step), {"epoch": 0})
    flip_byte(storage, f"{step_dir(30)}/model.pt")
    fs = counting(storage)
    writer = CheckpointWriter(CheckpointStore(storage), keep_last=1, async_save=False)
    writer.save(25, 0, {}, state(25))
    (record,) = writer.drain()
    assert record.error is None and [s for s, _ in record.quarantined] == [30]
    assert fs.data_reads(storage) == {25: {"model.pt": 1, "train_state.pt": 1}, 30: {"model.pt": 1}}
    assert verified(storage) == [25] and CheckpointStore(storage).steps_on_storage() == [25]
    loaded = CheckpointStore(Storage(root)).load_latest()
    assert loaded is not None and loaded.info.step == 25 and loaded.skipped == []
