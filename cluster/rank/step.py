"""One optimizer step on one rank, and what it records: the micro-batches with gradient accumulation, the
step's metric row, and the watch for a diverged run (a loss that is not finite).

Nothing here waits for the device: losses, metrics and the gradient norm stay device tensors until rank 0
reads them at a log step, and the first non-finite step is kept on the device until a log step or the
epoch's end finds the loss not finite.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from cluster.core.errors import DivergedError
from cluster.data.pipeline import InputPipeline
from cluster.rank.pace import StepPace
from cluster.rank.train_state import RunPosition
from cluster.spec.config import FailureConfig, JobConfig
from cluster.spec.task import Task, extra_metrics

if TYPE_CHECKING:
    from cluster.rank.session import TrainSession


def step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**63 - 1)


def seed_step(device: torch.device, seed: int) -> None:
    # The generators this rank uses, directly: torch.manual_seed also walks every backend.
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def autocast(cfg: JobConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if cfg.training.amp == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(
    s: TrainSession,
    task: Task,
    inputs: InputPipeline,
    pace: StepPace,
    cfg: JobConfig,
    pos: RunPosition,
    world_size: int,
    local_idx: torch.Tensor,
    loss_hook: Callable[[torch.Tensor], torch.Tensor],
    want_norm: bool,
) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor | None]:
    """One optimizer step over this rank's share of the global batch (``local_idx``) at ``pos``. Returns
    the detached mean loss, the mean of each extra metric ``compute_loss`` returned, and the global
    gradient norm (every step when clipping needs it, else only when ``want_norm``), as device tensors.
    ``loss_hook``: each micro-batch's loss passes through it (``cluster.rank.faults``)."""
    tcfg = cfg.training
    chunks = [c for c in torch.tensor_split(local_idx, tcfg.grad_accum_steps) if len(c)]
    total = torch.zeros((), dtype=torch.float64, device=s.device)
    metrics: dict[str, Any] = {}
    for i, chunk in enumerate(chunks):
        t_fetch = time.perf_counter()
        host = inputs.fetch(chunk, (pos.epoch, pos.step_in_epoch, i))
        pace.fetched(time.perf_counter() - t_fetch)
        batch = task.move_to_device(host, s.device)  # non-blocking from pinned memory on CUDA
        sync = i == len(chunks) - 1
        with s.model.no_sync() if not sync else contextlib.nullcontext():
            with autocast(cfg, s.device):  # the forward only: backward runs in the forward ops' dtypes anyway
                loss, extra = task.compute_loss(s.model, batch)
            loss = loss_hook(loss)
            # DDP averages over ranks: scaling by n*W/B makes that average the global-batch mean.
            scale = len(chunk) * world_size / tcfg.global_batch_size
            (loss * scale if scale != 1.0 else loss).backward()
        total += loss.detach().double() * len(chunk)
        for k, v in extra_metrics(extra).items():
            metrics[k] = metrics.get(k, 0.0) + v * (len(chunk) / len(local_idx))
    # The global gradient norm (after DDP's all-reduce: the same on every rank), before clipping: every
    # step when clipping needs it anyway, else at rank 0's log steps only. A device tensor: no sync here.
    norm = None
    if tcfg.grad_clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(s.model.parameters(), tcfg.grad_clip)
    elif want_norm:
        grads = [p.grad for p in s.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else None
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    if s.scheduler is not None:
        s.scheduler.step()
    return total / len(local_idx), metrics, norm


def peak_memory_gib(device: torch.device) -> float:
    """Rank 0's peak memory for its step rows, in GiB: on a GPU the caching allocator's peak since the
    previous row (then reset: no device sync either way), on CPU the process's peak resident set."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB


class Divergence:
    """Stops a diverged run (``failures.stop_on_nan``), naming the first step whose loss was not finite
    (``DivergedError.first_step``; the driver rolls back from it with ``failures.nan_skip_steps``)."""

    def __init__(self, failures: FailureConfig) -> None:
        self.failures = failures
        self.first_bad: torch.Tensor | None = None  # on the device: the first step with a non-finite loss

    def reset(self) -> None:
        """A new group's path: a non-finite loss of an earlier one is not this one's."""
        self.first_bad = None

    def track(self, loss: torch.Tensor, step: int) -> None:
        """Keep, on the device (no sync), the first step whose loss was not finite: read only when a log
        step or the epoch's end finds one (:meth:`check`), to name where the divergence began."""
        if not self.failures.stop_on_nan:
            return
        if self.first_bad is None:
            self.first_bad = torch.full((), -1, dtype=torch.int64, device=loss.device)
        new = torch.logical_and(self.first_bad < 0, torch.logical_not(torch.isfinite(loss)))
        self.first_bad = torch.where(new, step, self.first_bad)

    def agree(self, mean_loss: float) -> None:
        """At the epoch's end, with the mean loss of every rank (the same on every rank, so every rank takes
        part): the first non-finite step of any rank."""
        if math.isfinite(mean_loss) or self.first_bad is None:
            return
        first = torch.where(self.first_bad < 0, torch.iinfo(torch.int64).max, self.first_bad)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        self.first_bad = first

    def check(self, loss: float, step: int, what: str = "the loss") -> None:
        """A NaN or infinite ``loss`` at ``step`` fails the run at once (unless stop_on_nan is off)."""
        if math.isfinite(loss) or not self.failures.stop_on_nan:
            return
        first = int(self.first_bad) if self.first_bad is not None else -1
        first = first if 0 < first <= step else step
        since = f" (the first loss not finite was step {first}'s)" if first != step else ""
        if self.failures.nan_skip_steps:
            fix = f"rolling back to skip the {self.failures.nan_skip_steps} steps ending at step {first}"
        else:
            fix = (
                "Checkpoints of weights that are not finite are never committed, so a resubmission resumes "
                "from the newest good one; an exact resume would diverge here again, so first lower the "
                "learning rate, set training.grad_clip, skip the batches (training.skip_steps, or "
                "failures.nan_skip_steps to roll back by itself) or look at the data of the steps before it "
                "(failures.stop_on_nan=false trains on regardless)"
            )
        raise DivergedError(f"{what} is {loss} at step {step}{since}. {fix}", first_step=first)
