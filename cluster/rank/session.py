"""What ``Worker.setup`` builds for one process group: the :class:`TrainSession` and its parts.

Each part is built the same way on every rank: the process group joined through rank 0's store, the model
(the task's, seeded alike; a survivor's own after a failure), the sampler, and rank 0's checkpoint writer.
Which state the session starts from (a peer's or a checkpoint's) is ``cluster.rank.rejoin``'s;
:func:`check_writable` refuses, at setup, a state that no checkpoint could hold.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cluster.core.errors import CheckpointError, ConfigError
from cluster.data.pipeline import ResumableDistributedSampler
from cluster.rank import dist as cdist
from cluster.rank.ddp import is_zero
from cluster.rank.train_state import RunPosition, Scheduler, capture
from cluster.run.checkpoint import CheckpointStore, CheckpointWriter, CommitRecord
from cluster.run.state_bytes import check_loadable
from cluster.seam.protocol import SetupInfo
from cluster.spec.config import JobConfig
from cluster.spec.schedule import Schedule
from cluster.spec.task import Task

logger = logging.getLogger(__name__)


@dataclass
class TrainSession:
    """What ``setup`` builds for one process group; ``reset`` drops it whole, the next ``setup`` rebuilds
    it."""

    device: torch.device
    backend: str
    model: DDP
    raw_model: nn.Module
    """The unwrapped model: what a checkpoint's ``model.pt`` holds."""
    optimizer: torch.optim.Optimizer
    scheduler: Scheduler | None
    sampler: ResumableDistributedSampler
    store: CheckpointStore
    writer: CheckpointWriter | None
    """Rank 0's checkpoint writer; None on the other ranks."""
    info: SetupInfo
    schedule: Schedule
    """When to evaluate, checkpoint and log, at this session's epoch length."""


def join_group(
    store: dist.TCPStore | None,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    device: torch.device,
    cfg: JobConfig,
    t: dict[str, float],
) -> str:
    """Join the process group through rank 0's store (``store``: rank 0's own or a connection already
    made; else one made now to ``host:port``); returns the backend. Marks ``store`` and
    ``process_group`` in ``t``."""
    timeout = cfg.failures.process_group_timeout_s
    if store is None:
        store = cdist.connect_store(host, port, world_size, timeout)
    t["store"] = time.time()
    backend = cdist.init_process_group(store, rank, world_size, device, timeout, cfg.scaling.backend)
    t["process_group"] = time.time()
    return backend


def build_model(
    task: Task, cfg: JobConfig, has_eval_set: bool, device: torch.device, kept: nn.Module | None = None
) -> nn.Module:
    """The task's model, the same on every rank (seeded by ``training.seed``), on ``device``; a survivor's
    ``kept`` model instead when it has one."""
    if cfg.checkpoint.best_metric is not None and not has_eval_set:
        raise ConfigError(
            f"checkpoint.best_metric={cfg.checkpoint.best_metric!r} needs an eval set, but "
            f"{cfg.task}.build_eval_dataset() returned None; give the task one, or set "
            "checkpoint.best_metric=null"
        )
    if kept is not None:
        return kept
    torch.manual_seed(cfg.training.seed)  # the same init on every rank (DDP broadcasts rank 0's too)
    raw_model = task.build_model()
    if cfg.training.sync_batchnorm:
        raw_model = nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
    return raw_model.to(device)


def sampler_for(dataset: Any, rank: int, world_size: int, cfg: JobConfig) -> ResumableDistributedSampler:
    t = cfg.training
    return ResumableDistributedSampler(
        len(dataset),
        t.global_batch_size,
        rank,
        world_size,
        seed=t.seed,
        max_steps_per_epoch=t.max_steps_per_epoch,
        permutation=getattr(dataset, "permutation", None),  # e.g. ParquetDataset's windowed order
    )


def writer_for(
    rank: int, kept: CheckpointWriter | None, store: CheckpointStore, cfg: JobConfig
) -> CheckpointWriter | None:
    """Rank 0's checkpoint writer (``kept``: a survivor's, whose upload in flight carries on); None on the
    other ranks (a kept one is flushed and closed)."""
    c = cfg.checkpoint
    if rank == 0 and kept is None:
        return CheckpointWriter(
            store,
            c.keep_last,
            c.async_save,
            keep_best=c.best_metric is not None,
            keep_every=c.keep_every_steps,
            refuse_nonfinite=cfg.failures.stop_on_nan,
        )
    if rank != 0 and kept is not None:
        kept.close(flush=True)
        return None
    return kept


def check_writable(
    raw_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Scheduler | None,
    pos: RunPosition,
    world_size: int,
    seed: int,
    task: str,
) -> None:
    """ConfigError unless the state a checkpoint at ``pos`` would hold (``model.pt`` and ``train_state.pt``)
    loads back through the safe loader: a state that cannot be loaded is never written, and a run that
    could never resume is refused before its first step, not at each checkpoint. The message names the
    refused value's type, where it sits and the fix (``cluster.run.state_bytes.check_loadable``).

    Every rank holds the same state here (the task's, or the one it resumed), so every rank checks and
    raises alike without a collective. Tensors always load: only their containers and the other values
    are round-tripped, so the check costs no copy of the weights or the optimizer's moments. A sharded
    optimizer's whole state needs a collective: its local shard, which holds the same kinds of values,
    is checked instead."""
    zero = is_zero(optimizer)
    state = capture(pos, world_size, seed, optimizer, scheduler, with_optimizer=not zero)
    if zero:
        state.optimizer = optimizer.optim.state_dict()  # type: ignore[attr-defined]
    try:
        check_loadable(_skeleton(raw_model.state_dict()), "model.pt")
        check_loadable(_skeleton(state.state_dict()), "train_state.pt")
    except CheckpointError as exc:
        raise ConfigError(f"{task}'s training state cannot be checkpointed: {exc}") from None


def _skeleton(obj: Any) -> Any:
    """``obj`` with each plain tensor replaced by an empty one of its dtype: the same structure and the same
    kinds of values for the safe loader, without the bytes (a tensor subclass is kept whole: the loader may
    refuse it)."""
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, _skeleton(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_skeleton(v) for v in obj)
    if type(obj) in (torch.Tensor, nn.Parameter):
        return torch.empty(0, dtype=obj.dtype)
    return obj


LAST_COMMIT_RETRIES = 2
"""Times a failed last checkpoint is written again as the group ends (``Worker.finish``)."""
LAST_COMMIT_PAUSE_S = 2.0
"""The pause before each such retry, times its number."""


def write_again(writer: CheckpointWriter, step: int, write: Callable[[], object]) -> list[CommitRecord]:
    """Rank 0, as the group ends: when the newest checkpoint asked for (``step``, where the ranks stand)
    failed to commit, write it again from the live state (``write``), up to ``LAST_COMMIT_RETRIES`` times
    with a pause (storage already retried each file). Returns the new records."""
    out: list[CommitRecord] = []
    for attempt in range(1, LAST_COMMIT_RETRIES + 1):
        last = writer.last  # the epoch's result may have reported it already: not in ``records``
        if last is None or last.step != step or not last.error:
            break
        logger.warning(
            "checkpoint at step %d failed (%s): writing it again (%d/%d)",
            step,
            last.error,
            attempt,
            LAST_COMMIT_RETRIES,
        )
        time.sleep(LAST_COMMIT_PAUSE_S * attempt)
        write()
        writer.wait()
        out += writer.drain()
    return out
