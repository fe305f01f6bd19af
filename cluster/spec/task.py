"""The user's half of a job: model, datasets, optimizer/scheduler, and the loss of one batch.

A task is a class named by an import path string (``package.module:ClassName``) so that every node can
import it; it is constructed on each worker with the config's ``task_args``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cluster.core.errors import ConfigError


@dataclass(frozen=True)
class StepInfo:
    """Where training is when ``compute_loss`` runs (set by the worker as ``task.current``)."""

    epoch: int
    global_step: int
    """1-based index of the optimizer step being computed."""
    rank: int
    world_size: int
    attempt: int


class Task:
    """The user's half of a job. Subclass and override ``build_model``, ``build_train_dataset`` and
    ``compute_loss``; ``build_optimizer``, ``build_scheduler`` and ``move_to_device`` have defaults.

    The contract, as each worker process calls it:

    1. ``__init__(**task_args)``: once per process, with the config's ``task_args``.
    2. ``build_train_dataset()``: once per process, right after. A map-style dataset (``len`` and
       ``__getitem__``); one with ``get_batch(indices)`` (see
       :class:`cluster.data.pipeline.TensorBatchDataset`) is fetched a whole batch at a time.
    3. At every (re)start of the process group, in this order: ``build_model()`` (after
       ``torch.manual_seed(training.seed)``, so every rank builds the same weights; the worker moves it to
       its device and wraps it in DDP), ``build_optimizer(model)`` (given the unwrapped model), then
       ``build_scheduler(optimizer, total_steps)``. A checkpoint's state is loaded into all three afterwards.
    4. Every optimizer step: ``move_to_device(batch, device)`` then ``compute_loss(ddp_model, batch)`` once
       per
       micro-batch (``training.grad_accum_steps``). ``compute_loss`` returns the mean loss over the batch and
       a dict of extra scalar metrics (floats or one-element tensors; ``{}`` for none): they are recorded in
       the metrics Parquet as ``m_<name>``, per logged step and as the epoch's mean. The worker scales the
       loss so that DDP's gradient average equals the gradient of the mean over the global batch.

    5. Evaluation, when ``build_eval_dataset()`` (called once per process, like the training set) returns a
       dataset: at the points ``evaluation.*`` names, ``compute_eval(model, batch)`` on the unwrapped model
       in eval mode under ``torch.no_grad()``, once per eval batch; it defaults to ``compute_loss``. Its loss
       and extra metrics are averaged over every eval sample and recorded as ``kind="eval"`` rows
       (docs/runs.md). It must not change the model: training continues from the same state.

    A warm restart (a healthy worker kept after another rank failed) keeps the Task instance and its
    dataset. The model, optimizer and scheduler are built anew at every group start, except on a rank that
    survives a failure and sends its state to the others (recovery from peers); the state is then loaded
    into the new ones (from that rank, or from the checkpoint). State kept on the Task between steps must not
    be needed for exact resume. The hot spare runs steps 1-2
    ahead of time.
    """

    current: StepInfo | None = None
    """The step being trained: None until this process trains its first step; set before every step's
    ``compute_loss`` calls (its ``global_step`` is the step being computed); afterwards it keeps the last
    step's value, also across a warm restart until the next step."""

    def __init__(self, **task_args: Any) -> None:
        self.args = task_args

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def build_train_dataset(self) -> Any:
        raise NotImplementedError

    def build_eval_dataset(self) -> Any:
        """Optional: the held-out set evaluated at ``evaluation.*`` (same kinds as the training set, read
        in order, every sample once across the ranks); None (the default) for no evaluation."""
        return None

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        lr = float(self.args.get("lr", 1e-3))
        return torch.optim.AdamW(
            model.parameters(), lr=lr, weight_decay=float(self.args.get("weight_decay", 0.0))
        )

    def build_scheduler(
        self, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler | None:
        """Optional; stepped once per optimizer step. Its state is checkpointed."""
        return None

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def compute_eval(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """The mean loss and extra metrics of one eval batch (the unwrapped model, in eval mode, under
        ``torch.no_grad()``). Override for metrics only worth their cost at evaluation."""
        return self.compute_loss(model, batch)

    def move_to_device(self, batch: Any, device: torch.device) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(device, non_blocking=True)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.move_to_device(b, device) for b in batch)
        if isinstance(batch, dict):
            return {k: self.move_to_device(v, device) for k, v in batch.items()}
        return batch


def extra_metrics(extra: Any, where: str = "compute_loss") -> dict[str, Any]:
    """The extra metrics of one ``compute_loss`` (or ``compute_eval``) call: scalars as floats or detached
    0-d tensors."""
    if not isinstance(extra, dict):
        raise TypeError(
            f"Task.{where} must return (loss, dict of scalar metrics); the second item is a "
            f"{type(extra).__name__}. Return an empty dict for no extra metrics"
        )
    out: dict[str, Any] = {}
    for k, v in extra.items():
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise TypeError(
                    f"Task.{where} metric {k!r} is a tensor of shape {tuple(v.shape)}, not a scalar"
                )
            out[str(k)] = v.detach().reshape(()).double()
        elif isinstance(v, (int, float)):
            out[str(k)] = float(v)
        else:
            raise TypeError(f"Task.{where} metric {k!r} is a {type(v).__name__}, not a number")
    return out


def task_path(cls: Any) -> str:
    """``module:QualName`` of a Task subclass (what run.json records); ConfigError for anything else."""
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"task={cls!r} is not a subclass of cluster.Task")
    return f"{cls.__module__}:{cls.__qualname__}"


def load_task_class(path: str) -> type[Task]:
    """Import ``package.module:ClassName``; raise ConfigError saying what is missing."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"task={path!r}: cannot import module {module_name!r} ({exc}). Check the spelling, and that the "
            "module is on PYTHONPATH on every node (ray job submit --working-dir . ships the current folder)"
        ) from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConfigError(f"task={path!r}: module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"task={path!r} is not a subclass of cluster.Task")
    return cls


def build_task(path: str, task_args: dict[str, Any], cls: type[Task] | None = None) -> Task:
    """The task ``path`` names, or ``cls`` when given (a class passed to ``cluster.train(task=...)``,
    sent to the workers by value), built with ``task_args``."""
    cls = cls if cls is not None else load_task_class(path)
    try:
        return cls(**task_args)
    except TypeError as exc:
        raise ConfigError(f"task_args do not fit {path}: {exc}") from None
