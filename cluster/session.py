"""What ``Worker.setup`` builds for one process group: the :class:`TrainSession` and its parts.

Each part is built the same way on every rank: the process group joined through rank 0's store, the model
(the task's, seeded alike; a survivor's own after a failure), the sampler, and rank 0's checkpoint writer.
Which state the session starts from (a peer's or a checkpoint's) is ``cluster.worker_recovery``'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cluster import dist as cdist
from cluster.checkpoint import CheckpointStore, CheckpointWriter
from cluster.config import JobConfig
from cluster.data import ResumableDistributedSampler
from cluster.errors import ConfigError
from cluster.group import SetupInfo
from cluster.schedule import Schedule
from cluster.task import Task
from cluster.train_state import Scheduler


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
