"""A small task that records which sample ids each rank trained at each step (for exactly-once audits)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from cluster import Task, TensorBatchDataset


class AuditTask(Task):
    """task_args: audit_dir (required), samples (512), features (8), step_sleep_s (0.0), nan_ids ([]: sample
    ids whose batch's loss is NaN, as a corrupt sample's would be)."""

    def build_model(self) -> nn.Module:
        f = int(self.args.get("features", 8))
        return nn.Sequential(nn.Linear(f, 16), nn.ReLU(), nn.Linear(16, 2))

    def build_train_dataset(self) -> TensorBatchDataset:
        n, f = int(self.args.get("samples", 512)), int(self.args.get("features", 8))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, f, generator=g)
        y = (x[:, 0] > 0).long()
        return TensorBatchDataset(x, y, torch.arange(n))

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        x, y, ids = batch
        cur = self.current
        assert cur is not None
        path = os.path.join(str(self.args["audit_dir"]), f"rank{cur.rank}-pid{os.getpid()}.jsonl")
        with open(path, "a") as fh:
            fh.write(
                json.dumps(
                    {
                        "epoch": cur.epoch,
                        "step": cur.global_step,
                        "attempt": cur.attempt,
                        "rank": cur.rank,
                        "world": cur.world_size,
                        "ids": ids.tolist(),
                    }
                )
                + "\n"
            )
        sleep = float(self.args.get("step_sleep_s", 0.0))
        if sleep:
            import time

            time.sleep(sleep)
        loss = nn.functional.cross_entropy(model(x), y)
        if set(ids.tolist()) & set(self.args.get("nan_ids", [])):
            loss = loss * float("nan")
        return loss, {}


def audit(audit_dir: str, steps_per_epoch: int, global_batch: int, epochs: int) -> dict[int, int]:
    """For each (epoch, step) keep the newest attempt's records; check every epoch trained each sample of
    its permutation exactly once. Returns {world_size: steps trained at that size} for the surviving steps."""
    by_step: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for name in os.listdir(audit_dir):
        for line in open(os.path.join(audit_dir, name)):
            rec = json.loads(line)
            by_step.setdefault((rec["epoch"], rec["step"]), []).append(rec)
    sizes: dict[int, int] = {}
    for epoch in range(epochs):
        seen: list[int] = []
        for step in range(epoch * steps_per_epoch + 1, (epoch + 1) * steps_per_epoch + 1):
            recs = by_step.get((epoch, step))
            assert recs, f"epoch {epoch} step {step} was never trained"
            newest = max(r["attempt"] for r in recs)
            final = [r for r in recs if r["attempt"] == newest]
            world = final[0]["world"]
            assert sorted(r["rank"] for r in final) == list(range(world)), (epoch, step, final)
            ids = [i for r in final for i in r["ids"]]
            assert len(ids) == global_batch, (epoch, step, len(ids))
            seen.extend(ids)
            sizes[world] = sizes.get(world, 0) + 1
        assert len(seen) == len(set(seen)), f"epoch {epoch} repeated a sample"
    return sizes


class SlowCharLM(Task):
    """The example char-LM with a sleep per step (numerics untouched), so faults can land mid-epoch."""

    def __init__(self, **args: Any) -> None:
        super().__init__(**args)
        from jobs.tasks.charlm import CharLMTask

        inner_args = {k: v for k, v in args.items() if k != "step_sleep_s"}
        self.inner = CharLMTask(**inner_args)

    def build_model(self) -> nn.Module:
        return self.inner.build_model()

    def build_train_dataset(self) -> Any:
        return self.inner.build_train_dataset()

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return self.inner.build_optimizer(model)

    def build_eval_dataset(self) -> Any:
        return self.inner.build_eval_dataset()

    def compute_eval(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return self.inner.compute_eval(model, batch)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        return self.inner.build_scheduler(optimizer, total_steps)

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        import time

        time.sleep(float(self.args.get("step_sleep_s", 0.05)))
        return self.inner.compute_loss(model, batch)
