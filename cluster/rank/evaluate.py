"""Evaluation on the task's held-out set, spread over the ranks, with results that do not depend on them.

The eval set is cut, in its own order, into batches of ``evaluation.batch_size`` samples (the last one
shorter); batch ``b`` is evaluated by rank ``b % world_size``, on the unwrapped model (no DDP collectives,
so ranks may hold different numbers of batches), in eval mode, under ``torch.no_grad()``, with torch's
generator seeded from (seed, step, batch). Each rank sends its per-batch means (a few floats per batch)
with one ``all_gather_object``; every rank then sums them in batch order. So every sample counts once, the
mean is over samples (not over ranks' means), and the result is bitwise the same at any world size and
on every rank.

A dataset that says ``read_ahead = True`` (``ParquetDataset`` does: its reads are storage and decoding,
which release the GIL) has each rank's next batch read in a background thread while the current one
runs; its ``get_batch`` must draw no random numbers and may run in that thread. Others are read in turn.

Before it, rank 0's buffers (BatchNorm's running statistics, which each rank updates from its own shard)
are broadcast into every rank's model, and each rank's own are put back after: every rank evaluates the
model a checkpoint holds, and training goes on exactly as without the evaluation.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cluster.core.errors import ConfigError
from cluster.data.pipeline import fetch_batch
from cluster.spec.config import JobConfig
from cluster.spec.task import Task, extra_metrics


@dataclass
class EvalResult:
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    batches: int = 0
    seconds: float = 0.0
    step: int | None = None
    """The global step of the model evaluated (it also seeds each eval batch's random draws)."""


def eval_batch_size(cfg: JobConfig) -> int:
    """Samples per eval batch: ``evaluation.batch_size``, else the training micro-batch at the configured
    world size (fixed, so that a resized group cuts the eval set the same way)."""
    if cfg.evaluation.batch_size is not None:
        return cfg.evaluation.batch_size
    t = cfg.training
    return max(1, t.global_batch_size // (cfg.scaling.num_workers * t.grad_accum_steps))


def eval_batch_count(dataset: Any, cfg: JobConfig) -> int:
    """Batches of one evaluation of ``dataset`` (all ranks together); 0 for no eval set."""
    if dataset is None:
        return 0
    batches = math.ceil(len(dataset) / eval_batch_size(cfg))
    limit = cfg.evaluation.max_batches
    return min(batches, limit) if limit is not None else batches


class BestEval:
    """The best evaluation so far by ``checkpoint.best_metric``, and the evaluations since it (early
    stopping). ``state`` is what the train state carries (``TrainState.best_eval``): ``value`` and ``step``
    of the best, ``since`` (evaluations after it) and ``last`` (the step of the latest one counted). Every
    rank holds the same values and the same state, so every rank decides alike."""

    def __init__(self, metric: str | None, mode: str, patience: int | None) -> None:
        self.metric, self.mode, self.patience = metric, mode, patience
        self.state: dict[str, Any] | None = None

    def update(self, step: int, values: dict[str, float]) -> bool:
        """Count the evaluation at ``step``; whether it is the best (a new one, or the best evaluated
        again at its own step after a failure took its checkpoint or its record). One that runs again at
        the same step is not counted twice."""
        if self.metric is None:
            return False
        if self.metric not in values:
            raise ConfigError(
                f"checkpoint.best_metric={self.metric!r} is not among the evaluation's metrics "
                f"({', '.join(sorted(values))}): name one of them, or null for no best checkpoint"
            )
        value, best = values[self.metric], self.state
        if best is not None and best.get("last") == step:
            return bool(best["step"] == step)
        if math.isnan(value):
            better = False
        elif best is None:
            better = True
        elif self.mode == "min":
            better = value < best["value"]
        else:
            better = value > best["value"]
        if better:
            self.state = {"value": value, "step": step, "since": 0, "last": step}
        elif best is not None:
            self.state = {**best, "since": int(best.get("since", 0)) + 1, "last": step}
        return better

    def stop_due(self, step: int) -> bool:
        """The evaluation at ``step`` is the ``patience``-th in a row without a new best."""
        best = self.state
        return (
            self.patience is not None
            and best is not None
            and best.get("last") == step
            and int(best.get("since", 0)) >= self.patience
        )


def _seed(seed: int, step: int, batch: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + batch * 15_485_863 + 0x5EED) % (2**63 - 1)


def evaluate(
    task: Task,
    model: nn.Module,
    dataset: Any,
    cfg: JobConfig,
    step: int,
    rank: int,
    world_size: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    progress: Callable[[], None] = lambda: None,
    reader: Callable[[list[tuple[int, int, int, int]]], Iterator[Any]] | None = None,
) -> EvalResult:
    """Evaluate ``model`` (unwrapped, the same on every rank) on ``dataset`` at global step ``step``; every
    rank of the group calls this together and gets the same result. ``progress`` is called after each
    batch (the hang watch's sign of life). ``reader`` (loader processes, ``cluster.data.pipeline.EvalLoader``)
    reads this rank's batches, given (seed, batch, start, stop) each, in order."""
    t0 = time.perf_counter()
    n = len(dataset)
    size = eval_batch_size(cfg)
    batches = eval_batch_count(dataset, cfg)
    own = _own_buffers(model, world_size)
    names: list[str] | None = None
    sizes: list[tuple[int, int]] = []
    values: list[torch.Tensor] = []
    was_training = model.training
    source = _eval_batches(dataset, range(rank, batches, world_size), size, cfg.training.seed, step, reader)
    model.eval()
    try:
        with torch.no_grad():
            for b, data in source:
                batch = task.move_to_device(data, device)
                with autocast():
                    loss, extra = task.compute_eval(model, batch)
                names, row = _eval_row(loss, extra, names, b, device)
                values.append(row)
                sizes.append((b, min((b + 1) * size, n) - b * size))
                progress()
    finally:
        source.close()
        model.train(was_training)
        _restore_buffers(model, own)
    host = torch.stack(values).cpu().tolist() if values else []  # one device read for the whole pass
    mine = {"names": names, "batches": [(b, k, v) for (b, k), v in zip(sizes, host, strict=True)]}
    if world_size > 1:
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    result = _combine(everyone, batches, time.perf_counter() - t0)
    result.step = step
    return result


def _eval_batches(
    dataset: Any,
    ours: range,
    size: int,
    seed: int,
    step: int,
    reader: Callable[[list[tuple[int, int, int, int]]], Iterator[Any]] | None,
) -> Generator[tuple[int, Any], None, None]:
    """This rank's eval batches ``(b, data)`` in order, each with the RNG seeded from (seed, step, b) as
    an in-turn read has it (a read that draws random numbers draws them from its batch's seed): read by
    loader processes (``reader``), one ahead in a thread (a dataset with ``read_ahead``), or in turn."""
    n = len(dataset)

    def read(b: int) -> Any:
        return fetch_batch(dataset, torch.arange(b * size, min((b + 1) * size, n)))

    if reader is not None and len(ours):
        stream = reader([(_seed(seed, step, b), b, b * size, min((b + 1) * size, n)) for b in ours])
        for b in ours:
            data = next(stream)
            torch.default_generator.manual_seed(_seed(seed, step, b))
            yield b, data
        return
    if getattr(dataset, "read_ahead", False) and len(ours) > 1:
        ahead = ThreadPoolExecutor(1, thread_name_prefix="cluster-eval-read")
        try:
            pending = ahead.submit(read, ours[0])
            for i, b in enumerate(ours):
                data = pending.result()
                if i + 1 < len(ours):
                    pending = ahead.submit(read, ours[i + 1])
                torch.default_generator.manual_seed(_seed(seed, step, b))
                yield b, data
        finally:
            ahead.shutdown(wait=True, cancel_futures=True)
        return
    for b in ours:
        torch.default_generator.manual_seed(_seed(seed, step, b))
        yield b, read(b)


def _eval_row(
    loss: Any, extra: Any, names: list[str] | None, b: int, device: torch.device
) -> tuple[list[str], torch.Tensor]:
    """One eval batch's loss and metrics as a float64 row on the device (the metric names fixed by the
    first batch: every batch must return the same)."""
    metrics = extra_metrics(extra, "compute_eval")
    if names is None:
        names = sorted(metrics)
    elif sorted(metrics) != names:
        raise ConfigError(
            f"Task.compute_eval returned metrics {sorted(metrics)} for eval batch {b} but {names} before: "
            "return the same names for every batch"
        )
    row = [_scalar(loss, b)] + [
        torch.as_tensor(metrics[k], dtype=torch.float64, device=device) for k in names
    ]
    return names, torch.stack([v.to(device) for v in row])


def _scalar(loss: Any, batch: int) -> torch.Tensor:
    """The eval loss of one batch as a 0-d float64 tensor (a float is fine too)."""
    value = torch.as_tensor(loss).detach()
    if value.numel() != 1:
        raise ConfigError(
            f"Task.compute_eval returned a loss of shape {tuple(value.shape)} for eval batch {batch}: return "
            "the batch's mean loss, a scalar"
        )
    return value.double().reshape(())


def _combine(everyone: list[dict[str, Any]], batches: int, seconds: float) -> EvalResult:
    """Every rank's per-batch means -> the mean over samples, summed in batch order (rank-independent)."""
    named = [r["names"] for r in everyone if r["names"] is not None]
    names = named[0] if named else []
    if any(other != names for other in named):
        raise ConfigError(f"Task.compute_eval returned different metric names on different ranks: {named}")
    rows = sorted(row for r in everyone for row in r["batches"])
    if len(rows) != batches:
        raise RuntimeError(f"evaluation covered {len(rows)} of {batches} batches")  # a bug, not user input
    samples = sum(k for _, k, _ in rows)
    sums = [0.0] * (1 + len(names))
    for _, k, vals in rows:
        for i, v in enumerate(vals):
            sums[i] += v * k
    means = [s / samples for s in sums] if samples else [math.nan] * len(sums)
    return EvalResult(
        loss=means[0],
        metrics=dict(zip(names, means[1:], strict=True)),
        samples=samples,
        batches=batches,
        seconds=seconds,
    )


def _own_buffers(model: nn.Module, world_size: int) -> list[torch.Tensor] | None:
    """This rank's buffers (copies), after loading rank 0's into the model; None when there is nothing to
    align (one rank, or no buffers)."""
    buffers = list(model.buffers())
    if world_size == 1 or not buffers:
        return None
    own = [b.detach().clone() for b in buffers]
    for b in buffers:
        dist.broadcast(b.data, src=0)
    return own


def _restore_buffers(model: nn.Module, own: list[torch.Tensor] | None) -> None:
    if own is None:
        return
    with torch.no_grad():
        for b, saved in zip(model.buffers(), own, strict=True):
            b.copy_(saved)
