"""Walk every injection point of the checkpoint store's writes (commit with retention, retention alone,
discard_after) on a backend (a local folder or S3 on moto), and check what a user trusts after each
fault and after the recovery that redoes the operation on healthy storage:

- ``load_latest`` never returns an older checkpoint than the newest that verified before the operation
  (for a discard: the newest at or before its point), and never None;
- every checkpoint that verified before and that the operation, run without faults, keeps still
  verifies (nothing is deleted by accident);
- the rotten checkpoint and the set-aside best/milestones are never lost: their bytes are still under
  ``step_N/`` or under ``quarantine/`` / ``discarded/``;
- after the recovery the run holds exactly what the fault-free operation leaves.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem

from cluster.core.errors import CheckpointError, StorageError
from cluster.run.checkpoint import (
    DISCARDED,
    QUARANTINE,
    CheckpointStore,
    CheckpointWriter,
    serialize,
    step_dir,
)
from cluster.run.storage import Storage
from tests.support.faultfs import Faults

ROT = b"bit rot"


@dataclass
class Backend:
    """Where runs live: ``storage(root)`` is the healthy view, ``storage(root, faults)`` the breaking one."""

    make: Callable[[str, Faults | None], Storage]
    prefix: str

    def new_root(self) -> str:
        return f"{self.prefix}/{uuid.uuid4().hex[:10]}"

    def storage(self, root: str, faults: Faults | None = None) -> Storage:
        return self.make(root, faults)

    def clone(self, root: str) -> str:
        """A new root holding a byte-for-byte copy of every file under ``root`` (a local folder: the whole
        tree; an object store: each object, copied on the server)."""
        new = self.new_root()
        fs, src = self.storage(root).open_fs_path("")
        _, dst = self.storage(new).open_fs_path("")
        src, dst = src.rstrip("/"), dst.rstrip("/")
        if isinstance(fs, LocalFileSystem):
            shutil.copytree(src, dst)
        else:
            for path in fs.find(src):
                fs.copy(path, dst + path[len(src) :])
        return new


def local_backend(tmp: str) -> Backend:
    def make(root: str, faults: Faults | None) -> Storage:
        if faults is None:
            return Storage(root)
        return Storage(f"faultfile://{root}", {"faults": faults}, retries=0, backoff_s=0, retry_budget_s=0)

    return Backend(make, tmp)


def s3_backend(bucket: str, options: dict[str, Any]) -> Backend:
    def make(root: str, faults: Faults | None) -> Storage:
        if faults is None:
            return Storage(f"s3://{bucket}/{root}", options, retries=2, backoff_s=0.05, retry_budget_s=0)
        opts = {"faults": faults, "target_protocol": "s3", "target_options": options}
        return Storage(f"fault://{bucket}/{root}", opts, retries=0, backoff_s=0, retry_budget_s=0)

    return Backend(make, "runs")


def files(step: int) -> dict[str, bytes]:
    return {
        "model.pt": serialize({"w": torch.full((8,), float(step))}),
        "train_state.pt": serialize({"step": step}),
    }


def commit(store: CheckpointStore, step: int, score: float | None = None) -> None:
    meta: dict[str, Any] = {"epoch": 0}
    if score is not None:
        meta["score"] = {"metric": "loss", "mode": "min", "value": score}
    store.commit(step, files(step), meta)


@dataclass
class Scenario:
    name: str
    setup: Callable[[CheckpointStore], None]
    """Builds the run on healthy storage."""
    op: Callable[[CheckpointStore], None]
    """The operation walked: run on the breaking storage, then again (the recovery) on healthy storage."""
    floor: int
    """The newest checkpoint that verifies before the operation (for a discard: at or before its point):
    ``load_latest`` never returns an older one."""
    kept_aside: tuple[int, ...] = ()
    """Steps whose bytes must never be lost (rotten ones to quarantine, the best/milestones set aside)."""


def _commit_setup(store: CheckpointStore) -> None:
    commit(store, 10, 0.1)  # the best
    commit(store, 20, 0.5)
    commit(store, 40, 0.4)
    store.storage.write_bytes(f"{step_dir(40)}/model.pt", ROT)  # the newest rots; the run resumes at 20


def _commit_op(store: CheckpointStore) -> None:
    """The rank-0 writer after a resume from step 20: commit 30, then retention (the writer's own path)."""
    writer = CheckpointWriter(store, keep_last=1, keep_best=True, async_save=False)
    writer.save(30, 0, {}, {"model.pt": {"w": torch.full((8,), 30.0)}, "train_state.pt": {"step": 30}})


def _retain_setup(store: CheckpointStore) -> None:
    for step in (10, 20, 30, 40, 50):
        commit(store, step)
    store.storage.write_bytes(f"{step_dir(50)}/model.pt", ROT)
    store.storage.write_bytes(f"{step_dir(30)}/manifest.json", ROT)  # a corrupt manifest


def _retain_op(store: CheckpointStore) -> None:
    store.retain(keep_last=2, keep_every=20)  # 40 and 20 verify; 20 and 40 are milestones


def _discard_setup(store: CheckpointStore) -> None:
    for step, score in [(10, 0.3), (20, 0.5), (30, 0.1), (40, None), (50, None)]:
        commit(store, step, score)  # 30 is the best, 40 a milestone


def _discard_op(store: CheckpointStore) -> None:
    store.discard_after(20, keep_every=40)  # a rollback to 20; the best and the milestone set aside


SCENARIOS = [
    Scenario("commit+retain", _commit_setup, _commit_op, floor=20, kept_aside=(40,)),
    Scenario("retain", _retain_setup, _retain_op, floor=40, kept_aside=(30, 50)),
    Scenario("discard_after", _discard_setup, _discard_op, floor=20, kept_aside=(30, 40)),
]


def verified_steps(storage: Storage) -> set[int]:
    store = CheckpointStore(storage)
    out = set()
    for info in store.list():
        try:
            store.read_verified(info)
            out.add(info.step)
        except CheckpointError:
            pass
    return out


def newest_verified(storage: Storage) -> int:
    loaded = CheckpointStore(storage).load_latest()
    assert loaded is not None, "a run with verified checkpoints resolved to no checkpoint"
    return loaded.info.step


def bytes_kept(storage: Storage, step: int, original: bytes) -> bool:
    """Whether a step's model.pt bytes are still somewhere: in place, quarantined or set aside."""
    name = step_dir(step).rsplit("/", 1)[1]
    places = [step_dir(step)]
    for folder in (QUARANTINE, DISCARDED):
        places += [f"{folder}/{n}" for n in storage.listdir(folder) if n.split(".")[0] == name]
    for place in places:
        try:
            if storage.read_bytes(f"{place}/model.pt") == original:
                return True
        except FileNotFoundError:
            continue
    return False


def walk(backend: Backend, scenario: Scenario) -> list[str]:
    """Run ``scenario`` once without faults (its injection points and end state, checked too), then once
    per injection point and mode (fail once / crash), checking the invariants after the fault and after
    the recovery. Returns the points walked, for the test's report.

    The run ``scenario.setup`` builds is built once, as a template; each walk starts on a copy of it (the
    same bytes, so what verified before and the bytes kept aside are the template's)."""
    template = backend.new_root()
    built = backend.storage(template)
    scenario.setup(CheckpointStore(built))
    before, originals = verified_steps(built), _originals(built, scenario)
    root = backend.clone(template)
    healthy = backend.storage(root)
    counter = Faults()
    scenario.op(CheckpointStore(backend.storage(root, counter)))
    expected = [i.step for i in CheckpointStore(healthy).list()]
    kept_free = verified_steps(healthy)
    _check(healthy, scenario, before, kept_free, originals, f"{scenario.name} without faults")
    points = [(k, n) for k in ("write", "move", "delete") for n in range(1, counter.counts[k] + 1)]
    assert points, f"{scenario.name}: no injection point was reached"
    walked = []
    for at in points:
        for crash in (False, True):
            label = f"{scenario.name} {at[0]} #{at[1]} {'crash' if crash else 'fail'}"
            _one(backend, scenario, template, at, crash, (before, originals), expected, kept_free, label)
            walked.append(label)
    return walked


def _originals(storage: Storage, scenario: Scenario) -> dict[int, bytes]:
    return {s: storage.read_bytes(f"{step_dir(s)}/model.pt") for s in scenario.kept_aside}


def _one(
    backend: Backend,
    scenario: Scenario,
    template: str,
    at: tuple[str, int],
    crash: bool,
    built: tuple[set[int], dict[int, bytes]],
    expected: list[int],
    kept_free: set[int],
    label: str,
) -> None:
    root = backend.clone(template)
    healthy = backend.storage(root)
    before, originals = built
    faults = Faults(at, crash=crash)
    try:
        scenario.op(CheckpointStore(backend.storage(root, faults)))
    except (StorageError, CheckpointError):
        pass  # the operation failed: what matters is what it left behind
    assert faults.fired, f"{label}: the fault never fired"
    _check(healthy, scenario, before, kept_free, originals, f"{label}, after the fault")
    scenario.op(CheckpointStore(backend.storage(root)))  # the recovery redoes it, on healthy storage
    _check(healthy, scenario, before, kept_free, originals, f"{label}, after the recovery")
    got = [i.step for i in CheckpointStore(healthy).list()]
    assert got == expected, f"{label}: after the recovery the run holds {got}, not {expected}"


def _check(
    healthy: Storage,
    scenario: Scenario,
    before: set[int],
    kept_free: set[int],
    originals: dict[int, bytes],
    label: str,
) -> None:
    latest = newest_verified(healthy)
    assert latest >= scenario.floor, f"{label}: step {latest} is the latest, older than {scenario.floor}"
    lost = (before & kept_free) - verified_steps(healthy)
    assert not lost, f"{label}: verified checkpoints {sorted(lost)} were deleted"
    for step, data in originals.items():
        assert bytes_kept(healthy, step, data), f"{label}: step {step}'s bytes are gone"
