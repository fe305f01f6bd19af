"""The hand-written DDP worker: one process, one GPU (or CPU share). Plain Python, no Ray.

Lifecycle, driven from outside (by the Ray actor in ``worker_group.py`` or by plain processes in tests):
``bind_store`` (rank 0 only) -> ``setup`` (process group, task, DDP wrap, resume: returns the
:class:`TrainSession`) -> ``run_epoch`` per epoch (the driver owns the epoch, so ``set_epoch`` cannot be
forgotten) -> ``finish`` -> ``shutdown``. ``reset`` ends the session but keeps the task and its dataset for a
warm restart. ``heartbeat`` is safe to call from another thread at any time: it is the hang heartbeat.

Determinism: every step reseeds the RNGs from (seed, global step, rank), and the sampler is a pure
function of (seed, epoch, step). A checkpoint at step ``s`` (weights plus :class:`TrainState`) therefore
carries everything needed to continue exactly, and a resumed run is bitwise equal to an uninterrupted one at
the same world size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cluster import dist as cdist
from cluster import stacks as stack_dump
from cluster.checkpoint import CheckpointStore, CheckpointWriter, CommitRecord, step_dir
from cluster.config import FaultSpec, JobConfig, Window, merge_windows, parse_fault_env, skip_windows
from cluster.data import (
    LEGACY_ORDER,
    ORDERS,
    TORCH_ORDER,
    EvalLoader,
    InputPipeline,
    ResumableDistributedSampler,
)
from cluster.errors import CheckpointError, ConfigError, DivergedError, StorageError, WorkerError
from cluster.evaluate import BestEval, EvalResult, eval_batch_count, eval_due, evaluate
from cluster.group import EpochResult, Heartbeat, ResumePoint, SetupInfo
from cluster.pace import StepPace
from cluster.peer import PeerPlan, PeerState, Transfer, broadcast_state, state_digest
from cluster.process import set_niceness, tune_process
from cluster.profiling import ProfileRequest, StepProfiler
from cluster.storage import PROBE_ENV, Storage, check_probe
from cluster.task import StepInfo, Task, build_task, extra_metrics

Scheduler = torch.optim.lr_scheduler.LRScheduler

logger = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Everything besides the weights that exact resume needs: ``train_state.pt`` of a checkpoint.

    :meth:`state_dict` writes every field and :meth:`from_state_dict` reads every field back, so what is
    saved and what is loaded cannot drift apart. The sampler needs no state of its own: it is a pure
    function of (seed, sampler_order, epoch, step_in_epoch), and each step reseeds the RNGs from (seed, step,
    rank).
    """

    global_step: int
    """Optimizer steps done."""
    epoch: int
    """The epoch to continue in (the next one when the checkpoint was taken at an epoch's end)."""
    step_in_epoch: int
    """Steps of ``epoch`` already done."""
    world_size: int
    """Ranks of the group that wrote it; a different world size resumes at the same global sample."""
    seed: int
    """training.seed of the run; resuming with another seed would change the data order mid-run."""
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    sampler_order: int
    """How the run's sampler seeds each epoch's permutation (``cluster.data.LEGACY_ORDER`` or
    ``TORCH_ORDER``): fixed for the life of a run, so a resumed run keeps its data order."""
    best_eval: dict[str, Any] | None = None
    """The best evaluation so far by ``checkpoint.best_metric``: ``value`` and ``step``, ``since`` (the
    evaluations after it, for ``evaluation.patience``) and ``last`` (the step of the latest one counted), so
    that a resumed run checkpoints only evaluations better than every earlier one, and stops as early."""
    skipped_steps: list[list[int]] = field(default_factory=list)
    """The run's skip windows (``training.skip_steps`` and NaN rollbacks), ``[first, last]`` each: a resumed
    run skips the same batches, also when the driver that rolled back is gone."""

    # Keys that checkpoints written by earlier versions carry and that resume does not need.
    LEGACY_KEYS = frozenset({"sample_offset", "rng"})
    # Fields that checkpoints written by earlier versions lack, with the value that reproduces what they did.
    OLD_DEFAULTS: ClassVar[dict[str, Any]] = {
        "sampler_order": LEGACY_ORDER,
        "best_eval": None,
        "skipped_steps": [],
    }

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], where: str = "train_state.pt") -> TrainState:
        names = {f.name for f in fields(cls)}
        state = {**cls.OLD_DEFAULTS, **state}
        missing = names - set(state)
        unknown = set(state) - names - cls.LEGACY_KEYS
        if missing or unknown:
            raise CheckpointError(
                f"{where} does not hold a train state of this version: missing {sorted(missing)}, unknown "
                f"{sorted(unknown)}. Resume with the version of cluster that wrote it, "
                "or start a new run name"
            )
        return cls(
            global_step=int(state["global_step"]),
            epoch=int(state["epoch"]),
            step_in_epoch=int(state["step_in_epoch"]),
            world_size=int(state["world_size"]),
            seed=int(state["seed"]),
            optimizer=state["optimizer"],
            scheduler=state["scheduler"],
            sampler_order=_sampler_order(state["sampler_order"], where),
            best_eval=state["best_eval"],
            skipped_steps=[[int(a), int(b)] for a, b in state["skipped_steps"]],
        )


def _sampler_order(value: Any, where: str) -> int:
    if value not in ORDERS:
        raise CheckpointError(
            f"{where} has sampler_order={value!r}, which this version does not know (it knows {ORDERS}). "
            "Resume with the version of cluster that wrote it, or start a new run name"
        )
    return int(value)


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


SLOW_FAULT_S = 0.05
"""The injected ``slow`` fault's sleep at the start of each step."""
HOLD_STEPS = 2
"""A rank asked to stop (``Worker.hold_stop``) trains at most this many more steps before it learns where."""


class _StopRequest:
    """A planned stop of every rank at the same step boundary, agreed while the epoch runs, in two calls
    from the driver (served by another thread of the process):

    1. ``Worker.hold_stop``: the rank reports its step ``g`` and will not start a step past
       ``g + HOLD_STEPS`` before it knows the stop step (it waits there if it gets that far first).
    2. ``Worker.stop_at``: the stop step ``S``, the same for every rank; the driver takes the largest
       ``g + HOLD_STEPS``, so no rank is past it (ranks of one DDP group are at most a step apart).

    ``dispatch`` names the ``run_epoch`` call it is for: a request for another call is ignored, one that
    arrives before its call started waits for it. Nothing is read per step but two attributes."""

    def __init__(self, dispatch: int | None = None, limit: int = 0) -> None:
        self.dispatch = dispatch
        self.limit = limit
        self.at: int | None = None
        self.checkpoint = False
        self.known = threading.Event()


def _peak_memory_gib(device: torch.device) -> float:
    """Rank 0's peak memory for its step rows, in GiB: on a GPU the caching allocator's peak since the
    previous row (then reset: no device sync either way), on CPU the process's peak resident set."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB


def steps_to_skip(
    windows: list[Window], before: int, start_step: int, steps_per_epoch: int
) -> frozenset[int]:
    """The steps of an epoch (0-based within it, from ``start_step`` on) that ``windows`` (global steps,
    1-based) name, ``before`` global steps having been done before the epoch's first."""
    out: set[int] = set()
    for first, last in windows:
        out.update(range(max(start_step, first - before - 1), min(steps_per_epoch, last - before)))
    return frozenset(out)


def _step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**63 - 1)


class Worker:
    def __init__(
        self,
        cfg: JobConfig,
        rank: int,
        world_size: int,
        run_url: str,
        attempt: int = 0,
        task_cls: type[Task] | None = None,
    ) -> None:
        self.cfg = cfg
        self.task_cls = task_cls  # ``cluster.train(task=...)``'s class; else cfg.task is imported
        self.rank = rank
        self.world_size = world_size
        self.run_url = run_url
        self.attempt = attempt
        self.global_step = 0
        self.epoch = 0
        self.step_in_epoch = 0
        self.sampler_order = TORCH_ORDER  # a new run's; resuming takes the checkpoint's (TrainState)
        self.session: TrainSession | None = None
        self._last_step_at = time.time()
        self._max_step_time = 0.0
        self._in_epoch = False
        self._store: dist.TCPStore | None = None
        self._connect_marks: dict[str, float] = {}
        self._rows: deque[dict[str, Any]] = deque()  # rank 0's step rows not yet handed to the driver
        self._kept: TrainSession | None = None  # a survivor's session after its group failed (peer recovery)
        self._task: Task | None = None
        self._dataset: Any = None
        self._eval_dataset: Any = None
        self._task_lock = threading.Lock()  # a hot spare's setup can begin while ``prepare`` builds the task
        self._inputs: InputPipeline | None = None
        self._stop = _StopRequest()
        self._last_checkpoint = -1  # the newest checkpoint's step this process wrote or resumed from
        c = cfg.checkpoint
        self._best = BestEval(c.best_metric, c.best_mode, cfg.evaluation.patience)  # TrainState.best_eval
        self._last_eval: tuple[int, dict[str, float]] | None = None  # (step, loss and metrics)
        self._eval_batches = 0
        self._train_ident: int | None = None
        self._grad_norm: torch.Tensor | None = None  # the last step's, when it was taken (``_train_step``)
        self._profiler: StepProfiler | None = None  # made by the first ``profile`` request
        self._eval_loader: EvalLoader | None = None  # the eval set's loader processes, once started
        self._best_at: int | None = None  # the step of an evaluation that became the best: checkpoint it
        self.skips: list[Window] = skip_windows(cfg.training.skip_steps)  # and the driver's, per setup
        self._first_bad: torch.Tensor | None = None  # on the device: the first step with a non-finite loss
        self.gpu_index = 0  # this rank's GPU among the visible ones (``use_gpus``)
        self.faults = self._faults()
        self._pace = StepPace()
        self.allocator = tune_process(cfg)  # before the process group and task make their threads

    def _faults(self) -> list[FaultSpec]:
        faults = list(self.cfg.failures.inject)
        env = os.environ.get("CLUSTER_INJECT_FAULT")
        if env:
            faults.append(parse_fault_env(env, self.cfg.scaling.num_workers))
        return [f for f in faults if f.rank == self.rank and f.attempt in (-1, self.attempt)]

    @property
    def task(self) -> Task:
        """The task, built on first use and kept for the life of the process (warm restarts included)."""
        with self._task_lock:
            if self._task is None:
                task = build_task(self.cfg.task, self.cfg.task_args, self.task_cls)
                self._dataset = task.build_train_dataset()
                self._eval_dataset = _checked_eval_set(task.build_eval_dataset(), self.cfg.task)
                self._task = task
            return self._task

    @property
    def dataset(self) -> Any:
        _ = self.task  # built together with the task
        return self._dataset

    @property
    def inputs(self) -> InputPipeline:
        """Where each micro-batch comes from (``cluster.data``): kept, like the dataset, for the life of the
        process, loader processes included."""
        if self._inputs is None:
            t = self.cfg.training
            self._inputs = InputPipeline(
                self.dataset, t.loader_workers, t.prefetch, t.grad_accum_steps, t.seed
            )
        return self._inputs

    # ----------------------------------------------------------------- setup
    def use_gpus(self, visible: str, index: int) -> str:
        """See the GPUs ``visible`` (``CUDA_VISIBLE_DEVICES``, every GPU of the group on this node) and
        train on the ``index``-th (``cluster.dist.share_gpus``). Only before CUDA starts in this process: a
        survivor of a failure keeps the devices it started with (its own GPU's index in them is unchanged).
        Returns the list in effect."""
        if torch.cuda.is_initialized():
            return os.environ.get("CUDA_VISIBLE_DEVICES", "")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        self.gpu_index = index
        return visible

    def bind_store(self, ipv4: bool = True) -> int:
        """Rank 0 only: bind the rendezvous store (``ipv4``: the node's address is IPv4, see
        ``cluster.dist.bind_store``); return its port (the caller publishes host:port)."""
        self._store, port = cdist.bind_store(self.world_size, self.cfg.failures.process_group_timeout_s, ipv4)
        return port

    def connect(self, host: str, port: int) -> None:
        """Ranks other than 0: connect to rank 0's rendezvous store now (the driver calls this in waves,
        see ``RayWorkerGroup.start``); ``setup`` then uses the connection."""
        if self.rank != 0:
            t0 = time.time()
            self._store = cdist.connect_store(
                host, port, self.world_size, self.cfg.failures.process_group_timeout_s
            )
            self._connect_marks = {"connect": t0, "connected": time.time()}

    def setup(
        self,
        host: str,
        port: int,
        peers: PeerPlan | None = None,
        skips: list[Window] | None = None,
        rollback: Window | None = None,
    ) -> TrainSession:
        """Join the process group, build (or keep) model and optimizer, and take the state to resume from:
        from rank ``peers.source`` over the new group when a peer plan is given (a survivor keeps its own
        model and optimizer), else from the newest verified checkpoint: with ``rollback`` (after a NaN loss),
        the newest before that window. ``skips``: the driver's skip windows (the run's checkpoint adds its
        own)."""
        t = {**self._connect_marks, "start": time.time()}  # ``connect``'s, when it ran
        self._connect_marks = {}
        cfg = self.cfg
        self.skips = merge_windows([*skip_windows(cfg.training.skip_steps), *(skips or [])])
        self._first_bad = None  # a non-finite loss of an earlier group's path is not this one's
        kept, self._kept = self._kept, None
        if peers is None and kept is not None:
            self._discard(kept)  # the driver chose the checkpoint: the survivor's state is not used
            kept = None
        if os.environ.get(PROBE_ENV):  # set by the driver: prove this node sees the driver's storage
            check_probe(Storage(self.run_url, cfg.storage.options), os.environ[PROBE_ENV])
        device = cdist.pick_device(cfg.scaling.use_gpu, self.gpu_index)
        store = self._store  # rank 0's own, or the connection ``connect`` made
        if store is None:
            store = cdist.connect_store(host, port, self.world_size, cfg.failures.process_group_timeout_s)
        t["store"] = time.time()
        backend = cdist.init_process_group(
            store,
            self.rank,
            self.world_size,
            device,
            cfg.failures.process_group_timeout_s,
            cfg.scaling.backend,
        )
        t["process_group"] = time.time()

        task, dataset = self.task, self.dataset  # a warm restart keeps both
        if cfg.checkpoint.best_metric is not None and self._eval_dataset is None:
            raise ConfigError(
                f"checkpoint.best_metric={cfg.checkpoint.best_metric!r} needs an eval set, but "
                f"{cfg.task}.build_eval_dataset() returned None; give the task one, or set "
                "checkpoint.best_metric=null"
            )
        if kept is not None:
            raw_model, optimizer, scheduler = kept.raw_model, kept.optimizer, kept.scheduler
        else:
            torch.manual_seed(cfg.training.seed)  # the same init on every rank (DDP broadcasts rank 0's too)
            raw_model = task.build_model()
            if cfg.training.sync_batchnorm:
                raw_model = nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
            raw_model = raw_model.to(device)
        self.inputs.open(device)  # loader processes start (once per process) while setup goes on
        t["task"] = time.time()

        sampler = ResumableDistributedSampler(
            len(dataset),
            cfg.training.global_batch_size,
            self.rank,
            self.world_size,
            seed=cfg.training.seed,
            max_steps_per_epoch=cfg.training.max_steps_per_epoch,
            permutation=getattr(dataset, "permutation", None),  # e.g. ParquetDataset's windowed order
        )
        ckpt_store = CheckpointStore(Storage(self.run_url, cfg.storage.options))
        crash_steps = {f.step for f in self.faults if f.kind == "crash_in_checkpoint"}
        if crash_steps:
            ckpt_store = _CrashingStore(ckpt_store.storage, crash_steps)
        skipped: list[tuple[int, str]] = []
        if peers is not None:
            if kept is None:
                optimizer = self._build_optimizer(raw_model)
                scheduler = task.build_scheduler(optimizer, sampler.steps_per_epoch * cfg.training.epochs)
            resume = self._receive(peers, device, raw_model, optimizer, scheduler)
            t["peer_transfer"] = time.time()
            # every rank now holds the verified same parameters and buffers: DDP's own broadcast of rank
            # 0's (a model's worth of collectives across the whole group) would only repeat that
            model = self._ddp(raw_model, device, sync=False)
            t["ddp"] = time.time()
        else:
            model = self._ddp(raw_model, device)
            optimizer = self._build_optimizer(raw_model)
            scheduler = task.build_scheduler(optimizer, sampler.steps_per_epoch * cfg.training.epochs)
            t["ddp"] = time.time()
            resume, skipped = self._resume(ckpt_store, raw_model, optimizer, scheduler, rollback)
            t["checkpoint_load"] = time.time()
        sampler.order = self.sampler_order  # the resumed run's (a new run's when nothing was resumed)
        writer = kept.writer if kept is not None else None  # rank 0's upload in flight carries on
        if self.rank == 0 and writer is None:
            writer = CheckpointWriter(
                ckpt_store,
                cfg.checkpoint.keep_last,
                cfg.checkpoint.async_save,
                keep_best=cfg.checkpoint.best_metric is not None,
                keep_every=cfg.checkpoint.keep_every_steps,
                refuse_nonfinite=cfg.failures.stop_on_nan,
            )
        elif self.rank != 0 and writer is not None:
            writer.close(flush=True)
            writer = None
        # DDP's buffer broadcast at each forward is a wait for the others inside the step: left out of the
        # rank's own part. (Not under training.compile: hooks would be traced into the compiled forward.)
        syncing = any(True for _ in raw_model.buffers()) and not cfg.training.compile
        self._pace.attach(raw_model, device, syncing=model if syncing else None)
        dist.barrier()
        t["ready"] = time.time()
        self._last_step_at = time.time()
        info = SetupInfo(
            rank=self.rank,
            world_size=self.world_size,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            backend=backend,
            steps_per_epoch=sampler.steps_per_epoch,
            resume=resume,
            skipped_checkpoints=skipped,
            timings=t,
            allocator=self.allocator,
            niceness=set_niceness(cfg.scaling.worker_niceness),  # again: the group made its threads
            storage_reads=ckpt_store.storage.reads,
            storage_read_bytes=ckpt_store.storage.bytes_read,
            eval_batches=eval_batch_count(self._eval_dataset, cfg),
        )
        self.session = TrainSession(
            device, backend, model, raw_model, optimizer, scheduler, sampler, ckpt_store, writer, info
        )
        return self.session

    def _build_optimizer(self, raw_model: nn.Module) -> torch.optim.Optimizer:
        """The task's optimizer; with training.zero a ``ZeroRedundancyOptimizer`` of the same class, param
        groups and settings, each rank holding the state of its share of the parameters only."""
        optimizer = self.task.build_optimizer(raw_model)
        if not self.cfg.training.zero:
            return optimizer
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        # ``defaults`` may hold settings the class sets itself (AdamW: decoupled_weight_decay)
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [dict(g) for g in optimizer.param_groups]
        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **defaults)

    def _ddp(self, raw_model: nn.Module, device: torch.device, sync: bool = True) -> DDP:
        """Wrap for training. ``gradient_as_bucket_view``: after backward the gradients are views into DDP's
        buckets, not a second copy (same values). Buffers (BatchNorm's running statistics) are broadcast
        from rank 0 before each forward only where there are any (``forward_sync_buffers``, torch 2.13's
        name for ``broadcast_buffers``; at init they are synced). ``sync=False`` skips DDP's check and
        broadcast at init (``init_sync``), for ranks that already hold the same state. With
        training.compile the wrapper's forward is compiled in place, so the model stays a DDP and
        ``raw_model`` the plain module a checkpoint holds."""
        model = DDP(
            raw_model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=self.cfg.training.fixed_buckets,  # see TrainingConfig.fixed_buckets
            gradient_as_bucket_view=True,
            **_buffer_sync(any(True for _ in raw_model.buffers())),
            **_init_sync(sync),
        )
        if self.cfg.training.compile:
            model.compile()
        return model

    # ----------------------------------------------------------------- recovery from peers
    def _payload(self, raw_model: nn.Module, state: TrainState) -> dict[str, Any]:
        """What a peer sends: exactly what a checkpoint holds (``model.pt`` and ``train_state.pt``)."""
        return {"model": raw_model.state_dict(), "train_state": state.state_dict()}

    def _receive(
        self,
        plan: PeerPlan,
        device: torch.device,
        raw_model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Scheduler | None,
    ) -> ResumePoint:
        """Every rank of the new group: rank ``plan.source`` broadcasts its state, the ranks that do not hold
        it load it, and every rank checks it now holds the state the plan names."""
        holder = self.rank in plan.holders
        # Only the ranks that lack the state take part: the source and those not holding it (a group of
        # those; every rank of the default group must create it).
        takers = sorted({plan.source, *(r for r in range(self.world_size) if r not in plan.holders)})
        group = dist.new_group(takers) if len(takers) < self.world_size else None
        moved = Transfer(0, 0.0, 0.0, 0)
        ts = None
        if self.rank in takers:
            mine = None
            if self.rank == plan.source:
                mine = self._payload(raw_model, self._train_state_of(optimizer, scheduler))
            payload, moved = broadcast_state(mine, plan.source, device, group)
            ts = TrainState.from_state_dict(payload["train_state"], f"the state sent by rank {plan.source}")
            if not holder:
                raw_model.load_state_dict(payload["model"])
                optimizer.load_state_dict(ts.optimizer)
                if scheduler is not None and ts.scheduler is not None:
                    scheduler.load_state_dict(ts.scheduler)
                self.global_step, self.epoch, self.step_in_epoch = ts.global_step, ts.epoch, ts.step_in_epoch
                self.sampler_order = ts.sampler_order
                self._best.state = ts.best_eval
            del payload
        if group is not None and self.rank in takers:
            dist.destroy_process_group(group)
        self._last_checkpoint = -1  # the same on every rank (a survivor's own may differ from a newcomer's)
        if holder and (self.global_step, self.epoch, self.step_in_epoch) != (
            plan.global_step,
            plan.epoch,
            plan.step_in_epoch,
        ):
            raise RuntimeError(
                f"rank {self.rank} holds step {self.global_step}, the plan says {plan.global_step}"
            )
        digest, _ = state_digest(self._payload(raw_model, self._train_state_of(optimizer, scheduler)))
        if digest != plan.digest:
            raise RuntimeError(
                f"rank {self.rank} holds state {digest[:12]} after the transfer from rank {plan.source}, "
                f"which reported {plan.digest[:12]}: the peer copy is not exact"
            )
        return ResumePoint(
            plan.global_step,
            plan.epoch,
            plan.step_in_epoch,
            None,
            ts.world_size if ts is not None else self.world_size,
            source="peers",
            peer_source=plan.source,
            nbytes=0 if self.rank == plan.source else moved.nbytes,
            transfer_s=moved.seconds,
        )

    def _train_state_of(self, optimizer: torch.optim.Optimizer, scheduler: Scheduler | None) -> TrainState:
        return TrainState(
            global_step=self.global_step,
            epoch=self.epoch,
            step_in_epoch=self.step_in_epoch,
            world_size=self.world_size,
            seed=self.cfg.training.seed,
            optimizer=optimizer.state_dict(),
            scheduler=scheduler.state_dict() if scheduler is not None else None,
            sampler_order=self.sampler_order,
            best_eval=self._best.state,
            skipped_steps=[list(w) for w in self.skips],
        )

    def release(self, rank: int, world_size: int, attempt: int) -> PeerState | None:
        """A survivor after its group failed: leave the process group, keep model, optimizer, scheduler and
        position in memory, take rank ``rank`` of the next group, and report what it holds. None when it
        holds no session (it never finished setup)."""
        s = self.session
        cdist.bind_thread(s.device if s is not None else None)
        self._leave_group()
        if s is None:
            self.reset(rank, world_size, attempt)
            return None
        unsendable = _unsendable(s.optimizer)
        # at an epoch's end the position points at the next epoch; a sharded optimizer's state is not
        # asked for (it would take a collective on the failed group), and is not sent
        state = self.train_state(s, with_optimizer=not unsendable)
        self.epoch, self.step_in_epoch = state.epoch, state.step_in_epoch
        s.optimizer.zero_grad(set_to_none=True)  # gradients of a step that did not complete
        self.session = None
        s.model = None  # type: ignore[assignment]  # the failed group's DDP reducer; a new one wraps next
        self._kept = s
        self._stop = _StopRequest()
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self._store = None
        self._max_step_time = 0.0
        self._last_step_at = time.time()
        self.faults = self._faults()
        digest, nbytes = state_digest(self._payload(s.raw_model, state))
        return PeerState(
            rank=rank,
            global_step=state.global_step,
            epoch=state.epoch,
            step_in_epoch=state.step_in_epoch,
            digest=digest,
            nbytes=nbytes,
            unsendable=unsendable,
        )

    def abort(self) -> bool:
        """From another thread, while the training thread may be blocked in a collective whose peer is
        gone: abort the process group so that the collective returns with an error. NCCL supports this;
        for gloo it is not needed (a dead peer's closed sockets fail the collective at once, and a rank
        that fails destroys its group, which fails its neighbours in turn). Returns whether it aborted."""
        if self.session is None or self.session.backend != "nccl" or not dist.is_initialized():
            return False
        group = dist.group.WORLD
        if group is None:
            return False
        group.abort()
        return True

    def _leave_group(self) -> None:
        """Leave the process group at once after a failure, on the training thread, so that peers blocked on
        this rank fail now, not at the process-group timeout: NCCL aborts its communicators; under gloo this
        rank's peer connections are shut down (``cluster.dist.sever_peers`` says why)."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        s = self.session
        if s is not None and s.backend == "nccl":
            group = dist.group.WORLD
            if group is not None:
                try:
                    group.abort()
                except RuntimeError as exc:
                    logger.warning("aborting the process group failed: %s", exc)
        else:
            cdist.sever_peers()
        if s is not None:
            s.model = None  # type: ignore[assignment]  # the failed group's DDP; a new one wraps next time
        cdist.destroy_process_group()

    def _discard(self, kept: TrainSession) -> None:
        if kept.writer is not None:
            kept.writer.close(flush=True)  # commit the checkpoint in flight: the fallback may use it

    def _resume(
        self,
        store: CheckpointStore,
        raw_model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Scheduler | None,
        rollback: Window | None = None,
    ) -> tuple[ResumePoint, list[tuple[int, str]]]:
        """Rank 0 picks the newest verified checkpoint (with ``rollback``: :meth:`_rollback_point`); every
        rank loads that one step."""
        t0 = time.perf_counter()
        choice: list[Any] = [None, [], 0, None]
        files: dict[str, Any] | None = None
        if self.rank == 0:
            if rollback is None:
                loaded = store.load_latest()  # records what it passed over in store.last_skipped
                back = None
            else:
                loaded, back = self._rollback_point(store, rollback)
            choice = [
                loaded.info.step if loaded else None,
                list(store.last_skipped),
                loaded.info.total_bytes if loaded else 0,
                back,
            ]
            files = loaded.files if loaded else None
        dist.broadcast_object_list(choice, src=0)
        step, skipped, nbytes, back = choice
        if step is None:
            self.sampler_order = TORCH_ORDER
            self._best.state = None
            init = self._init_from(raw_model) if self.cfg.training.init_from else None
            fresh = ResumePoint(0, 0, 0, None, init_from=init, transfer_s=time.perf_counter() - t0)
            return dataclasses.replace(fresh, skipped_steps=list(self.skips), rollback=back), skipped
        if files is None:
            files = store.load_step(step)
        url = store.storage.url(step_dir(step))
        state = TrainState.from_state_dict(files["train_state.pt"], f"{url}/train_state.pt")
        if state.seed != self.cfg.training.seed:
            raise CheckpointError(
                f"{url} was written with training.seed={state.seed}, this job has {self.cfg.training.seed}: "
                "resuming would change the data order mid-run. Keep the seed, or choose a new run name"
            )
        raw_model.load_state_dict(files["model.pt"])
        optimizer.load_state_dict(state.optimizer)
        if scheduler is not None and state.scheduler is not None:
            scheduler.load_state_dict(state.scheduler)
        self.global_step, self.epoch, self.step_in_epoch = state.global_step, state.epoch, state.step_in_epoch
        self.sampler_order = state.sampler_order
        self._best.state = state.best_eval
        self.skips = merge_windows([*self.skips, *((a, b) for a, b in state.skipped_steps)])
        self._last_checkpoint = state.global_step  # it exists: an evaluation here never writes it again
        return ResumePoint(
            state.global_step,
            state.epoch,
            state.step_in_epoch,
            url,
            state.world_size,
            source="checkpoint",
            nbytes=int(nbytes),
            transfer_s=time.perf_counter() - t0,
            skipped_steps=list(self.skips),
            rollback=back,
        ), skipped

    def _rollback_point(self, store: CheckpointStore, window: Window) -> tuple[Any, dict[str, Any]]:
        """Rank 0, restarting after a NaN loss whose steps ``window`` will be skipped: the newest verified
        checkpoint before the window, so that none of its batches is in the weights; when the newer ones
        kept (``checkpoint.keep_last``) leave none there, the newest before the window's last step (only the
        steps after it are skipped, then); none: the run's start. Every newer checkpoint is deleted: it
        trained batches now skipped, and a later recovery must never resume from it."""
        first, last = window
        loaded = store.load_latest(max_step=first - 1)
        passed = list(store.last_skipped)
        if loaded is None and any(i.step < last for i in store.list()):
            loaded = store.load_latest(max_step=last - 1)
            passed += store.last_skipped
        store.last_skipped = passed
        resume_step = loaded.info.step if loaded is not None else 0
        discarded = store.discard_after(resume_step)
        return loaded, {
            "window": list(window),
            "checkpoint_step": resume_step if loaded else None,
            "discarded": discarded,
        }

    def _init_from(self, raw_model: nn.Module) -> dict[str, Any]:
        """A new run's weights from another run's checkpoint (``training.init_from``): rank 0 picks the
        checkpoint, every rank loads that one (checksums verified) into its model. Every rank raises the
        same error when it cannot be used."""
        from cluster.load import init_weights, load_checkpoint

        t, options = self.cfg.training, self.cfg.storage.options
        choice: list[Any] = [None, None]
        if self.rank == 0:
            try:
                choice = [load_checkpoint(t.init_from, t.init_from_step, options).url, None]  # type: ignore[arg-type]
            except (CheckpointError, ConfigError, StorageError) as exc:
                choice = [None, f"training.init_from={t.init_from!r}: {exc}"]
        dist.broadcast_object_list(choice, src=0)
        url, error = choice
        if error is not None:
            raise ConfigError(error)
        ckpt = load_checkpoint(url, None, options)
        report = init_weights(raw_model, ckpt.model, t.init_strict, url)
        return {"url": url, "step": ckpt.step, **report}

    def _session(self) -> TrainSession:
        if self.session is None:
            raise RuntimeError("Worker.setup() must run before training (or again after reset())")
        return self.session

    # ----------------------------------------------------------------- training
    def run_epoch(
        self, epoch: int, start_step: int, dispatch: int = 0, evaluate_first: bool = False
    ) -> EpochResult:
        """Train epoch ``epoch`` from step ``start_step`` to its end (or to the step a stop request names);
        evaluate and checkpoint as configured. ``dispatch`` numbers the driver's calls (see
        :class:`_StopRequest`). ``evaluate_first``: the evaluation due at the resume point was lost with a
        failure (the driver never got it): run it before the first step."""
        if self._stop.dispatch != dispatch:
            self._stop = _StopRequest()  # a request for an earlier call
        self._train_ident = threading.get_ident()  # whose stack ``stacks`` marks as the training thread
        try:
            session = self._session()
            cdist.bind_thread(session.device)  # Ray may run this call on another thread than setup's
            return self._run_epoch(session, epoch, start_step, dispatch, evaluate_first)
        except WorkerError as exc:
            err = exc.with_traceback(None)
        except Exception as exc:
            err = WorkerError(
                self.rank,
                self.global_step + 1,
                type(exc).__name__,
                str(exc),
                traceback.format_exc(),
                getattr(exc, "detail", None) if isinstance(exc, DivergedError) else None,
            )
        finally:
            self._in_epoch = False
        self._leave_group()  # peers blocked on this rank fail now, not at the process-group timeout
        raise err

    def hold_stop(self, dispatch: int) -> int:
        """Phase 1 of a planned stop (:class:`_StopRequest`): this rank's step; it trains at most
        ``HOLD_STEPS`` more before it needs :meth:`stop_at`."""
        step = self.global_step
        self._stop = _StopRequest(dispatch, step + HOLD_STEPS)
        return step

    def stop_at(self, dispatch: int, step: int, checkpoint: bool) -> None:
        """Phase 2: stop before step ``step + 1`` (or at the epoch's end if that comes first); rank 0
        commits a checkpoint there when ``checkpoint``."""
        st = self._stop
        if st.dispatch != dispatch:
            return
        st.at, st.checkpoint = step, checkpoint
        st.known.set()

    def _stopping(self, dispatch: int) -> bool:
        """At a step boundary: whether a planned stop ends the epoch here (waits for the stop step when
        this rank reached its hold limit first)."""
        st = self._stop
        if st.dispatch != dispatch:
            return False
        if st.at is None and self.global_step >= st.limit:
            timeout = self.cfg.failures.process_group_timeout_s
            if not st.known.wait(timeout):
                raise RuntimeError(f"asked to stop, but not told at which step within {timeout:g}s")
        return st.at is not None and self.global_step >= st.at

    def _run_epoch(
        self, s: TrainSession, epoch: int, start_step: int, dispatch: int = 0, evaluate_first: bool = False
    ) -> EpochResult:
        tcfg = self.cfg.training
        set_niceness(self.cfg.scaling.worker_niceness)  # threads Ray started since (a few syscalls)
        before = self.global_step - start_step  # global steps done before the epoch's first
        skip = steps_to_skip(self.skips, before, start_step, s.sampler.steps_per_epoch)
        s.sampler.set_epoch(epoch, start_step, skip)
        self.inputs.start_epoch(s.sampler, s.device)
        self.epoch, self.step_in_epoch = epoch, start_step
        s.model.train()
        self._in_epoch = True
        self._last_step_at = time.time()
        # Sums stay on the device: read at log steps and at the epoch's end, never per step (no host sync).
        loss_sum = torch.zeros((), dtype=torch.float64, device=s.device)
        metric_sums: dict[str, Any] = {}
        t_epoch = time.perf_counter()
        first_step_at = None
        steps = samples = skipped = 0
        stopped = False
        early = False  # early stopping (evaluation.patience): the run ends at this step
        if evaluate_first and self._eval_dataset is not None:
            self._evaluate(s)
            early = self._early_stop_due()
            if self._best_due() or (early and self._last_checkpoint != self.global_step):
                self._checkpoint(s)
        for local_idx in s.sampler if not early else ():
            if self._stop.dispatch == dispatch and self._stopping(dispatch):
                stopped = True
                break
            loss: torch.Tensor | None = None
            if self.step_in_epoch in s.sampler.skip:
                self._skip_step(s)
                skipped += 1
            else:
                self._maybe_inject_fault()
                t0 = time.perf_counter()
                self._pace.begin()
                if self._fault_from("slow"):
                    time.sleep(SLOW_FAULT_S)
                self._seed_step(s, _step_seed(tcfg.seed, self.global_step, self.rank))
                self.task.current = StepInfo(
                    epoch, self.global_step + 1, self.rank, self.world_size, self.attempt
                )
                if self._profiler is not None:
                    self._profiler.before_step(s.device)
                loss, metrics = self._train_step(s, local_idx)
                self.global_step += 1
                if self._profiler is not None:
                    self._profiler.after_step(self.global_step)
                self.step_in_epoch += 1
                steps += 1
                samples += tcfg.global_batch_size
                loss_sum += loss
                self._track_finite(loss)
                for k, v in metrics.items():
                    metric_sums[k] = metric_sums.get(k, 0.0) + v
                dt = time.perf_counter() - t0
                self._pace.end(dt)
                now = time.time()
                if first_step_at is None:
                    first_step_at = now
                self._max_step_time = max(self._max_step_time, dt)
                self._last_step_at = now
            stall = 0.0
            mid_epoch = self.step_in_epoch < s.sampler.steps_per_epoch  # the epoch's end evaluates below
            if self._eval_dataset is not None and mid_epoch and self._eval_due(s):
                self._evaluate(s)
                early = self._early_stop_due()
            if self._checkpoint_due_at_step(s) or (mid_epoch and (self._best_due() or early)):
                stall = self._checkpoint(s)
            if (
                loss is not None
                and self.rank == 0
                and (self.global_step % tcfg.log_every_steps == 0 or stall)
            ):
                row = self._step_row(s, loss, metrics, dt, stall, now)
                self._rows.append(row)
                self._check_finite(row["loss"])
            if early:
                break
        st = self._stop
        if st.dispatch == dispatch and not st.known.wait(self.cfg.failures.process_group_timeout_s):
            raise RuntimeError("asked to stop, but not told at which step")  # the epoch ended first
        at_end = not stopped and self.step_in_epoch == s.sampler.steps_per_epoch
        if at_end and not early and self._eval_dataset is not None and self._eval_due(s):
            self._evaluate(s)  # before the checkpoint of the same step
            early = self._early_stop_due()
        if st.dispatch == dispatch and st.checkpoint and self._last_checkpoint != self.global_step:
            self._checkpoint(s)  # the stop asked for one (a move without peers, a notice too short)
        elif (
            at_end
            and (self._checkpoint_due_at_epoch_end(epoch) or self._best_due() or early)
            and self._last_checkpoint != self.global_step
        ):
            self._checkpoint(s)
        # One collective per epoch for the reported loss; nothing per step.
        totals = torch.tensor([float(loss_sum), float(steps)], dtype=torch.float64)
        if s.device.type == "cuda":
            totals = totals.to(s.device)
        dist.all_reduce(totals)
        mean_loss = float(totals[0]) / max(float(totals[1]), 1.0)
        if not math.isfinite(mean_loss) and self._first_bad is not None:
            # the same on every rank, so every rank takes part: the first non-finite step of any rank
            first = torch.where(self._first_bad < 0, torch.iinfo(torch.int64).max, self._first_bad)
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
            self._first_bad = first
        self._check_finite(mean_loss, "the epoch's mean loss")  # the same on every rank: all stop
        return EpochResult(
            rank=self.rank,
            epoch=epoch,
            global_step=self.global_step,
            steps=steps,
            samples=samples,
            skipped=skipped,
            loss=mean_loss,
            seconds=time.perf_counter() - t_epoch,
            first_step_at=first_step_at,
            step_rows=self._drain_rows(),
            commits=s.writer.drain() if s.writer else [],
            metrics={k: float(v) / max(steps, 1) for k, v in metric_sums.items()},
            stopped=stopped,
            early_stopped=early,
            best=dict(self._best.state) if early and self._best.state is not None else None,
        )

    def _skip_step(self, s: TrainSession) -> None:
        """A skipped step: no batch, no forward, no update; the step count and the learning-rate schedule
        move on as if it had trained, on every rank alike (no collective)."""
        self.global_step += 1
        self.step_in_epoch += 1
        if s.scheduler is not None:
            with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": meant here
                warnings.simplefilter("ignore", UserWarning)
                s.scheduler.step()
        self._last_step_at = time.time()

    def _track_finite(self, loss: torch.Tensor) -> None:
        """Keep, on the device (no sync), the first step whose loss was not finite: read only when a log
        step or the epoch's end finds one (``_check_finite``), to name where the divergence began."""
        if not self.cfg.failures.stop_on_nan:
            return
        if self._first_bad is None:
            self._first_bad = torch.full((), -1, dtype=torch.int64, device=loss.device)
        new = torch.logical_and(self._first_bad < 0, torch.logical_not(torch.isfinite(loss)))
        self._first_bad = torch.where(new, self.global_step, self._first_bad)

    def _check_finite(self, loss: float, what: str = "the loss") -> None:
        """Stop a diverged run (``failures.stop_on_nan``): a NaN or infinite loss fails it at once, naming
        the first step whose loss was not finite (``DivergedError.first_step``; the driver rolls back from
        it with ``failures.nan_skip_steps``)."""
        if math.isfinite(loss) or not self.cfg.failures.stop_on_nan:
            return
        first = int(self._first_bad) if self._first_bad is not None else -1
        first = first if 0 < first <= self.global_step else self.global_step
        since = f" (the first loss not finite was step {first}'s)" if first != self.global_step else ""
        if self.cfg.failures.nan_skip_steps:
            fix = f"rolling back to skip the {self.cfg.failures.nan_skip_steps} steps ending at step {first}"
        else:
            fix = (
                "Checkpoints of weights that are not finite are never committed, so a resubmission resumes "
                "from the newest good one; an exact resume would diverge here again, so first lower the "
                "learning rate, set training.grad_clip, skip the batches (training.skip_steps, or "
                "failures.nan_skip_steps to roll back by itself) or look at the data of the steps before it "
                "(failures.stop_on_nan=false trains on regardless)"
            )
        raise DivergedError(f"{what} is {loss} at step {self.global_step}{since}. {fix}", first_step=first)

    def _seed_step(self, s: TrainSession, seed: int) -> None:
        # The generators this rank uses, directly: torch.manual_seed also walks every backend.
        torch.default_generator.manual_seed(seed)
        if s.device.type == "cuda":
            torch.cuda.manual_seed(seed)

    def _train_step(self, s: TrainSession, local_idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """One optimizer step over this rank's share of the global batch. Returns the detached mean loss and
        the mean of each extra metric ``compute_loss`` returned, as device tensors: nothing here waits for the
        device (the caller reads them at log steps only)."""
        tcfg = self.cfg.training
        chunks = [c for c in torch.tensor_split(local_idx, tcfg.grad_accum_steps) if len(c)]
        total = torch.zeros((), dtype=torch.float64, device=s.device)
        if self._fault_now("crash_in_backward"):
            # the first parameter's gradient comes last in backward: the other ranks are in the all-reduce
            first = next(s.raw_model.parameters())
            first.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        metrics: dict[str, Any] = {}
        for i, chunk in enumerate(chunks):
            t_fetch = time.perf_counter()
            host = self.inputs.fetch(chunk, (self.epoch, self.step_in_epoch, i))
            self._pace.fetched(time.perf_counter() - t_fetch)
            batch = self.task.move_to_device(host, s.device)  # non-blocking from pinned memory on CUDA
            sync = i == len(chunks) - 1
            with s.model.no_sync() if not sync else contextlib.nullcontext():
                with self._autocast(s):  # the forward only: backward runs in the forward ops' dtypes anyway
                    loss, extra = self.task.compute_loss(s.model, batch)
                if self._fault_from("nan"):
                    loss = loss * float("nan")
                # DDP averages over ranks: scaling by n*W/B makes that average the global-batch mean.
                scale = len(chunk) * self.world_size / tcfg.global_batch_size
                (loss * scale if scale != 1.0 else loss).backward()
            total += loss.detach().double() * len(chunk)
            for k, v in extra_metrics(extra).items():
                metrics[k] = metrics.get(k, 0.0) + v * (len(chunk) / len(local_idx))
        # The global gradient norm (after DDP's all-reduce: the same on every rank), before clipping: every
        # step when clipping needs it anyway, else at rank 0's log steps only. A device tensor: no sync here.
        self._grad_norm = None
        if tcfg.grad_clip is not None:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(s.model.parameters(), tcfg.grad_clip)
        elif self.rank == 0 and (self.global_step + 1) % tcfg.log_every_steps == 0:
            grads = [p.grad for p in s.model.parameters() if p.grad is not None]
            self._grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        if s.scheduler is not None:
            s.scheduler.step()
        if self._fault_now("crash_after_step"):
            os.kill(os.getpid(), signal.SIGKILL)
        return total / len(local_idx), metrics

    def _autocast(self, s: TrainSession) -> contextlib.AbstractContextManager[Any]:
        if self.cfg.training.amp == "bf16":
            return torch.autocast(device_type=s.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _step_row(
        self,
        s: TrainSession,
        loss: torch.Tensor,
        metrics: dict[str, Any],
        dt: float,
        stall: float,
        now: float,
    ) -> dict[str, Any]:
        return {
            "time": now,
            "global_step": self.global_step,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "loss": float(loss),
            "lr": float(s.optimizer.param_groups[0]["lr"]),
            "grad_norm": float(self._grad_norm) if self._grad_norm is not None else None,
            "peak_mem_gib": _peak_memory_gib(s.device),
            "step_time_s": dt,
            "input_wait_s": self._pace.input_s,
            "samples_per_s": self.cfg.training.global_batch_size / dt if dt > 0 else 0.0,
            "checkpoint_stall_s": stall,
            "world_size": self.world_size,
            "attempt": self.attempt,
            **{f"m_{k}": float(v) for k, v in metrics.items()},
        }

    # ----------------------------------------------------------------- evaluation
    def _eval_due(self, s: TrainSession) -> bool:
        return eval_due(
            self.global_step, s.sampler.steps_per_epoch, self.cfg.training.epochs, self.cfg.evaluation
        )

    def _eval_reader(self, device: torch.device) -> Any:
        """The eval loader processes' reader (``evaluation.loader_workers``, default the training's), made
        at the first evaluation and kept; None to read in turn."""
        e, t = self.cfg.evaluation, self.cfg.training
        workers = e.loader_workers if e.loader_workers is not None else t.loader_workers
        if workers == 0:
            return None
        if self._eval_loader is None or self._eval_loader.broken:
            self._eval_loader = EvalLoader(self._eval_dataset, workers, t.prefetch, device)
        return self._eval_loader.batches

    def _evaluate(self, s: TrainSession) -> EvalResult:
        """Evaluate at this step, on every rank together (``cluster.evaluate``); rank 0 queues the result as
        an ``eval`` metric row for the driver."""

        crash = any(f.kind == "crash_in_eval" and f.step == self.global_step for f in self.faults)

        def alive() -> None:
            self._last_step_at = time.time()
            self._eval_batches += 1  # progress for the hang watch
            if crash:
                os.kill(os.getpid(), signal.SIGKILL)

        res = evaluate(
            self.task,
            s.raw_model,
            self._eval_dataset,
            self.cfg,
            self.global_step,
            self.rank,
            self.world_size,
            s.device,
            autocast=lambda: self._autocast(s),
            progress=alive,
            reader=self._eval_reader(s.device),
        )
        alive()
        values = {"loss": res.loss, **res.metrics}
        self._last_eval = (self.global_step, values)
        if self._best.update(self.global_step, values):
            self._best_at = self.global_step
        if self.rank == 0:
            spe = s.sampler.steps_per_epoch
            at_end = self.step_in_epoch == 0 and self.global_step > 0  # resumed at an epoch's end
            epoch, in_epoch = (self.epoch - 1, spe) if at_end else (self.epoch, self.step_in_epoch)
            self._rows.append(
                {
                    "kind": "eval",
                    "time": time.time(),
                    "global_step": self.global_step,
                    "epoch": epoch,
                    "step_in_epoch": in_epoch,
                    "loss": res.loss,
                    "step_time_s": res.seconds,
                    "samples_per_s": res.samples / res.seconds if res.seconds > 0 else 0.0,
                    "world_size": self.world_size,
                    "attempt": self.attempt,
                    "eval_samples": res.samples,
                    **{f"m_{k}": v for k, v in res.metrics.items()},
                }
            )
        return res

    def _early_stop_due(self) -> bool:
        return self._best.stop_due(self.global_step)

    def _best_due(self) -> bool:
        """A checkpoint of this step's new best evaluation, unless one of this step exists."""
        return self._best_at == self.global_step and self._last_checkpoint != self.global_step

    # ----------------------------------------------------------------- checkpoints
    def _checkpoint_due_at_step(self, s: TrainSession) -> bool:
        every = self.cfg.checkpoint.every_steps
        at_epoch_end = self.step_in_epoch == s.sampler.steps_per_epoch
        return bool(every) and self.global_step % every == 0 and not at_epoch_end

    def _checkpoint_due_at_epoch_end(self, epoch: int) -> bool:
        every = self.cfg.checkpoint.every_epochs
        last = epoch + 1 == self.cfg.training.epochs
        by_steps = (
            bool(self.cfg.checkpoint.every_steps) and self.global_step % self.cfg.checkpoint.every_steps == 0
        )
        return last or by_steps or (bool(every) and (epoch + 1) % every == 0)

    def train_state(self, s: TrainSession, with_optimizer: bool = True) -> TrainState:
        """The train state at this point; at an epoch's end it points at the start of the next epoch.
        A sharded optimizer's ``state_dict`` needs ``consolidate_state_dict`` on every rank first
        (``_checkpoint`` does it); ``with_optimizer=False`` leaves the optimizer out."""
        at_end = self.step_in_epoch == s.sampler.steps_per_epoch
        epoch, step_in_epoch = (self.epoch + 1, 0) if at_end else (self.epoch, self.step_in_epoch)
        return TrainState(
            global_step=self.global_step,
            epoch=epoch,
            step_in_epoch=step_in_epoch,
            world_size=self.world_size,
            seed=self.cfg.training.seed,
            optimizer=s.optimizer.state_dict() if with_optimizer else {},
            scheduler=s.scheduler.state_dict() if s.scheduler is not None else None,
            sampler_order=self.sampler_order,
            best_eval=self._best.state,
            skipped_steps=[list(w) for w in self.skips],
        )

    def _checkpoint(self, s: TrainSession) -> float:
        """Every rank at the same step; rank 0 hands state to the writer (a host copy; the upload runs in the
        background). A sharded optimizer's state is gathered on rank 0 first (a collective)."""
        self._last_checkpoint = self.global_step
        if _is_zero(s.optimizer):
            s.optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
        if s.writer is None:
            return 0.0
        state = self.train_state(s)
        meta: dict[str, Any] = {
            "world_size": self.world_size,
            "step_in_epoch": state.step_in_epoch,
            "attempt": self.attempt,
        }
        if self._last_eval is not None and self._last_eval[0] == self.global_step:
            meta["eval"] = self._last_eval[1]  # the evaluation of this very model
            metric = self.cfg.checkpoint.best_metric
            if metric is not None:
                meta["score"] = {
                    "metric": metric,
                    "mode": self.cfg.checkpoint.best_mode,
                    "value": self._last_eval[1][metric],
                }
            if self._early_stop_due() and self._best.state is not None:
                meta["early_stopped"] = {**self._best.state, "patience": self.cfg.evaluation.patience}
        stall = s.writer.save(
            self.global_step,
            state.epoch,
            meta,
            {"model.pt": s.raw_model.state_dict(), "train_state.pt": state.state_dict()},
        )
        self._last_step_at = time.time()
        return stall

    # ----------------------------------------------------------------- faults, heartbeat, teardown
    def _fault_from(self, kind: str) -> bool:
        """Whether a fault of ``kind`` is on in the step running now (it starts at its step)."""
        return bool(self.faults) and any(
            f.kind == kind and f.step <= self.global_step + 1 for f in self.faults
        )

    def _fault_now(self, kind: str) -> bool:
        """Whether a fault of ``kind`` is due in the step running now."""
        return any(f.kind == kind and f.step == self.global_step + 1 for f in self.faults)

    def _maybe_inject_fault(self) -> None:
        next_step = self.global_step + 1
        for fault in self.faults:
            if fault.step != next_step or fault.kind not in ("crash", "hang", "raise"):
                continue
            if fault.kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "hang":
                while True:
                    time.sleep(3600)
            elif fault.kind == "raise":
                raise RuntimeError(f"injected fault on rank {self.rank} at step {next_step}")

    def stacks(self) -> list[dict[str, Any]]:
        """The Python stacks of this process's other threads, the training thread marked (served by the
        actor's second thread while the first trains or hangs; ``cluster.stacks``)."""
        return stack_dump.to_wire(stack_dump.take(self._train_ident if self._in_epoch else None))

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            self.rank,
            self.global_step,
            self._last_step_at,
            self._max_step_time,
            self._in_epoch,
            rows=self._drain_rows(),
            pace=self._pace.take(),
            eval_batches=self._eval_batches,
        )

    def _drain_rows(self) -> list[dict[str, Any]]:
        """Rank 0's buffered step rows, oldest first (thread-safe: the training thread appends while the
        heartbeat thread drains)."""
        out = []
        while True:
            try:
                out.append(self._rows.popleft())
            except IndexError:
                return out

    def profile(self, req_id: str, steps: int, folder: str) -> None:
        """Record the next ``steps`` training steps with ``torch.profiler`` into ``<run>/<folder>/``
        (``cluster.profiling``); served by the actor's second thread, started by the training thread."""
        if self._profiler is None:
            self._profiler = StepProfiler(Storage(self.run_url, self.cfg.storage.options), self.rank)
        self._profiler.request(ProfileRequest(req_id, steps, folder))

    def finish(self) -> list[CommitRecord]:
        """Flush the checkpoint in flight (and a profile cut short by the run's end); return the commit
        records not yet reported."""
        if self._profiler is not None:
            self._profiler.close(self.global_step)
        writer = self.session.writer if self.session is not None else None
        if writer is None:
            return []
        cdist.bind_thread(self.session.device if self.session is not None else None)
        writer.close(flush=True)
        return writer.drain()

    def shutdown(self) -> None:
        if self.session is not None and self.session.writer is not None:
            self.session.writer.close(flush=False)
        cdist.destroy_process_group()

    def prepare(self) -> float:
        """Hot spare: load the task and dataset and pay DDP's one-time import now, not in a recovery."""
        t0 = time.time()
        _ = self.task  # builds the task and its dataset
        import torch._dynamo  # noqa: F401  (DistributedDataParallel.__init__ imports it once, slowly)

        return time.time() - t0

    def reset(self, rank: int, world_size: int, attempt: int) -> None:
        """Warm restart: end the session (process group, model, optimizer, position), keep the task and its
        dataset. Only valid once ``run_epoch`` has returned (a worker blocked in a collective must be
        killed)."""
        self.shutdown()
        if self._kept is not None:
            self._discard(self._kept)
            self._kept = None
        self.session = None
        self._pace.close()
        self._store = None
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self.global_step = self.epoch = self.step_in_epoch = 0
        self.sampler_order = TORCH_ORDER
        self._best.state, self._best_at, self._last_eval = None, None, None
        self._last_checkpoint = -1
        self._stop = _StopRequest()
        self._max_step_time = 0.0
        self._last_step_at = time.time()
        self.faults = self._faults()


def _buffer_sync(sync: bool) -> dict[str, Any]:
    """DDP's switch for broadcasting buffers before each forward: ``forward_sync_buffers`` since torch 2.13,
    ``broadcast_buffers`` (deprecated there) before it, where a GPU machine's torch may still be."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": sync}
    return {"broadcast_buffers": sync}


def _init_sync(sync: bool) -> dict[str, Any]:
    """DDP's ``init_sync`` where the installed torch has it (older ones always sync at init)."""
    if not sync and "init_sync" in inspect.signature(DDP.__init__).parameters:
        return {"init_sync": False}
    return {}


def _is_zero(optimizer: torch.optim.Optimizer) -> bool:
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # no import (0.4 s)
    return zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer)


def _unsendable(optimizer: torch.optim.Optimizer) -> str:
    """Why one rank's optimizer state is not the whole state (so peers cannot send it); "" when it is."""
    if _is_zero(optimizer):
        return "ZeroRedundancyOptimizer shards the optimizer state across ranks"
    return ""


def _checked_eval_set(dataset: Any, task: str) -> Any:
    if dataset is not None and len(dataset) == 0:
        raise ConfigError(
            f"{task}.build_eval_dataset() returned an empty dataset; return None for no evaluation"
        )
    return dataset


class _CrashingStore(CheckpointStore):
    """Fault injection: die after writing a checkpoint's files, before its manifest (a torn write)."""

    def __init__(self, storage: Storage, steps: set[int]) -> None:
        super().__init__(storage)
        self.steps = steps

    def commit(self, step: int, files: dict[str, bytes], meta: dict[str, Any]) -> Any:
        if step in self.steps:
            for name, data in files.items():
                self.storage.write_bytes(f"{step_dir(step)}/{name}", data)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().commit(step, files, meta)
