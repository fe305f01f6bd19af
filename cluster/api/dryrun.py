"""A job's task tried in this process before any GPU is asked for (``python -m jobs.train --dry-run``,
``cluster.dry_run``): build the model, the datasets, the optimizer and the scheduler as a worker would, train
rank 0's share of the first steps, check that a checkpoint of them would load back, evaluate one eval batch,
and report what a run of this config will be (steps, batch per rank, checkpoint size, memory) or the one error
a worker would have hit, in seconds. No Ray, no process group, nothing written to storage."""

from __future__ import annotations

import contextlib
import logging
import pickle
import resource
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from cluster.core.errors import ConfigError
from cluster.data.pipeline import ResumableDistributedSampler, fetch_batch
from cluster.rank.evaluate import eval_batch_count, evaluate
from cluster.rank.session import check_writable
from cluster.rank.train_state import RunPosition
from cluster.run.checkpoint import serialize
from cluster.spec.config import JobConfig
from cluster.spec.schedule import skip_windows
from cluster.spec.task import Task, build_task, extra_metrics

logger = logging.getLogger(__name__)

STEPS = 2
"""Steps tried: the first builds lazily initialised state (optimizer moments, caches), the second is timed."""


@dataclass
class DryRunReport:
    task: str
    device: str
    parameters: int
    trainable: int
    train_samples: int
    steps_per_epoch: int
    total_steps: int
    """Optimizer steps of the whole run (``training.epochs`` x steps per epoch), skipped ones included."""
    per_rank_batch: int
    micro_batch: int
    """Samples per forward and backward on one rank (``per_rank_batch`` / ``training.grad_accum_steps``)."""
    loss: float
    """Rank 0's loss on its share of the first step."""
    metrics: dict[str, float]
    step_s: float
    """The second step's seconds, on ``device``, for one rank's share (no all-reduce)."""
    grad_norm: float
    checkpoint_bytes: int
    """Bytes of one checkpoint after the first steps: ``model.pt`` and the optimizer's state."""
    peak_memory_gib: float
    """The steps' peak: the CUDA allocator's on a GPU, the process's resident set on CPU."""
    no_grad: list[str] = field(default_factory=list)
    """Trainable parameters that got no gradient in the first step (unused in ``compute_loss``)."""
    eval_samples: int | None = None
    eval_batches: int | None = None
    eval_loss: float | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class DryRunError(ConfigError):
    """The task failed where a worker would have: the message names the call and the error."""


def dry_run(cfg: JobConfig, device: str | None = None, task_cls: type[Task] | None = None) -> DryRunReport:
    """Try ``cfg``'s task (or the class ``task_cls``, as ``cluster.train(task=...)`` takes it) here (module
    docstring). ``device``: ``cpu`` or ``cuda``; default the job's own kind when this machine has it, else the
    CPU (noted). Raises :class:`DryRunError` (a ConfigError) naming the task's call that failed."""
    notes: list[str] = []
    target = _device(cfg, device, notes)
    t, s = cfg.training, cfg.scaling
    task = _call(cfg, "__init__", lambda: build_task(cfg.task, cfg.task_args, task_cls))
    torch.manual_seed(t.seed)
    model = _call(cfg, "build_model()", task.build_model)
    if not isinstance(model, nn.Module):
        raise DryRunError(f"{cfg.task}.build_model() returned {type(model).__name__}, not a torch.nn.Module")
    model.to(target)
    dataset = _call(cfg, "build_train_dataset()", task.build_train_dataset)
    sampler = ResumableDistributedSampler(
        len(dataset),
        t.global_batch_size,
        0,
        s.num_workers,
        seed=t.seed,
        max_steps_per_epoch=t.max_steps_per_epoch,
        permutation=getattr(dataset, "permutation", None),
    )
    if t.loader_workers:
        _picklable(dataset, "training.loader_workers", t.loader_workers)
    optimizer = _call(cfg, "build_optimizer(model)", lambda: task.build_optimizer(model))
    total = sampler.steps_per_epoch * t.epochs
    scheduler = _call(
        cfg, "build_scheduler(optimizer, total_steps)", lambda: task.build_scheduler(optimizer, total)
    )
    sampler.set_epoch(0)
    batches = iter(sampler)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if target.type == "cuda":
        torch.cuda.reset_peak_memory_stats(target)
    first: tuple[float, dict[str, float], float] | None = None
    no_grad: list[str] = []
    step_s = 0.0
    for step, local_idx in zip(range(STEPS), batches, strict=False):  # an epoch may have a single step
        t0 = time.perf_counter()
        loss, metrics, norm = _step(cfg, task, model, dataset, local_idx, target, optimizer, step)
        if step == 0:
            no_grad = [n for n, p in trainable if p.grad is None]
            first = (loss, metrics, norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        if target.type == "cuda":
            torch.cuda.synchronize(target)
        step_s = time.perf_counter() - t0
    assert first is not None
    _checkpointable(cfg, model, optimizer, scheduler, min(STEPS, sampler.steps_per_epoch))
    if no_grad and not t.fixed_buckets:
        notes.append(
            f"{len(no_grad)} trainable parameters got no gradient ({', '.join(no_grad[:5])}"
            f"{' ...' if len(no_grad) > 5 else ''}): DDP fails on them with training.fixed_buckets=false "
            '("Expected to have finished reduction"); leave it true, or freeze them (requires_grad=False)'
        )
    report = DryRunReport(
        task=cfg.task,
        device=str(target),
        parameters=sum(p.numel() for p in model.parameters()),
        trainable=sum(p.numel() for _, p in trainable),
        train_samples=len(dataset),
        steps_per_epoch=sampler.steps_per_epoch,
        total_steps=total,
        per_rank_batch=t.global_batch_size // s.num_workers,
        micro_batch=t.global_batch_size // s.num_workers // t.grad_accum_steps,
        loss=first[0],
        metrics=first[1],
        step_s=step_s,
        grad_norm=first[2],
        checkpoint_bytes=len(serialize(model.state_dict())) + len(serialize(optimizer.state_dict())),
        peak_memory_gib=_peak_gib(target),
        no_grad=no_grad,
        notes=notes,
    )
    skipped = sum(b - a + 1 for a, b in skip_windows(t.skip_steps) if a <= total)
    if skipped:
        notes.append(f"training.skip_steps skips {skipped} of the {total} steps")
    _evaluate(cfg, task, model, target, report)
    return report


def _checkpointable(
    cfg: JobConfig, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, steps: int
) -> None:
    """The state a checkpoint after the first steps would hold loads back through the safe loader, as a
    worker checks at its setup (``cluster.rank.session.check_writable``); DryRunError naming the value
    else."""
    pos = RunPosition.start(cfg)
    pos.global_step = pos.step_in_epoch = steps
    try:
        check_writable(model, optimizer, scheduler, pos, cfg.scaling.num_workers, cfg.training.seed, cfg.task)
    except ConfigError as exc:
        raise DryRunError(str(exc)) from None


def _device(cfg: JobConfig, device: str | None, notes: list[str]) -> torch.device:
    if device is not None:
        if device == "cuda" and not torch.cuda.is_available():
            raise DryRunError("--device cuda, but this machine sees no CUDA device; use --device cpu")
        return torch.device(device)
    if cfg.scaling.use_gpu and torch.cuda.is_available():
        return torch.device("cuda", 0)
    if cfg.scaling.use_gpu:
        notes.append("the job trains on GPUs; this machine has none, so the dry run used the CPU")
    return torch.device("cpu")


def _call(cfg: JobConfig, what: str, fn: Any) -> Any:
    """The task's ``what``, with any error it raises turned into one naming the call."""
    try:
        return fn()
    except ConfigError:
        raise
    except Exception as exc:
        raise DryRunError(_failed(cfg, what, exc)) from exc


def _failed(cfg: JobConfig, what: str, exc: BaseException) -> str:
    """``<task>.<what> raised <type>: <message>``, and where in the task's own code (the innermost frame
    outside torch and this package)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    own = [
        f
        for f in frames
        if "/torch/" not in f.filename and "/cluster/" not in f.filename and "site-packages" not in f.filename
    ]
    where = f" (at {own[-1].filename}:{own[-1].lineno}, in {own[-1].name})" if own else ""
    return f"{cfg.task}.{what} raised {type(exc).__name__}: {exc}{where}"


def _step(
    cfg: JobConfig,
    task: Task,
    model: nn.Module,
    dataset: Any,
    local_idx: torch.Tensor,
    device: torch.device,
    optimizer: torch.optim.Optimizer,
    step: int,
) -> tuple[float, dict[str, float], float]:
    """Rank 0's share of one step, as ``Worker._train_step`` computes it (without DDP's all-reduce)."""
    t = cfg.training
    chunks = [c for c in torch.tensor_split(local_idx, t.grad_accum_steps) if len(c)]
    total, metrics = 0.0, dict[str, float]()
    for chunk in chunks:
        host = _call(cfg, "dataset batch", lambda c=chunk: fetch_batch(dataset, c))
        batch = _call(cfg, "move_to_device(batch, device)", lambda h=host: task.move_to_device(h, device))
        autocast = (
            torch.autocast(device_type=device.type, dtype=torch.bfloat16)
            if t.amp == "bf16"
            else contextlib.nullcontext()
        )
        with autocast:
            out = _call(cfg, "compute_loss(model, batch)", lambda b=batch: task.compute_loss(model, b))
        if not (isinstance(out, tuple) and len(out) == 2):
            raise DryRunError(
                f"{cfg.task}.compute_loss returned {type(out).__name__}; return (loss, metrics): the mean "
                "loss tensor and a dict of extra scalar metrics ({} for none)"
            )
        loss, extra = out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise DryRunError(
                f"{cfg.task}.compute_loss returned a loss of {shape}; return its mean, a scalar tensor"
            )
        if not loss.requires_grad:
            raise DryRunError(
                f"{cfg.task}.compute_loss returned a loss that does not require grad: it was computed "
                "without the model's parameters (under torch.no_grad(), or from .detach()ed values)"
            )
        values = _call(cfg, "compute_loss's metrics", lambda e=extra: extra_metrics(e))
        _call(cfg, "compute_loss's loss.backward()", (loss * (len(chunk) / len(local_idx))).backward)
        total += float(loss.detach()) * len(chunk)
        for k, v in values.items():
            metrics[k] = metrics.get(k, 0.0) + float(v) * (len(chunk) / len(local_idx))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
    if t.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    loss_value = total / len(local_idx)
    if not torch.isfinite(torch.tensor(loss_value)) and cfg.failures.stop_on_nan:
        raise DryRunError(
            f"the loss of step {step + 1} is {loss_value}: the run would stop diverged there. Check the data "
            "and the model's output (a log of zero, a division by zero), or lower the learning rate"
        )
    return loss_value, metrics, norm


def _evaluate(
    cfg: JobConfig, task: Task, model: nn.Module, device: torch.device, report: DryRunReport
) -> None:
    data = _call(cfg, "build_eval_dataset()", task.build_eval_dataset)
    metric = cfg.checkpoint.best_metric
    if data is None:
        if metric is not None:
            raise DryRunError(
                f"checkpoint.best_metric={metric!r} needs an eval set, but {cfg.task}.build_eval_dataset() "
                "returned None; give the task one, or set checkpoint.best_metric=null"
            )
        return
    if cfg.evaluation.loader_workers:
        _picklable(data, "evaluation.loader_workers", cfg.evaluation.loader_workers)
    one = replace(cfg, evaluation=replace(cfg.evaluation, max_batches=1))
    try:
        result = evaluate(task, model, data, one, 0, 0, 1, device)
    except ConfigError:
        raise
    except Exception as exc:
        raise DryRunError(_failed(cfg, "compute_eval(model, batch)", exc)) from exc
    report.eval_samples, report.eval_batches = len(data), eval_batch_count(data, cfg)
    report.eval_loss, report.eval_metrics = result.loss, dict(result.metrics)
    known = {"loss", *result.metrics}
    if metric is not None and metric not in known:
        raise DryRunError(
            f"checkpoint.best_metric={metric!r} is not an evaluation metric; compute_eval gives "
            f"{sorted(known)}"
        )


def _picklable(dataset: Any, key: str, n: int) -> None:
    try:
        pickle.dumps(dataset)
    except Exception as exc:
        raise DryRunError(
            f"{key}={n} sends the dataset to loader processes, but {type(dataset).__name__} cannot be "
            f"pickled ({exc}). Make it picklable (no open files, lambdas or locally defined classes), or "
            f"set {key}=0"
        ) from None


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def format_report(r: DryRunReport, cfg: JobConfig) -> str:
    from cluster.inspect import human_bytes

    w = cfg.scaling.num_workers
    lines = [
        f"dry run of {r.task} on {r.device}: the task builds, trains and evaluates",
        f"  model        {r.parameters:,} parameters ({r.trainable:,} trainable)",
        f"  data         {r.train_samples:,} samples: {r.steps_per_epoch} steps per epoch x "
        f"{cfg.training.epochs} epochs = {r.total_steps} steps",
        f"  batch        {cfg.training.global_batch_size} a step = {w} ranks x {r.per_rank_batch}"
        + (
            f" ({cfg.training.grad_accum_steps} micro-batches of {r.micro_batch})"
            if r.micro_batch != r.per_rank_batch
            else ""
        ),
        f"  first step   loss {r.loss:.4g}, gradient norm {r.grad_norm:.4g} (rank 0's share)"
        + "".join(f", {k} {v:.4g}" for k, v in r.metrics.items()),
        f"  step time    {r.step_s:.3f}s for one rank's share here (no all-reduce)",
        f"  memory       peak {r.peak_memory_gib:.2f} GiB "
        + ("(CUDA allocator)" if r.device.startswith("cuda") else "(this process's resident set)"),
        f"  checkpoint   {human_bytes(r.checkpoint_bytes)} (weights and optimizer state)",
    ]
    if r.eval_samples is not None:
        lines.append(
            f"  evaluation   {r.eval_samples:,} samples in {r.eval_batches} batches; first batch loss "
            f"{_fmt(r.eval_loss)}" + "".join(f", {k} {v:.4g}" for k, v in r.eval_metrics.items())
        )
    else:
        lines.append("  evaluation   none (build_eval_dataset() returned None)")
    if r.no_grad:
        lines.append(
            f"  no gradient  {len(r.no_grad)} trainable parameters: {', '.join(r.no_grad[:5])}"
            + (" ..." if len(r.no_grad) > 5 else "")
        )
    lines += [f"  note         {n}" for n in r.notes]
    return "\n".join(lines)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"
