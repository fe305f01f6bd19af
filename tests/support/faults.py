"""The fault tests' job on a real Ray (``SlowCharLM``, small and slow enough for faults to land mid-epoch)
and how its end state is read: the final model, the event log, bitwise equality of two models."""

from __future__ import annotations

import torch

from cluster.inspect import read_events
from cluster.run.checkpoint import CheckpointStore
from cluster.run.storage import Storage

EPOCHS, STEPS = 2, 15  # 30 steps; checkpoints every 5 steps and at each epoch end

NO_SPARE = "failures.hot_spare=false"
"""For a job in which no rank's process dies (a reference run, a raise, a NaN, a driver's stop or kill):
``auto`` keeps a spare on the test Ray's 4 CPUs, a process that starts, imports torch and builds the model
for nothing (~5 s of CPU a job, tests/README.md). Tests of the spare and of the defaults keep ``auto``."""


def overrides(storage: str, name: str, *extra: str) -> list[str]:
    return [
        f"storage={storage}",
        f"name={name}",
        "task=tests.support.tasks:SlowCharLM",
        "task_args.max_chars=40000",
        "task_args.d_model=32",
        "task_args.n_layers=1",
        "task_args.context=32",
        "task_args.step_sleep_s=0.05",
        "task_args.dropout=0.1",
        "training.global_batch_size=32",
        f"training.epochs={EPOCHS}",
        f"training.max_steps_per_epoch={STEPS}",
        "training.log_every_steps=1",
        "checkpoint.every_steps=5",
        "checkpoint.keep_last=10",
        "failures.backoff_s=0.1",
        "failures.hang_timeout_floor_s=60",
        *extra,
    ]


def final_model(run_url: str) -> dict[str, torch.Tensor]:
    latest = CheckpointStore(Storage(run_url)).load_latest()
    assert latest is not None
    assert latest.info.step == EPOCHS * STEPS
    return latest.files["model.pt"]


def events(run_url: str, kind: str | None = None) -> list[dict]:
    ev = read_events(Storage(run_url))
    return [e for e in ev if kind is None or e["event"] == kind]


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"
