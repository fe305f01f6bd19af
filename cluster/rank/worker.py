"""The hand-written DDP worker: one process, one GPU (or CPU share). Plain Python, no Ray.

Lifecycle, driven from outside (the Ray actor of ``cluster.worker_group.actor``, or plain processes in tests):
``bind_store`` (rank 0 only) -> ``setup`` (process group, task, DDP wrap, resume: returns the
:class:`TrainSession`) -> ``run_epoch`` per epoch (the driver owns the epoch, so ``set_epoch`` cannot be
forgotten) -> ``finish`` -> ``shutdown``. ``reset`` ends the session but keeps the task and its dataset for a
warm restart; ``release`` keeps the state too, for a peer recovery (``cluster.rank.rejoin``).
``heartbeat`` is safe to call from another thread at any time: it is the hang heartbeat.

The training loop is :meth:`Worker._run_epoch`; what it asks at each step boundary is answered by the schedule
(``cluster.spec.schedule``), the step's optional parts (faults injected on purpose, a profile, the replica
guard, rollback points) are step hooks (``cluster.rank.step_hooks``), the model is wrapped by
``cluster.rank.ddp``, and the state a checkpoint or a peer carries is ``cluster.rank.train_state``.

Determinism: every step reseeds the RNGs from (seed, global step, rank), and the sampler is a pure
function of (seed, epoch, step). A checkpoint at step ``s`` (weights plus ``TrainState``) therefore
carries everything needed to continue exactly, and a resumed run is bitwise equal to an uninterrupted one at
the same world size.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cluster.core import stacks as stack_dump
from cluster.core.errors import ConfigError, DivergedError, StorageError, WorkerError
from cluster.data.pipeline import InputPipeline
from cluster.rank import ddp
from cluster.rank import dist as cdist
from cluster.rank import rejoin as recovery
from cluster.rank.evals import Evaluations
from cluster.rank.evaluate import eval_batch_count
from cluster.rank.faults import Faults
from cluster.rank.pace import StepPace
from cluster.rank.process import set_niceness, tune_process
from cluster.rank.profiling import ProfileRequest, StepProfiler
from cluster.rank.replica import ReplicaGuard, ReplicaMismatchError
from cluster.rank.rollback_points import MemorySnapshots
from cluster.rank.session import TrainSession, build_model, join_group, sampler_for, write_again, writer_for
from cluster.rank.step import Divergence, peak_memory_gib, seed_step, step_seed, train_step
from cluster.rank.step_hooks import ProfilerHook, StepHooks, step_hooks
from cluster.rank.train_state import RunPosition, capture, checkpoint_files
from cluster.run.checkpoint import CommitRecord
from cluster.run.folder import RunFolder
from cluster.run.lease import GENERATION_ENV, Fence
from cluster.run.storage import PROBE_ENV, check_probe
from cluster.seam.peers import PeerPlan, PeerState
from cluster.seam.protocol import EpochResult, Heartbeat, SetupInfo
from cluster.spec.config import JobConfig
from cluster.spec.schedule import HOLD_STEPS as HOLD_STEPS  # cluster.worker_group imports it from here
from cluster.spec.schedule import Schedule, StopRequest, Window, merge_windows, skip_windows
from cluster.spec.task import StepInfo, Task, build_task

logger = logging.getLogger(__name__)


@dataclass
class _EpochTally:
    """One epoch's sums. Loss and metric sums stay on the device: read at the epoch's end, never per step
    (no host sync)."""

    loss_sum: torch.Tensor
    metric_sums: dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    samples: int = 0
    skipped: int = 0
    first_step_at: float | None = None
    started: float = field(default_factory=time.perf_counter)
    input_s: float = 0.0  # waits for batches (the goodput ledger's input stall)

    def add(self, loss: torch.Tensor, metrics: dict[str, Any], samples: int) -> None:
        self.steps += 1
        self.samples += samples
        self.loss_sum += loss
        for k, v in metrics.items():
            self.metric_sums[k] = self.metric_sums.get(k, 0.0) + v

    def result(
        self,
        rank: int,
        epoch: int,
        global_step: int,
        loss: float,
        seconds: float,
        rows: list[dict[str, Any]],
        commits: list[CommitRecord],
        stopped: bool,
        early: bool,
        best: dict[str, Any] | None,
    ) -> EpochResult:
        """The epoch's result for the driver: these sums, the mean loss over every rank (``loss``) and what
        the epoch's end drained (rank 0's step rows, its commit records)."""
        return EpochResult(
            rank=rank,
            epoch=epoch,
            global_step=global_step,
            steps=self.steps,
            samples=self.samples,
            skipped=self.skipped,
            loss=loss,
            seconds=seconds,
            first_step_at=self.first_step_at,
            input_wait_s=self.input_s,
            step_rows=rows,
            commits=commits,
            metrics={k: float(v) / max(self.steps, 1) for k, v in self.metric_sums.items()},
            stopped=stopped,
            early_stopped=early,
            best=best,
        )


def _drain(rows: deque[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's buffered step rows, oldest first (thread-safe: the training thread appends while the
    heartbeat thread drains)."""
    out = []
    while True:
        try:
            out.append(rows.popleft())
        except IndexError:
            return out


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
        self.folder: RunFolder | None = None  # the run's, made at each ``setup`` (``cluster.run.folder``)
        self.attempt = attempt
        self.pos = RunPosition.start(cfg)  # the driver's skip windows join it at each setup
        self.session: TrainSession | None = None
        self._last_step_at = time.time()
        self._max_step_time = 0.0
        self._in_epoch = False
        self._store: dist.TCPStore | None = None
        self._connect_marks: dict[str, float] = {}
        self._rows: deque[dict[str, Any]] = deque()  # rank 0's step rows not yet handed to the driver
        self._commit_rows: list[dict[str, Any]] = []  # rank 0's step rows since its last checkpoint
        self._first_step_at: float | None = None  # this group's first step (heartbeats: the goodput ledger)
        self._kept: TrainSession | None = None  # a survivor's session after its group failed (peer recovery)
        self._task: Task | None = None
        self._dataset: Any = None
        self._task_lock = threading.Lock()  # a hot spare's setup can begin while ``prepare`` builds the task
        self._inputs: InputPipeline | None = None
        self._stop = StopRequest()
        self._last_checkpoint = -1  # the newest checkpoint's step this process wrote or resumed from
        self._evals = Evaluations(cfg)
        self._train_ident: int | None = None
        # the last step's gradient norm, when it was taken (``cluster.rank.step.train_step``)
        self._grad_norm: torch.Tensor | None = None
        self._profiler: StepProfiler | None = None  # made by the first ``profile`` request
        self._divergence = Divergence(cfg.failures)
        self._replica = ReplicaGuard(cfg.failures.replica_check_steps)  # ranks compare their parameters
        self._memory = MemorySnapshots(cfg)  # rollback points after a NaN loss (failures.nan_snapshot_steps)
        self.gpu_index = 0  # this rank's GPU among the visible ones (``use_gpus``)
        self.faults = Faults(cfg, rank, attempt)
        self._pace = StepPace()
        self._hooks = StepHooks()  # the step's optional parts that are on (``cluster.rank.step_hooks``)
        self.allocator = tune_process(cfg)  # before the process group and task make their threads

    @property
    def task(self) -> Task:
        """The task, built on first use and kept for the life of the process (warm restarts included)."""
        with self._task_lock:
            if self._task is None:
                task = build_task(self.cfg.task, self.cfg.task_args, self.task_cls)
                self._dataset = task.build_train_dataset()
                self._evals.dataset = _checked_eval_set(task.build_eval_dataset(), self.cfg.task)
                self._task = task
            return self._task

    @property
    def dataset(self) -> Any:
        _ = self.task  # built together with the task
        return self._dataset

    @property
    def inputs(self) -> InputPipeline:
        """Where each micro-batch comes from (``cluster.data.pipeline``): kept, like the dataset, for the life
        of the process, loader processes included."""
        if self._inputs is None:
            t = self.cfg.training
            self._inputs = InputPipeline(
                self.dataset, t.loader_workers, t.prefetch, t.grad_accum_steps, t.seed
            )
        return self._inputs

    # ----------------------------------------------------------------- setup
    def use_gpus(self, visible: str, index: int) -> str:
        """See the GPUs ``visible`` (``CUDA_VISIBLE_DEVICES``, every GPU of the group on this node) and
        train on the ``index``-th (``cluster.rank.dist.share_gpus``). Only before CUDA starts in this process:
        a survivor of a failure keeps the devices it started with (its own GPU's index in them is unchanged).
        Returns the list in effect."""
        if torch.cuda.is_initialized():
            return os.environ.get("CUDA_VISIBLE_DEVICES", "")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        self.gpu_index = index
        return visible

    def bind_store(self, ipv4: bool = True, host: str | None = None) -> int:
        """Rank 0 only: bind the rendezvous store on ``host`` (one address of this machine; default
        loopback, ``ipv4`` or not: see ``cluster.rank.dist.bind_store``); return its port (the caller
        publishes host:port)."""
        timeout = self.cfg.failures.process_group_timeout_s
        self._store, port = cdist.bind_store(self.world_size, timeout, ipv4, host)
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
        own).

        An exception of the task's code (its ``__init__``, ``build_*``), of a checkpoint that does not fit
        its model, or of the process group raises as a :class:`WorkerError` with ``detail`` ``phase``
        (``setup``), ``where`` (the innermost ``file:line`` of the task's code, else of this package) and
        ``every_rank`` (every rank raised the same error: it will again, whatever is retried). The errors
        the driver handles by their type (ConfigError, StorageError and theirs) pass as they are."""
        step = self.pos.global_step
        try:
            session = self._setup(host, port, peers, skips, rollback)
        except (ConfigError, StorageError):
            raise
        except Exception as exc:
            err = self._setup_error(exc, step)
        else:
            self._commit_rows = []  # rows of an attempt that failed: its commits wrote theirs
            self._first_step_at = None
            return session
        raise err

    def _setup_error(self, exc: Exception, step: int) -> WorkerError:
        """The WorkerError of an exception raised in set-up; whether every rank raised the same is agreed
        through the rendezvous store (each failing rank posts its error there and waits a moment for the
        others'; the ranks that did not fail wait in a collective until the driver ends them)."""
        where = user_frame(exc)
        detail: dict[str, Any] = {"phase": "setup", "where": where}
        signature = f"{type(exc).__name__}\0{exc}\0{where}"
        detail["every_rank"] = cdist.same_on_every_rank(self._store, self.rank, self.world_size, signature)
        return WorkerError(self.rank, step, type(exc).__name__, str(exc), traceback.format_exc(), detail)

    def _setup(
        self,
        host: str,
        port: int,
        peers: PeerPlan | None,
        skips: list[Window] | None,
        rollback: Window | None,
    ) -> TrainSession:
        t = {**self._connect_marks, "start": time.time()}  # ``connect``'s, when it ran
        self._connect_marks = {}
        cfg = self.cfg
        runs = merge_windows([*skip_windows(cfg.training.skip_steps), *(skips or [])])
        self.pos = dataclasses.replace(self.pos, skips=runs)
        self._divergence.reset()  # a non-finite loss of an earlier group's path is not this one's
        kept, self._kept = self._kept, None
        if peers is None and kept is not None:
            recovery.discard(kept)  # the driver chose the checkpoint: the survivor's state is not used
            kept = None
        folder = self.folder = RunFolder.at(self.run_url, cfg.storage.options)
        if os.environ.get(PROBE_ENV):  # set by the driver: prove this node sees the driver's storage
            check_probe(folder.storage, os.environ[PROBE_ENV])
        probe_reads = (folder.storage.reads, folder.storage.bytes_read)  # not the resume's
        device = cdist.pick_device(cfg.scaling.use_gpu, self.gpu_index)
        backend = join_group(self._store, host, port, self.rank, self.world_size, device, cfg, t)
        task = self.task  # a warm restart keeps it and its datasets
        has_eval = self._evals.dataset is not None
        raw_model = build_model(task, cfg, has_eval, device, kept.raw_model if kept is not None else None)
        self.inputs.open(device)  # loader processes start (once per process) while setup goes on
        t["task"] = time.time()
        sampler = sampler_for(self.dataset, self.rank, self.world_size, cfg)
        store = self.faults.store(folder)
        if os.environ.get(GENERATION_ENV):  # set by the driver: its lease's generation (cluster.run.lease)
            store.fence = Fence(store.storage, int(os.environ[GENERATION_ENV])).check
        rank, size, pos, memory = self.rank, self.world_size, self.pos, self._memory
        taken = recovery.take_state(
            task, cfg, rank, size, pos, kept, peers, rollback, raw_model, device, sampler, store, memory, t
        )
        model, optimizer, scheduler, resume, skipped, self.pos, self._last_checkpoint = taken
        self._memory.drop_after(self.pos.global_step)  # copies past it are of a path the run left
        sampler.order = self.pos.sampler_order  # the resumed run's (a new run's when nothing was resumed)
        self._replica.begin(raw_model, self.world_size, self.pos.global_step)  # every rank holds the same
        self._hooks = step_hooks(self.faults, self._profiler, self._replica, self._memory, self.world_size)
        writer = writer_for(self.rank, kept.writer if kept is not None else None, store, cfg)
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
            storage_reads=store.storage.reads - probe_reads[0],
            storage_read_bytes=store.storage.bytes_read - probe_reads[1],
            eval_batches=eval_batch_count(self._evals.dataset, cfg),
        )
        self.session = TrainSession(
            device,
            backend,
            model,
            raw_model,
            optimizer,
            scheduler,
            sampler,
            store,
            writer,
            info,
            Schedule(cfg, sampler.steps_per_epoch),
        )
        return self.session

    def _session(self) -> TrainSession:
        if self.session is None:
            raise RuntimeError("Worker.setup() must run before training (or again after reset())")
        return self.session

    # ----------------------------------------------------------------- training
    def run_epoch(
        self, epoch: int, start_step: int, dispatch: int = 0, evaluate_first: bool = False, seq: int = 0
    ) -> EpochResult:
        """Train epoch ``epoch`` from step ``start_step`` to its end (or to the step a stop request names);
        evaluate and checkpoint as configured. ``dispatch`` numbers the driver's calls (see
        :class:`cluster.spec.schedule.StopRequest`). ``evaluate_first``: the evaluation due at the resume
        point was lost with a failure (the driver never got it): run it before the first step. ``seq``: how
        many events the run's log held when the driver dispatched the epoch (the step rows rank 0 writes
        beside its commits are placed by it: ``cluster.run.logs.write_metrics``)."""
        if self._stop.dispatch != dispatch:
            self._stop = StopRequest()  # a request for an earlier call
        self._train_ident = threading.get_ident()  # whose stack ``stacks`` marks as the training thread
        try:
            session = self._session()
            if session.writer is not None:
                session.writer.rows_seq = seq
            cdist.bind_thread(session.device)  # Ray may run this call on another thread than setup's
            return self._run_epoch(session, epoch, start_step, dispatch, evaluate_first)
        except WorkerError as exc:
            err = exc.with_traceback(None)
        except Exception as exc:
            err = WorkerError(
                self.rank,
                self.pos.global_step + 1,
                type(exc).__name__,
                str(exc),
                traceback.format_exc(),
                exc.detail if isinstance(exc, DivergedError | ReplicaMismatchError) else None,
            )
        finally:
            self._in_epoch = False
        recovery.leave_group(self.session)  # peers blocked on this rank fail now, not at the timeout
        raise err

    def hold_stop(self, dispatch: int) -> int:
        """Phase 1 of a planned stop (:class:`cluster.spec.schedule.StopRequest`): this rank's step; it trains
        at most ``HOLD_STEPS`` more before it needs :meth:`stop_at`."""
        step = self.pos.global_step
        self._stop = StopRequest(dispatch, step + HOLD_STEPS)
        return step

    def stop_at(self, dispatch: int, step: int, checkpoint: bool) -> None:
        """Phase 2: stop before step ``step + 1`` (or at the epoch's end if that comes first); rank 0
        commits a checkpoint there when ``checkpoint``."""
        self._stop.tell(dispatch, step, checkpoint)

    def _run_epoch(
        self, s: TrainSession, epoch: int, start_step: int, dispatch: int = 0, evaluate_first: bool = False
    ) -> EpochResult:
        """The training loop. At each step boundary: stop here?, skip or train the step, then what the
        schedule says is due (evaluate, checkpoint, log); the epoch's last step is decided at its end
        (:meth:`_end_epoch`), together with a planned stop's checkpoint."""
        p, sched = self.pos, s.schedule
        set_niceness(self.cfg.scaling.worker_niceness)  # threads Ray started since (a few syscalls)
        s.sampler.set_epoch(epoch, start_step, sched.skips(p.skips, p.global_step, start_step))
        self.inputs.start_epoch(s.sampler, s.device)
        p.epoch, p.step_in_epoch = epoch, start_step
        s.model.train()
        self._in_epoch = True
        self._last_step_at = time.time()
        tally = _EpochTally(torch.zeros((), dtype=torch.float64, device=s.device))
        early = False  # early stopping (evaluation.patience): the run ends at this step
        if evaluate_first and self._evals.dataset is not None:
            self._evaluate(s)
            early = p.best.stop_due(p.global_step)
            if self._checkpoint_due(early):
                self._checkpoint(s)
        stopped = False
        for local_idx in s.sampler if not early else ():
            if self._stop.due(dispatch, p.global_step, self.cfg.failures.process_group_timeout_s):
                stopped = True
                break
            step = None
            if p.step_in_epoch in s.sampler.skip:
                self._skip_step(s)
                tally.skipped += 1
            else:
                step = self._step(s, epoch, local_idx, tally)
            for hook in self._hooks.end:  # replica guard, rollback points
                hook(s, p)
            due = False
            if p.step_in_epoch < sched.steps_per_epoch:  # the epoch's last step: in _end_epoch
                early = self._maybe_evaluate(s)
                due = self._checkpoint_due(sched.checkpoint(p.global_step) or early)
            row = None
            if step is not None and self.rank == 0 and (sched.log(p.global_step) or due):
                row = self._step_row(s, *step)
                self._journal(s, row)  # before the checkpoint: its commit carries the rows up to it
            stall = self._checkpoint(s) if due else 0.0
            if row is not None:
                row["checkpoint_stall_s"] = stall
                self._rows.append(row)
                self._divergence.check(row["loss"], p.global_step)
            if early:
                break
        return self._end_epoch(s, epoch, dispatch, tally, stopped, early)

    def _step(
        self, s: TrainSession, epoch: int, local_idx: torch.Tensor, tally: _EpochTally
    ) -> tuple[torch.Tensor, dict[str, Any], float, float]:
        """Train one step, timed, between the faults' hooks; count it in ``tally``. Returns its loss and
        metrics (device tensors), its seconds and when it ended."""
        p = self.pos
        t0 = time.perf_counter()
        self._pace.begin()
        for hook in self._hooks.before:  # faults, profiler
            hook(s, p)
        seed_step(s.device, step_seed(self.cfg.training.seed, p.global_step, self.rank))
        self.task.current = StepInfo(epoch, p.global_step + 1, self.rank, self.world_size, self.attempt)
        loss, metrics, self._grad_norm = train_step(
            s,
            self.task,
            self.inputs,
            self._pace,
            self.cfg,
            p,
            self.world_size,
            local_idx,
            lambda loss: self.faults.loss(p.global_step + 1, loss),
            want_norm=self.rank == 0 and s.schedule.log(p.global_step + 1),
        )
        p.global_step += 1
        for hook in self._hooks.after:  # faults, profiler
            hook(s, p)
        p.step_in_epoch += 1
        tally.add(loss, metrics, self.cfg.training.global_batch_size)
        tally.input_s += self._pace.input_s
        self._divergence.track(loss, p.global_step)
        dt = time.perf_counter() - t0
        self._pace.end(dt)
        now = time.time()
        if tally.first_step_at is None:
            tally.first_step_at = now
        if self._first_step_at is None:
            self._first_step_at = now
        self._max_step_time = max(self._max_step_time, dt)
        self._last_step_at = now
        return loss, metrics, dt, now

    def _maybe_evaluate(self, s: TrainSession) -> bool:
        """Evaluate when the schedule says so after this step; whether early stopping
        (``evaluation.patience``) ends the run here."""
        p = self.pos
        if self._evals.dataset is None or not s.schedule.evaluate(p.global_step):
            return False
        self._evaluate(s)
        return p.best.stop_due(p.global_step)

    def _checkpoint_due(self, due: bool) -> bool:
        """Whether to checkpoint this step: when ``due`` or when its evaluation became the best, unless one
        of this step exists."""
        step = self.pos.global_step
        return (due or self._evals.best_at == step) and self._last_checkpoint != step

    def _journal(self, s: TrainSession, row: dict[str, Any]) -> None:
        """Keep rank 0's step row for the next commit, which writes the rows up to its step beside it
        (``CheckpointWriter.save``): a driver that dies before it writes them does not take them along."""
        if s.writer is not None:
            self._commit_rows.append(row)

    def _end_epoch(
        self, s: TrainSession, epoch: int, dispatch: int, tally: _EpochTally, stopped: bool, early: bool
    ) -> EpochResult:
        """The epoch's end: its last step's evaluation and checkpoint (or a planned stop's checkpoint), the
        mean loss over every rank (one collective per epoch; nothing per step) and the divergence check."""
        p, sched = self.pos, s.schedule
        self._replica.settle()
        asked = self._stop.settle(dispatch, self.cfg.failures.process_group_timeout_s)
        at_end = not stopped and p.step_in_epoch == sched.steps_per_epoch
        if at_end and not early:
            early = self._maybe_evaluate(s)  # before the checkpoint of the same step
        due = asked or (at_end and sched.checkpoint(p.global_step, epoch)) or early  # asked: a stop's
        if (asked or at_end) and self._checkpoint_due(due):  # (a move without peers, a notice too short)
            self._checkpoint(s)
        mean_loss = cdist.mean_over_ranks(float(tally.loss_sum), float(tally.steps), s.device)
        self._divergence.agree(mean_loss)
        self._divergence.check(mean_loss, p.global_step, "the epoch's mean loss")  # every rank alike
        seconds = time.perf_counter() - tally.started
        rows, commits = _drain(self._rows), s.writer.drain() if s.writer else []
        best = dict(p.best.state) if early and p.best.state is not None else None
        return tally.result(
            self.rank, epoch, p.global_step, mean_loss, seconds, rows, commits, stopped, early, best
        )

    def _skip_step(self, s: TrainSession) -> None:
        """A skipped step: no batch, no forward, no update; the step count and the learning-rate schedule
        move on as if it had trained, on every rank alike (no collective)."""
        self.pos.global_step += 1
        self.pos.step_in_epoch += 1
        if s.scheduler is not None:
            with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": meant here
                warnings.simplefilter("ignore", UserWarning)
                s.scheduler.step()
        self._last_step_at = time.time()

    def _step_row(
        self,
        s: TrainSession,
        loss: torch.Tensor,
        metrics: dict[str, Any],
        dt: float,
        now: float,
    ) -> dict[str, Any]:
        """Rank 0's metric row of the step just trained (``checkpoint_stall_s`` is set once the step's
        checkpoint, if any, is taken)."""
        p = self.pos
        return {
            "time": now,
            "global_step": p.global_step,
            "epoch": p.epoch,
            "step_in_epoch": p.step_in_epoch,
            "loss": float(loss),
            "lr": float(s.optimizer.param_groups[0]["lr"]),
            "grad_norm": float(self._grad_norm) if self._grad_norm is not None else None,
            "peak_mem_gib": peak_memory_gib(s.device),
            "step_time_s": dt,
            "input_wait_s": self._pace.input_s,
            "samples_per_s": self.cfg.training.global_batch_size / dt if dt > 0 else 0.0,
            "checkpoint_stall_s": 0.0,
            "world_size": self.world_size,
            "attempt": self.attempt,
            **{f"m_{k}": float(v) for k, v in metrics.items()},
        }

    # ----------------------------------------------------------------- evaluation and checkpoints
    def _evaluate(self, s: TrainSession) -> None:
        """Evaluate at this step, on every rank together (``cluster.rank.evals``); rank 0 queues the
        result as an ``eval`` metric row for the driver."""
        crash = self.faults.in_eval(self.pos.global_step)

        def alive() -> None:
            self._last_step_at = time.time()
            crash()

        _, row = self._evals.run(self.task, s, self.pos, self.rank, self.world_size, self.attempt, alive)
        if row is not None:
            self._rows.append(row)

    def _checkpoint(self, s: TrainSession) -> float:
        """Every rank at the same step; rank 0 hands state to the writer (a host copy; the upload runs in the
        background). A sharded optimizer's state is gathered on rank 0 first (a collective). At an epoch's
        end the state points at the start of the next epoch."""
        p = self.pos
        self._replica.verify(p.global_step)  # never a state the replicas disagree on
        self._last_checkpoint = p.global_step
        if ddp.is_zero(s.optimizer):
            s.optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
        if s.writer is None:
            return 0.0
        at = p.at_epoch_start(s.sampler.steps_per_epoch)
        state = capture(at, self.world_size, self.cfg.training.seed, s.optimizer, s.scheduler)
        meta: dict[str, Any] = {
            "world_size": self.world_size,
            "step_in_epoch": state.step_in_epoch,
            "attempt": self.attempt,
            **self._evals.checkpoint_meta(p),
            **self._replica.meta(p.global_step),
        }
        rows, self._commit_rows = self._commit_rows, []
        stall = s.writer.save(
            p.global_step, state.epoch, meta, checkpoint_files(s.raw_model, state), rows=rows
        )
        self._last_step_at = time.time()
        return stall

    # ----------------------------------------------------------------- heartbeat, recovery, teardown
    def stacks(self) -> list[dict[str, Any]]:
        """The Python stacks of this process's other threads, the training thread marked (served by the
        actor's second thread while the first trains or hangs; ``cluster.core.stacks``)."""
        return stack_dump.to_wire(stack_dump.take(self._train_ident if self._in_epoch else None))

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            self.rank,
            self.pos.global_step,
            self._last_step_at,
            self._max_step_time,
            self._in_epoch,
            rows=_drain(self._rows),
            pace=self._pace.take(),
            eval_batches=self._evals.batches,
            first_step_at=self._first_step_at,
        )

    def profile(self, req_id: str, steps: int, folder: str) -> None:
        """Record the next ``steps`` training steps with ``torch.profiler`` into ``<run>/<folder>/``
        (``cluster.rank.profiling``); served by the actor's second thread, started by the training thread."""
        if self._profiler is None:  # the setup's folder (a profile is asked for while an epoch trains)
            run = self.folder or RunFolder.at(self.run_url, self.cfg.storage.options)
            self._profiler = StepProfiler(run.storage, self.rank)
            self._hooks.add(ProfilerHook(self._profiler))  # from the next step on, after the faults
        self._profiler.request(ProfileRequest(req_id, steps, folder))

    def finish(self) -> list[CommitRecord]:
        """Flush the checkpoint in flight (and a profile cut short by the run's end); return the commit
        records not yet reported."""
        if self._profiler is not None:
            self._profiler.close(self.pos.global_step)
        writer = self.session.writer if self.session is not None else None
        if writer is None:
            return []
        cdist.bind_thread(self.session.device if self.session is not None else None)
        writer.close(flush=True)
        records = writer.drain()
        s, step = self.session, self._last_checkpoint
        if s is None or step != self.pos.global_step or ddp.is_zero(s.optimizer):
            return records  # a sharded optimizer's state needs every rank (a collective): not written again
        return records + write_again(writer, step, lambda: self._checkpoint(s))

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
            recovery.discard(self._kept)
            self._kept = None
        self.session = None
        self._pace.close()
        self.pos = RunPosition.start(self.cfg)
        self._evals.forget()
        self._last_checkpoint = -1
        self._next_group(rank, world_size, attempt)

    def release(self, rank: int, world_size: int, attempt: int) -> PeerState | None:
        """A survivor after its group failed: leave the process group, keep model, optimizer, scheduler and
        position in memory, take rank ``rank`` of the next group, and report what it holds. None when it
        holds no session (it never finished setup)."""
        s = self.session
        cdist.bind_thread(s.device if s is not None else None)
        recovery.leave_group(s)
        if s is None:
            self.reset(rank, world_size, attempt)
            return None
        self.pos, report = recovery.keep(s, self.pos, self.world_size, self.cfg.training.seed, rank)
        self.session, self._kept = None, s
        self._next_group(rank, world_size, attempt)
        return report

    def abort(self) -> bool:
        """From another thread: abort the process group so that a collective the training thread is
        blocked in returns (``cluster.rank.rejoin.abort``). Returns whether it aborted."""
        return recovery.abort(self.session)

    def _next_group(self, rank: int, world_size: int, attempt: int) -> None:
        """Take rank ``rank`` of the next group, in attempt ``attempt``: its stop request, faults and hang
        clock start afresh."""
        self._stop = StopRequest()
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self._store = None
        self._max_step_time = 0.0
        self._last_step_at = time.time()
        self.faults = Faults(self.cfg, rank, attempt)


def user_frame(exc: BaseException) -> str:
    """``file:line`` where ``exc`` was raised in the task's code: the innermost frame outside Python's
    library, the installed packages and this package; else the innermost in this package (a checkpoint
    that does not fit the model fails in ``cluster``); else the innermost of all. Paths are relative to
    the ``sys.path`` entry they were imported from, as the user's editor shows them."""
    frames = traceback.extract_tb(exc.__traceback__)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the cluster package
    libs = tuple(
        {
            os.path.dirname(os.__file__),
            *(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))),
        }
    )
    ours = [f for f in frames if not os.path.abspath(f.filename).startswith(libs)]
    theirs = [f for f in ours if not os.path.abspath(f.filename).startswith(here + os.sep)]
    if not frames:
        return "?"
    chosen = (theirs or ours or frames)[-1]
    path = os.path.abspath(chosen.filename)
    roots = [os.path.abspath(p) for p in sys.path if p and path.startswith(os.path.abspath(p) + os.sep)]
    if roots:
        path = os.path.relpath(path, max(roots, key=len))
    return f"{path}:{chosen.lineno}"


def _checked_eval_set(dataset: Any, task: str) -> Any:
    if dataset is not None and len(dataset) == 0:
        raise ConfigError(
            f"{task}.build_eval_dataset() returned an empty dataset; return None for no evaluation"
        )
    return dataset
