"""Small tasks that break the Task contract in one way each (task_args.mode), for the dry run's tests."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from cluster import Task, TensorBatchDataset


class Unpicklable(TensorBatchDataset):
    def __reduce__(self) -> Any:
        raise TypeError("holds an open file")


class SlowReads(TensorBatchDataset):
    """Each batch read waits ``sleep_s`` (storage latency), using no CPU."""

    def __init__(self, sleep_s: float, *tensors: torch.Tensor) -> None:
        super().__init__(*tensors)
        self.sleep_s = sleep_s

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        time.sleep(self.sleep_s)
        return super().get_batch(indices)


class Net(nn.Module):
    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        if unused:
            self.head2 = nn.Linear(8, 3)  # never called in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Broken(Task):
    """task_args.mode: ok, raise, detached, wrong_shape, unused, unpicklable, eval_metrics; read_sleep_s:
    each training batch read waits that long."""

    def build_model(self) -> nn.Module:
        return Net(unused=self.args.get("mode") == "unused")

    def build_train_dataset(self) -> Any:
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        if self.args.get("read_sleep_s"):
            return SlowReads(float(self.args["read_sleep_s"]), x, (x[:, 0] > 0).long())
        cls = Unpicklable if self.args.get("mode") == "unpicklable" else TensorBatchDataset
        return cls(x, (x[:, 0] > 0).long())

    def build_eval_dataset(self) -> Any:
        x = torch.randn(20, 4, generator=torch.Generator().manual_seed(1))
        return TensorBatchDataset(x, (x[:, 0] > 0).long())

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = batch
        mode = self.args.get("mode")
        if mode == "raise":
            raise ValueError(f"labels out of range: {int(y.max())}")
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
        if mode == "detached":
            loss = loss.detach()
        if mode == "wrong_shape":
            loss = nn.functional.cross_entropy(logits, y, reduction="none")
        return loss, {"acc": (logits.argmax(1) == y).float().mean()}

    def compute_eval(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        loss, metrics = self.compute_loss(model, batch)
        return (loss, {"f1": 0.5}) if self.args.get("mode") == "eval_metrics" else (loss, metrics)
