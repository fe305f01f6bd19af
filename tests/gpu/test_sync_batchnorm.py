"""training.sync_batchnorm on GPUs (torch's SyncBatchNorm does not run on CPU; CPU jobs get a config error,
see tests/unit/test_config.py). Skipped where there is no CUDA device. With one GPU the 2-rank test shares
it between the ranks over gloo (``scaling.gpus_per_worker=0.5``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.run.checkpoint import CheckpointStore
from cluster.run.storage import Storage
from cluster.spec.config import JobConfig
from cluster.spec.task import build_task
from tests.multiprocess.mp_helpers import run_workers, tiny_config

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]

TASK = "tests.support.tasks:MapStyleTask"


def _config(storage: str, workers: int, sync: bool) -> JobConfig:
    # 2 ranks on 1 GPU share it over gloo (NCCL refuses two ranks on one device): what the test checks,
    # SyncBatchNorm's statistics across ranks, is the same; a machine with 2+ GPUs runs NCCL, one per rank
    shared = workers > torch.cuda.device_count()
    return tiny_config(
        storage,
        [
            *(["scaling.gpus_per_worker=0.5", "scaling.backend=gloo"] if shared else []),
            f"task={TASK}",
            "task_args.batchnorm=true",
            "scaling.use_gpu=true",
            f"workers={workers}",
            "training.seed=7",
            "training.max_steps_per_epoch=8",
            f"training.sync_batchnorm={str(sync).lower()}",
        ],
    )


def _train(tmp_path: Path, name: str, workers: int, sync: bool) -> list[dict[str, Any]]:
    out = tmp_path / name
    out.mkdir()
    cfg = _config(f"{tmp_path}/{name}-s", workers, sync)
    return run_workers(workers, cfg, f"{tmp_path}/{name}-s/run", [(0, 0)], str(out))


def test_sync_batchnorm_trains_and_checkpoints_load_into_the_plain_model(tmp_path: Path) -> None:
    (synced,) = _train(tmp_path, "sync", 1, True)
    (plain,) = _train(tmp_path, "plain", 1, False)
    for name, value in plain["params"].items():  # one rank: SyncBatchNorm is BatchNorm
        torch.testing.assert_close(synced["params"][name], value, rtol=1e-5, atol=1e-6)
    loaded = CheckpointStore(Storage(f"{tmp_path}/sync-s/run")).load_latest()
    assert loaded is not None
    model = build_task(TASK, {"batchnorm": True}).build_model()
    model.load_state_dict(loaded.files["model.pt"])  # strict: same keys as BatchNorm's


def test_two_ranks_with_sync_batchnorm_equal_one_process_on_the_global_batch(tmp_path: Path) -> None:
    (one,) = _train(tmp_path, "one", 1, False)
    synced = _train(tmp_path, "two-sync", 2, True)
    local = _train(tmp_path, "two-local", 2, False)
    weight = "0.weight"  # the Linear before the BatchNorm: its gradient goes through the batch statistics
    for name, value in one["params"].items():
        torch.testing.assert_close(synced[0]["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    # without it each rank normalises with its own half-batch's statistics: another model
    assert not torch.allclose(local[0]["params"][weight], one["params"][weight], rtol=1e-4, atol=1e-5)
