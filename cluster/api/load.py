"""Load a run's result in one call: ``load_checkpoint`` (the verified state: ``cluster.run.restore``),
``load_model`` (the task's model with that state) and ``evaluate_checkpoint``. Any fsspec URL; no Ray.

    from cluster import load_checkpoint, load_model
    ckpt = load_checkpoint("./runs/tiny-cpu")            # latest verified checkpoint
    ckpt = load_checkpoint("s3://bucket/runs/tiny-cpu", step=400)
    model = load_model("./runs/tiny-cpu")                # the run's Task builds it; weights loaded
    model = load_model("./runs/tiny-cpu", step="best")   # the best evaluation's (checkpoint.best_metric)
    res = evaluate_checkpoint("./runs/tiny-cpu", step="best")  # its eval set again: loss, metrics
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from torch import nn

from cluster.core.errors import CheckpointError, ConfigError
from cluster.rank.evaluate import EvalResult
from cluster.run.restore import checkpoint_in, open_run

logger = logging.getLogger(__name__)


def load_model(
    run_url: str,
    step: int | Literal["best"] | None = None,
    storage_options: dict[str, Any] | None = None,
    task_args: dict[str, Any] | None = None,
) -> nn.Module:
    """Build the run's model with its own Task (``task`` and ``task_args`` from ``run.json``; ``task_args``
    here override single arguments) and load the checkpoint's weights. Returned on CPU, in training mode as
    ``build_model`` made it; call ``.eval()`` for inference."""
    from cluster.spec.task import build_task

    folder, named = open_run(run_url, storage_options)
    ckpt = checkpoint_in(folder, named if step is None else step)
    storage = folder.storage
    try:
        config = json.loads(storage.read_bytes("run.json"))["config"]
    except FileNotFoundError:
        raise CheckpointError(
            f"{storage.root}/run.json is missing: the run's task is unknown; build the model yourself and "
            "load load_checkpoint(...).model into it"
        ) from None
    task = build_task(config["task"], {**config.get("task_args", {}), **(task_args or {})})
    model = task.build_model()
    model.load_state_dict(ckpt.model)
    return model


def evaluate_checkpoint(
    run_url: str,
    step: int | Literal["best"] | None = None,
    storage_options: dict[str, Any] | None = None,
    task_args: dict[str, Any] | None = None,
    device: str = "cpu",
    batch_size: int | None = None,
    max_batches: int | None = None,
) -> EvalResult:
    """Evaluate a checkpoint (the latest, ``step``, or ``"best"``) on its run's eval set, in this process
    (no Ray): the run's Task from ``run.json`` (``task_args`` here override single arguments, e.g. to
    select another split), its ``evaluation.*`` settings unless given here, on ``device``. Returns what
    the run's own evaluation at that step returned (bitwise on the same kind of machine and thread count:
    the same batches, seeds and summation order; docs/runs.md)."""
    import dataclasses

    import torch

    from cluster.rank.evaluate import evaluate
    from cluster.spec.load import from_dict
    from cluster.spec.task import build_task

    folder, named = open_run(run_url, storage_options)
    ckpt = checkpoint_in(folder, named if step is None else step)
    storage = folder.storage
    try:
        config = json.loads(storage.read_bytes("run.json"))["config"]
    except FileNotFoundError:
        raise CheckpointError(f"{storage.root}/run.json is missing: the run's task is unknown") from None
    cfg = from_dict(config)
    merged = {**cfg.task_args, **(task_args or {})}
    evaluation = dataclasses.replace(
        cfg.evaluation,
        batch_size=batch_size if batch_size is not None else cfg.evaluation.batch_size,
        max_batches=max_batches if max_batches is not None else cfg.evaluation.max_batches,
    )
    cfg = dataclasses.replace(cfg, task_args=merged, evaluation=evaluation)
    task = build_task(cfg.task, merged)
    dataset = task.build_eval_dataset()
    if dataset is None or len(dataset) == 0:
        raise ConfigError(
            f"{cfg.task}.build_eval_dataset() returned no data with task_args {merged}: pass task_args "
            "that give the task an eval set"
        )
    target = torch.device(device)
    model = task.build_model()
    model.load_state_dict(ckpt.model)
    model.to(target)

    def autocast() -> Any:
        import contextlib

        if cfg.training.amp == "bf16":
            return torch.autocast(device_type=target.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    return evaluate(task, model, dataset, cfg, ckpt.step, 0, 1, target, autocast=autocast)
