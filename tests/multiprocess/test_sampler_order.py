"""The data order a run trains, through the real worker over gloo: a new run trains torch's DistributedSampler
order; a run resumed from a checkpoint written before ``sampler_order`` existed keeps the legacy order."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

from cluster.data.pipeline import LEGACY_ORDER, TORCH_ORDER
from cluster.run.checkpoint import MANIFEST, CheckpointStore, deserialize, serialize, step_dir
from cluster.run.storage import Storage
from cluster.spec.config import JobConfig
from tests.multiprocess.mp_helpers import run_workers, tiny_config

pytestmark = pytest.mark.timeout(240)

SEED, WORLD, BATCH, SAMPLES = 3, 2, 32, 512


def _config(storage: str, audit: Path) -> JobConfig:
    audit.mkdir()
    return tiny_config(
        storage,
        [
            "task=tests.support.tasks:AuditTask",
            f"task_args.audit_dir={audit}",
            f"task_args.samples={SAMPLES}",
            f"training.seed={SEED}",
            "training.max_steps_per_epoch=6",
            "checkpoint.every_steps=3",
            "checkpoint.keep_last=5",
        ],
    )


def _trained(audit: Path) -> dict[tuple[int, int], list[int]]:
    """{(global step, rank): sample ids} from the audit task's records."""
    out = {}
    for name in os.listdir(audit):
        for line in open(audit / name):
            rec = json.loads(line)
            out[(rec["step"], rec["rank"])] = rec["ids"]
    return out


class _Sized(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> int:
        return i


def _legacy_ids(step: int, rank: int) -> list[int]:
    """What runs before sampler order 2 trained at 0-based ``step`` of epoch 0."""
    perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED * 1_000_003 + 0))
    return perm[step * BATCH : (step + 1) * BATCH][rank::WORLD].tolist()


def _torch_ids(step: int, rank: int) -> list[int]:
    ds = DistributedSampler(_Sized(), num_replicas=WORLD, rank=rank, shuffle=True, seed=SEED, drop_last=True)
    ds.set_epoch(0)
    per = BATCH // WORLD
    return list(ds)[step * per : (step + 1) * per]


def _state(store: CheckpointStore, step: int) -> dict[str, Any]:
    info, why = store.read_manifest(step)
    assert info is not None, why
    state: dict[str, Any] = deserialize(store.read_verified(info)["train_state.pt"])
    return state


@pytest.mark.slow  # > 10 s on 2 cores: full suite only
def test_new_runs_train_torch_order_and_legacy_checkpoints_resume_in_legacy_order(tmp_path: Path) -> None:
    run = f"{tmp_path}/s/run"
    out1, out2 = tmp_path / "o1", tmp_path / "o2"
    out1.mkdir()
    out2.mkdir()
    run_workers(WORLD, _config(f"{tmp_path}/s", tmp_path / "a1"), run, [(0, 0)], str(out1))
    first = _trained(tmp_path / "a1")
    for step in range(6):
        for r in range(WORLD):
            assert first[(step + 1, r)] == _torch_ids(step, r), (step, r)
    store = CheckpointStore(Storage(run))
    assert _state(store, 6)["sampler_order"] == TORCH_ORDER

    # Make step 3 a checkpoint of an earlier version (no sampler_order) and drop the later one.
    info, _ = store.read_manifest(3)
    assert info is not None
    files = store.read_verified(info)
    state = deserialize(files["train_state.pt"])
    del state["sampler_order"]
    meta = {k: v for k, v in info.manifest.items() if k not in ("step", "format", "files", "committed_at")}
    store.commit(3, {**files, "train_state.pt": serialize(state)}, meta)
    store.storage.rm(f"{step_dir(6)}/{MANIFEST}")
    assert [i.step for i in store.list()] == [3]

    res = run_workers(WORLD, _config(f"{tmp_path}/s", tmp_path / "a2"), run, [(-1, -1)], str(out2))
    assert res[0]["resume"].global_step == 3
    second = _trained(tmp_path / "a2")
    assert sorted(second) == [(s, r) for s in (4, 5, 6) for r in range(WORLD)]
    for step in range(3, 6):
        for r in range(WORLD):
            assert second[(step + 1, r)] == _legacy_ids(step, r), (step, r)
            assert second[(step + 1, r)] != _torch_ids(step, r)
    # and the run's next checkpoint records the order it keeps
    assert _state(store, 6)["sampler_order"] == LEGACY_ORDER
