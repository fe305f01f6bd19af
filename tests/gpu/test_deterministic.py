"""training.deterministic on a GPU: a run stopped after an epoch and resumed from its checkpoint in a new
process ends bitwise equal to an uninterrupted run. Skipped where there is no CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiprocess.mp_helpers import run_workers, tiny_config

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]


def test_resumed_gpu_run_is_bitwise_the_uninterrupted_one(tmp_path: Path) -> None:
    overrides = [
        "scaling.use_gpu=true",
        "workers=1",
        "training.deterministic=true",
        "training.seed=5",
        "training.epochs=2",
        "training.max_steps_per_epoch=6",
        "task_args.dropout=0.1",  # per-step RNG streams matter too
    ]

    def run(name: str, plan: list[tuple[int, int]], storage: str) -> dict[str, torch.Tensor]:
        out = tmp_path / name
        out.mkdir()
        (res,) = run_workers(1, tiny_config(storage, overrides), f"{storage}/run", plan, str(out))
        params: dict[str, torch.Tensor] = res["params"]
        return params

    whole = run("whole", [(0, 0), (1, 0)], f"{tmp_path}/a")
    run("first", [(0, 0)], f"{tmp_path}/b")  # checkpoints at the epoch's end, then the process exits
    resumed = run("resumed", [(-1, -1)], f"{tmp_path}/b")
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)
