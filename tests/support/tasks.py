"""Small tasks the tests train, named by import path (``task=tests.support.tasks:AuditTask``) so that worker
processes import them too:

- ``AuditTask`` records which sample ids each rank trained at each step; ``audit`` checks them (exactly once).
- ``SlowCharLM``: the example char-LM with a sleep per step (numerics untouched), so faults land mid-epoch.
- ``FlipsOwnBit``: ``SlowCharLM`` that corrupts one bit of its own weights on one rank (silent corruption).
- ``Broken`` breaks the Task contract in one way each (``task_args.mode``), for the dry run's tests.
- ``RaisesIn`` raises in one set-up method (``task_args.method``), on every rank or some.
- ``MapStyleTask`` trains on a plain map-style dataset (collated batches, no ``get_batch``).
- ``NumpyLRTask``: ``MapStyleTask`` whose optimizer's learning rate is a numpy scalar (no checkpoint of it
  loads back through the safe loader).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

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


class FlipsOwnBit(SlowCharLM):
    """``SlowCharLM`` whose ``compute_loss`` flips one bit of its model's first parameter on rank
    ``flip_rank`` at step ``flip_step`` of the first attempt, as a silent error of that rank's hardware would
    (nothing in the product is told). task_args: flip_rank (1), flip_step (required), and SlowCharLM's."""

    def __init__(self, **args: Any) -> None:
        self.flip_rank = int(args.pop("flip_rank", 1))
        self.flip_step = int(args.pop("flip_step"))
        super().__init__(**args)

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        at = self.current
        if at is not None and (at.rank, at.global_step, at.attempt) == (self.flip_rank, self.flip_step, 0):
            from cluster.rank.replica import flip_bit

            flip_bit(next(model.parameters()))
            self.flip_step = -1  # once (gradient accumulation calls this again in the same step)
        return super().compute_loss(model, batch)


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


class PairDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A plain map-style dataset: one sample per ``__getitem__``, no ``get_batch`` (batches are collated)."""

    def __init__(self, n: int, features: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=g)
        self.y = (self.x[:, 0] + 0.5 * self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class MapStyleTask(Task):
    """task_args: samples (400), features (6), batchnorm (false), lr (0.05)."""

    def build_model(self) -> nn.Module:
        f = int(self.args.get("features", 6))
        norm: list[nn.Module] = [nn.BatchNorm1d(16)] if self.args.get("batchnorm") else []
        return nn.Sequential(nn.Linear(f, 16), *norm, nn.ReLU(), nn.Linear(16, 2))

    def build_train_dataset(self) -> PairDataset:
        return PairDataset(int(self.args.get("samples", 400)), int(self.args.get("features", 6)))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=float(self.args.get("lr", 0.05)), momentum=0.9)

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y), {}


class NumpyLRTask(MapStyleTask):
    """``MapStyleTask`` with ``lr`` a ``numpy.float64`` in the optimizer's param groups, as ``np.linspace``
    or a config read through numpy gives it: torch trains with it, but ``torch.load(weights_only=True)``
    refuses a state holding it."""

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        import numpy as np

        return torch.optim.SGD(model.parameters(), lr=np.float64(self.args.get("lr", 0.05)), momentum=0.9)


SETUP_METHODS = (
    "__init__",
    "build_train_dataset",
    "build_eval_dataset",
    "build_model",
    "build_optimizer",
    "build_scheduler",
)
"""The Task methods a worker calls in set-up, in the order it calls them (``RaisesIn``)."""


class RaisesIn(Broken):
    """``Broken`` (mode ok) that raises ``ValueError`` in one set-up method: task_args.method (one of
    :data:`SETUP_METHODS`); task_args.ranks: the ranks that raise (default every rank); task_args.hidden:
    the model's width (a checkpoint of one width does not fit a model of another)."""

    def __init__(self, **task_args: Any) -> None:
        super().__init__(**task_args)
        self._maybe_raise("__init__")

    def _maybe_raise(self, method: str) -> None:
        ranks = self.args.get("ranks")
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if self.args.get("method") == method and (ranks is None or rank in ranks):
            raise ValueError(f"task_args.method={method}: raised on purpose")  # RaisesIn: this line

    def build_train_dataset(self) -> Any:
        self._maybe_raise("build_train_dataset")
        return super().build_train_dataset()

    def build_eval_dataset(self) -> Any:
        self._maybe_raise("build_eval_dataset")
        return super().build_eval_dataset()

    def build_model(self) -> nn.Module:
        self._maybe_raise("build_model")
        width = int(self.args.get("hidden", 8))
        return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        self._maybe_raise("build_optimizer")
        return super().build_optimizer(model)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        self._maybe_raise("build_scheduler")
        return super().build_scheduler(optimizer, total_steps)
