"""Corrupt, torn and malicious checkpoints are never loaded: load_latest falls back to the newest one that
verifies and says why it skipped each newer one."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch

from cluster.core.errors import CheckpointError
from cluster.run.checkpoint import (
    MANIFEST,
    CheckpointStore,
    CheckpointUnreadableError,
    CheckpointWriter,
    check_loadable,
    serialize,
    snapshot,
    step_dir,
)
from cluster.run.storage import Storage

pytestmark = pytest.mark.timeout(60)


def make_store(tmp_path: Any) -> CheckpointStore:
    return CheckpointStore(Storage(f"{tmp_path}/run"))


def commit(store: CheckpointStore, step: int) -> None:
    files = {
        "model.pt": serialize({"w": torch.full((64,), float(step))}),
        "train_state.pt": serialize({"step": step}),
    }
    store.commit(step, files, {"epoch": 0})


def path(tmp_path: Any, step: int, name: str) -> str:
    return f"{tmp_path}/run/{step_dir(step)}/{name}"


def flip_bytes(p: str) -> None:
    data = bytearray(open(p, "rb").read())
    for i in (len(data) // 3, len(data) // 2):
        data[i] ^= 0xFF
    with open(p, "wb") as fh:
        fh.write(bytes(data))


def delete_model(p: str) -> None:
    os.remove(p)


def truncate(p: str) -> None:
    data = open(p, "rb").read()
    with open(p, "wb") as fh:
        fh.write(data[: len(data) // 2])


@pytest.mark.parametrize(
    ("damage", "target", "reason"),
    [
        (flip_bytes, "model.pt", "fails its checksum"),
        (truncate, "train_state.pt", "fails its checksum"),
        (delete_model, "model.pt", "is missing"),
        (delete_model, MANIFEST, "no manifest.json"),
        (truncate, MANIFEST, "not valid JSON"),
    ],
    ids=["flipped-bytes", "truncated-file", "deleted-file", "deleted-manifest", "truncated-manifest"],
)
def test_damaged_latest_falls_back_to_previous_verified(
    tmp_path: Any, damage: Any, target: str, reason: str
) -> None:
    store = make_store(tmp_path)
    for step in (10, 20, 30):
        commit(store, step)
    damage(path(tmp_path, 30, target))
    loaded = store.load_latest()
    assert loaded is not None
    assert loaded.info.step == 20
    assert torch.equal(loaded.files["model.pt"]["w"], torch.full((64,), 20.0))
    assert len(loaded.skipped) == 1
    step, why = loaded.skipped[0]
    assert step == 30 and reason in why and step_dir(30) in why
    assert store.last_skipped == loaded.skipped


def test_every_checkpoint_damaged_loads_nothing_and_reports_all(tmp_path: Any) -> None:
    store = make_store(tmp_path)
    for step in (10, 20):
        commit(store, step)
    flip_bytes(path(tmp_path, 20, "model.pt"))
    os.remove(path(tmp_path, 10, MANIFEST))
    assert store.load_latest() is None
    assert [s for s, _ in store.last_skipped] == [20, 10]


def test_recommit_of_a_step_removes_the_old_manifest_first(tmp_path: Any) -> None:
    store = make_store(tmp_path)
    commit(store, 10)
    storage = store.storage
    writes: list[tuple[str, bool]] = []
    real = storage.write_bytes

    def spy(rel: str, data: bytes) -> None:
        writes.append((rel, os.path.exists(path(tmp_path, 10, MANIFEST))))
        real(rel, data)

    storage.write_bytes = spy  # type: ignore[method-assign]
    commit(store, 10)
    data_writes = [w for w in writes if not w[0].endswith(MANIFEST) and ".tmp-" not in w[0]]
    assert data_writes and not any(had_manifest for _, had_manifest in data_writes)
    assert store.load_latest() is not None


class Exploit:
    """Unpickling this object calls open(marker, "w"): code execution on load."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_malicious_pickle_with_valid_checksum_is_refused_and_raises(tmp_path: Any) -> None:
    marker = f"{tmp_path}/pwned"
    evil = serialize({"w": torch.zeros(3), "payload": Exploit(marker)})
    # control: the payload is real (a full unpickler runs it)
    control = f"{tmp_path}/control"
    import io

    torch.load(io.BytesIO(serialize(Exploit(control))), weights_only=False)
    assert os.path.exists(control)

    store = make_store(tmp_path)
    commit(store, 10)
    store.commit(20, {"model.pt": evil, "train_state.pt": serialize({"step": 20})}, {"epoch": 0})
    assert [i.step for i in store.list()] == [10, 20]  # committed with a matching checksum
    store.read_verified(store.list()[-1])  # and it verifies
    # it is what was written: taking step 10 in its place would silently drop 10 steps of training
    with pytest.raises(
        CheckpointUnreadableError,
        match=r"step_000000020/model.pt verifies but cannot be loaded "
        r"safely \(WeightsUnpickler error: Unsupported global",
    ):
        store.load_latest()
    with pytest.raises(Exception, match=r"Unsupported global|weights_only"):
        store.load_step(20)
    assert not os.path.exists(marker)


def test_manifest_cannot_point_outside_the_checkpoint(tmp_path: Any) -> None:
    store = make_store(tmp_path)
    commit(store, 10)
    commit(store, 20)
    mpath = path(tmp_path, 20, MANIFEST)
    manifest = json.load(open(mpath))
    manifest["files"]["../../../../outside.pt"] = manifest["files"].pop("model.pt")
    with open(mpath, "w") as fh:
        json.dump(manifest, fh)
    loaded = store.load_latest()
    assert loaded is not None and loaded.info.step == 10
    assert "leave the run's folder" in loaded.skipped[0][1]


def test_snapshot_reuses_host_buffers_and_copies_values() -> None:
    from cluster.run.checkpoint import HostBuffers

    state = {"model": {"w": torch.randn(1000)}, "opt": [torch.ones(3), (torch.zeros(2), 5)], "step": 7}
    pool = HostBuffers()
    a = snapshot(state, pool)
    buf_ptr = a["model"]["w"].data_ptr()
    assert a["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()
    torch.testing.assert_close(a["model"]["w"], state["model"]["w"])
    state["model"]["w"].add_(1.0)  # training continues: the snapshot must not change
    assert not torch.equal(a["model"]["w"], state["model"]["w"])
    b = snapshot(state, pool)
    assert b["model"]["w"].data_ptr() == buf_ptr  # the second snapshot reuses the buffer
    torch.testing.assert_close(b["model"]["w"], state["model"]["w"])
    assert b["step"] == 7 and b["opt"][1][1] == 5


def test_async_writer_commits_what_was_saved_not_what_followed(tmp_path: Any) -> None:
    store = make_store(tmp_path)
    writer = CheckpointWriter(store, keep_last=5, async_save=True)
    w = torch.zeros(100_000)
    for step in (1, 2, 3):
        w.fill_(float(step))
        writer.save(step, 0, {}, {"model.pt": {"w": w}, "train_state.pt": {"step": step}})
        w.fill_(-1.0)  # mutate right after save returns, while the write may be in flight
    writer.close()
    for step in (1, 2, 3):
        assert torch.equal(store.load_step(step)["model.pt"]["w"], torch.full((100_000,), float(step)))


def numpy_lr_state() -> dict[str, Any]:
    """An optimizer whose learning rate a schedule set to a numpy scalar: the safe loader refuses it."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    opt.param_groups[0]["lr"] = np.float64(0.05)
    return {"optimizer": opt.state_dict(), "step": 3}


def test_check_loadable_names_the_refused_value_and_where_it_sits() -> None:
    check_loadable({"optimizer": {"lr": 0.1}, "w": torch.ones(2), "shape": torch.Size([2])}, "x")
    with pytest.raises(
        CheckpointError,
        match=r"^train_state.pt\['optimizer'\]\['param_groups'\]\[0\]\['lr'\] is a numpy.float64: "
        r"torch.load\(weights_only=True\) refuses it",
    ):
        check_loadable(numpy_lr_state(), where="train_state.pt")


def test_a_state_that_cannot_be_loaded_is_never_written(tmp_path: Any) -> None:
    """Issue 31: the writer committed a state that no resume could load back."""
    store = make_store(tmp_path)
    writer = CheckpointWriter(store, keep_last=1, async_save=False)
    writer.save(5, 0, {}, {"model.pt": {"w": torch.ones(2)}, "train_state.pt": {"step": 5}})
    writer.save(10, 0, {}, {"model.pt": {"w": torch.ones(2)}, "train_state.pt": numpy_lr_state()})
    ok, refused = writer.drain()
    assert ok.error is None
    assert refused.error is not None and "['param_groups'][0]['lr'] is a numpy.float64" in refused.error
    assert "train_state.pt" in refused.error
    assert store.steps_on_storage() == [5]  # nothing of step 10 was written, and step 5 was kept
    loaded = store.load_latest()
    assert loaded is not None and loaded.info.step == 5


def test_commit_record_reports_what_retention_quarantined(tmp_path: Any) -> None:
    store = make_store(tmp_path)
    for step in (10, 30):
        commit(store, step)
    flip_bytes(path(tmp_path, 30, "model.pt"))
    writer = CheckpointWriter(CheckpointStore(store.storage), keep_last=1, async_save=False)
    writer.save(20, 0, {}, {"model.pt": {"w": torch.ones(2)}, "train_state.pt": {"step": 20}})
    (record,) = writer.drain()
    assert record.error is None
    assert [s for s, _ in record.quarantined] == [30] and "fails its checksum" in record.quarantined[0][1]
    assert [i.step for i in store.list()] == [20]


def test_local_writes_are_fsynced_file_then_folder_before_the_rename(tmp_path: Any) -> None:
    """Issue 31: a manifest published by rename before its data (and the folder entries) reached the disk
    could name files a power cut loses. Watched through the OS calls themselves (os.fsync/os.rename)."""
    store = make_store(tmp_path)
    calls: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(a: str, b: str, **kw: Any) -> None:
        calls.append(("rename", str(b)))
        real_rename(a, b, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(os, "fsync", fsync)
    mp.setattr(os, "rename", rename)
    try:
        commit(store, 10)
    finally:
        mp.undo()
    folder = f"{tmp_path}/run/{step_dir(10)}"
    published = calls.index(("rename", f"{folder}/{MANIFEST}"))
    before = calls[:published]
    assert ("fsync", f"{folder}/model.pt") in before and ("fsync", f"{folder}/train_state.pt") in before
    assert any(c[0] == "fsync" and f"{MANIFEST}.tmp-" in c[1] for c in before)
    assert before[-1] == ("fsync", folder)  # the folder's entries, last before the rename
    assert ("fsync", folder) in calls[published + 1 :]  # and the rename itself
