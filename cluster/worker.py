"""The hand-written DDP worker: one process, one GPU (or CPU share). Plain Python, no Ray.

Lifecycle, driven from outside (by the Ray actor in ``worker_group.py`` or by plain processes in tests):
``bind_store`` (rank 0 only) -> ``setup`` (process group, task, DDP wrap, resume) -> ``run_epoch`` per epoch
(the driver owns the epoch, so ``set_epoch`` cannot be forgotten) -> ``finish`` -> ``shutdown``.
``progress`` is safe to call from another thread at any time: it is the hang heartbeat.

Determinism: every step reseeds the RNGs from (seed, global step, rank), and the sampler is a pure
function of (seed, epoch, step). A checkpoint at step ``s`` therefore carries everything needed to continue
exactly, and a resumed run is bitwise equal to an uninterrupted one at the same world size.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cluster import dist as cdist
from cluster.checkpoint import CheckpointStore, CheckpointWriter, CommitRecord, step_dir
from cluster.config import FaultSpec, JobConfig, parse_fault_env
from cluster.data import ResumableDistributedSampler, fetch_batch
from cluster.errors import WorkerError
from cluster.storage import PROBE_ENV, Storage, check_probe
from cluster.task import StepInfo, Task, build_task


@dataclass(frozen=True)
class ResumePoint:
    global_step: int
    epoch: int
    step_in_epoch: int
    checkpoint_url: str | None


@dataclass
class SetupInfo:
    rank: int
    world_size: int
    hostname: str
    pid: int
    backend: str
    steps_per_epoch: int
    resume: ResumePoint
    skipped_checkpoints: list[tuple[int, str]]
    timings: dict[str, float]
    node_id: str = ""
    """The Ray node the rank runs on (filled in by the Ray worker group)."""
    allocator: str = "system"
    """``tuned`` where scaling.tune_allocator took effect, else ``system`` or why not."""
    niceness: str = ""
    """The rank's scheduling niceness after scaling.worker_niceness, or why it could not be set."""


@dataclass
class EpochResult:
    rank: int
    epoch: int
    global_step: int
    steps: int
    samples: int
    loss: float
    seconds: float
    first_step_at: float | None
    step_rows: list[dict[str, Any]] = field(default_factory=list)
    commits: list[CommitRecord] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Progress:
    rank: int
    global_step: int
    last_step_at: float
    max_step_time_s: float
    in_epoch: bool


def _step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**63 - 1)


class Worker:
    def __init__(self, cfg: JobConfig, rank: int, world_size: int, run_url: str, attempt: int = 0) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.run_url = run_url
        self.attempt = attempt
        self.global_step = 0
        self.epoch = 0
        self.step_in_epoch = 0
        self._last_step_at = time.time()
        self._max_step_time = 0.0
        self._in_epoch = False
        self._store: dist.TCPStore | None = None
        self._writer: CheckpointWriter | None = None
        self._task: Task | None = None
        self.faults = self._faults()
        threads = max(1, int(cfg.scaling.cpus_per_worker))
        torch.set_num_threads(threads)
        self.allocator = tune_allocator() if cfg.scaling.tune_allocator else "system"
        set_niceness(cfg.scaling.worker_niceness)  # before the process group and task make their threads

    def _faults(self) -> list[FaultSpec]:
        faults = list(self.cfg.failures.inject)
        env = os.environ.get("CLUSTER_INJECT_FAULT")
        if env:
            faults.append(parse_fault_env(env, self.cfg.scaling.num_workers))
        return [f for f in faults if f.rank == self.rank and f.attempt in (-1, self.attempt)]

    # ----------------------------------------------------------------- setup
    def bind_store(self) -> int:
        """Rank 0 only: bind the rendezvous store; return its port (the caller publishes host:port)."""
        self._store, port = cdist.bind_store(self.world_size, self.cfg.failures.process_group_timeout_s)
        return port

    def setup(self, host: str, port: int) -> SetupInfo:
        t = {"start": time.time()}
        cfg = self.cfg
        if os.environ.get(PROBE_ENV):  # set by the driver: prove this node sees the driver's storage
            check_probe(Storage(self.run_url, cfg.storage.options), os.environ[PROBE_ENV])
        self.device = cdist.pick_device(cfg.scaling.use_gpu)
        store = self._store if self.rank == 0 else None
        if store is None:
            store = cdist.connect_store(host, port, self.world_size, cfg.failures.process_group_timeout_s)
        self.backend = cdist.init_process_group(
            store, self.rank, self.world_size, self.device, cfg.failures.process_group_timeout_s
        )
        t["process_group"] = time.time()

        if self._task is None:  # a warm restart keeps the task and its dataset
            self._task = build_task(cfg.task, cfg.task_args)
            self.dataset = self._task.build_train_dataset()
        self.task: Task = self._task
        torch.manual_seed(cfg.training.seed)  # identical init on every rank (DDP also broadcasts rank 0's)
        model = self.task.build_model().to(self.device)
        t["task"] = time.time()

        self.sampler = ResumableDistributedSampler(
            len(self.dataset),
            cfg.training.global_batch_size,
            self.rank,
            self.world_size,
            seed=cfg.training.seed,
            max_steps_per_epoch=cfg.training.max_steps_per_epoch,
        )
        self.raw_model: nn.Module = model
        self.model = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.optimizer = self.task.build_optimizer(self.raw_model)
        total_steps = self.sampler.steps_per_epoch * cfg.training.epochs
        self.scheduler = self.task.build_scheduler(self.optimizer, total_steps)
        t["ddp"] = time.time()

        self.store = CheckpointStore(Storage(self.run_url, cfg.storage.options))
        crash_steps = {f.step for f in self.faults if f.kind == "crash_in_checkpoint"}
        if crash_steps:
            self.store = _CrashingStore(self.store.storage, crash_steps)
        resume, skipped = self._resume()
        t["checkpoint_load"] = time.time()
        if self.rank == 0:
            self._writer = CheckpointWriter(self.store, cfg.checkpoint.keep_last, cfg.checkpoint.async_save)
        dist.barrier()
        t["ready"] = time.time()
        self._last_step_at = time.time()
        return SetupInfo(
            rank=self.rank,
            world_size=self.world_size,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            backend=self.backend,
            steps_per_epoch=self.sampler.steps_per_epoch,
            resume=resume,
            skipped_checkpoints=skipped,
            timings=t,
            allocator=self.allocator,
            niceness=set_niceness(self.cfg.scaling.worker_niceness),  # again: the group made its threads
        )

    def _resume(self) -> tuple[ResumePoint, list[tuple[int, str]]]:
        """Rank 0 picks the newest verified checkpoint; every rank loads that one step."""
        choice: list[Any] = [None, []]
        if self.rank == 0:
            loaded = self.store.load_latest()  # records what it passed over in store.last_skipped
            choice = [loaded.info.step if loaded else None, list(self.store.last_skipped)]
            files = loaded.files if loaded else None
        dist.broadcast_object_list(choice, src=0)
        step, skipped = choice
        if step is None:
            return ResumePoint(0, 0, 0, None), skipped
        if self.rank != 0:
            files = self.store.load_step(step)
        assert files is not None
        self.raw_model.load_state_dict(files["model.pt"])
        state = files["train_state.pt"]
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])
        return ResumePoint(
            self.global_step, self.epoch, self.step_in_epoch, self.store.storage.url()
        ), skipped

    # ----------------------------------------------------------------- training
    def run_epoch(self, epoch: int, start_step: int) -> EpochResult:
        """Train epoch ``epoch`` from step ``start_step`` to its end; checkpoint as configured."""
        try:
            return self._run_epoch(epoch, start_step)
        except WorkerError:
            raise
        except Exception as exc:
            raise WorkerError(
                self.rank, self.global_step + 1, type(exc).__name__, str(exc), traceback.format_exc()
            ) from None
        finally:
            self._in_epoch = False

    def _run_epoch(self, epoch: int, start_step: int) -> EpochResult:
        tcfg = self.cfg.training
        set_niceness(self.cfg.scaling.worker_niceness)  # threads Ray started since (a few syscalls)
        self.sampler.set_epoch(epoch, start_step)
        self.epoch, self.step_in_epoch = epoch, start_step
        self.model.train()
        self._in_epoch = True
        self._last_step_at = time.time()
        rows: list[dict[str, Any]] = []
        loss_sum = torch.zeros((), dtype=torch.float64)
        t_epoch = time.perf_counter()
        first_step_at = None
        steps = samples = 0
        for local_idx in self.sampler:
            self._maybe_inject_fault()
            t0 = time.perf_counter()
            self._seed_step(_step_seed(tcfg.seed, self.global_step, self.rank))
            self.task.current = StepInfo(epoch, self.global_step + 1, self.rank, self.world_size, self.attempt)
            loss = self._train_step(local_idx)
            self.global_step += 1
            self.step_in_epoch += 1
            steps += 1
            samples += tcfg.global_batch_size
            loss_sum += loss
            dt = time.perf_counter() - t0
            now = time.time()
            if first_step_at is None:
                first_step_at = now
            self._max_step_time = max(self._max_step_time, dt)
            self._last_step_at = now
            stall = 0.0
            if self._checkpoint_due_at_step():
                stall = self._checkpoint()
            if self.rank == 0 and (self.global_step % tcfg.log_every_steps == 0 or stall):
                rows.append(self._step_row(loss, dt, stall, now))
        if self._checkpoint_due_at_epoch_end(epoch):
            self._checkpoint()
        # One collective per epoch for the reported loss; nothing per step.
        totals = torch.tensor([float(loss_sum), float(steps)], dtype=torch.float64)
        if self.device.type == "cuda":
            totals = totals.to(self.device)
        dist.all_reduce(totals)
        mean_loss = float(totals[0]) / max(float(totals[1]), 1.0)
        return EpochResult(
            rank=self.rank,
            epoch=epoch,
            global_step=self.global_step,
            steps=steps,
            samples=samples,
            loss=mean_loss,
            seconds=time.perf_counter() - t_epoch,
            first_step_at=first_step_at,
            step_rows=rows,
            commits=self._writer.drain() if self._writer else [],
        )

    def _seed_step(self, seed: int) -> None:
        # The generators this rank uses, directly: torch.manual_seed also walks every backend (~90 us).
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)

    def _train_step(self, local_idx: torch.Tensor) -> torch.Tensor:
        """One optimizer step over this rank's share of the global batch; returns the detached mean loss."""
        tcfg = self.cfg.training
        chunks = [c for c in torch.tensor_split(local_idx, tcfg.grad_accum_steps) if len(c)]
        total = torch.zeros((), dtype=torch.float64)
        for i, chunk in enumerate(chunks):
            batch = self.task.move_to_device(fetch_batch(self.dataset, chunk), self.device)
            sync = i == len(chunks) - 1
            with self.model.no_sync() if not sync else contextlib.nullcontext(), self._autocast():
                loss, _ = self.task.compute_loss(self.model, batch)
                # DDP averages over ranks: scaling by n*W/B makes that average the global-batch mean.
                scale = len(chunk) * self.world_size / tcfg.global_batch_size
                (loss * scale if scale != 1.0 else loss).backward()
            total += loss.detach().double().cpu() * len(chunk)
        if tcfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), tcfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return total / len(local_idx)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.cfg.training.amp == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _step_row(self, loss: torch.Tensor, dt: float, stall: float, now: float) -> dict[str, Any]:
        return {
            "time": now,
            "global_step": self.global_step,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "loss": float(loss),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "step_time_s": dt,
            "samples_per_s": self.cfg.training.global_batch_size / dt if dt > 0 else 0.0,
            "checkpoint_stall_s": stall,
            "world_size": self.world_size,
            "attempt": self.attempt,
        }

    # ----------------------------------------------------------------- checkpoints
    def _checkpoint_due_at_step(self) -> bool:
        every = self.cfg.checkpoint.every_steps
        at_epoch_end = self.step_in_epoch == self.sampler.steps_per_epoch
        return bool(every) and self.global_step % every == 0 and not at_epoch_end

    def _checkpoint_due_at_epoch_end(self, epoch: int) -> bool:
        every = self.cfg.checkpoint.every_epochs
        last = epoch + 1 == self.cfg.training.epochs
        by_steps = (
            bool(self.cfg.checkpoint.every_steps) and self.global_step % self.cfg.checkpoint.every_steps == 0
        )
        return last or by_steps or (bool(every) and (epoch + 1) % every == 0)

    def _checkpoint(self) -> float:
        """Rank 0 hands state to the writer (a host copy; the upload runs in the background)."""
        if self.rank != 0 or self._writer is None:
            return 0.0
        at_end = self.step_in_epoch == self.sampler.steps_per_epoch
        epoch, step_in_epoch = (self.epoch + 1, 0) if at_end else (self.epoch, self.step_in_epoch)
        train_state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "global_step": self.global_step,
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "sample_offset": step_in_epoch * self.cfg.training.global_batch_size,
            "world_size": self.world_size,
            "seed": self.cfg.training.seed,
            "rng": {"torch": torch.get_rng_state()},
        }
        meta = {"world_size": self.world_size, "step_in_epoch": step_in_epoch, "attempt": self.attempt}
        stall = self._writer.save(
            self.global_step,
            epoch,
            meta,
            {"model.pt": self.raw_model.state_dict(), "train_state.pt": train_state},
        )
        self._last_step_at = time.time()
        return stall

    # ----------------------------------------------------------------- faults, progress, teardown
    def _maybe_inject_fault(self) -> None:
        next_step = self.global_step + 1
        for fault in self.faults:
            if fault.step != next_step or fault.kind == "crash_in_checkpoint":
                continue
            if fault.kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "hang":
                while True:
                    time.sleep(3600)
            elif fault.kind == "raise":
                raise RuntimeError(f"injected fault on rank {self.rank} at step {next_step}")

    def progress(self) -> Progress:
        return Progress(self.rank, self.global_step, self._last_step_at, self._max_step_time, self._in_epoch)

    def finish(self) -> list[CommitRecord]:
        """Flush the checkpoint in flight; return the commit records not yet reported."""
        if self._writer is None:
            return []
        self._writer.close(flush=True)
        return self._writer.drain()

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close(flush=False)
        cdist.destroy_process_group()

    def prepare(self) -> float:
        """Hot spare: load the task and dataset and pay DDP's one-time import now, not in a recovery."""
        t0 = time.time()
        if self._task is None:
            self._task = build_task(self.cfg.task, self.cfg.task_args)
            self.dataset = self._task.build_train_dataset()
        import torch._dynamo  # noqa: F401  (DistributedDataParallel.__init__ imports it: ~1 s once)

        return time.time() - t0

    def reset(self, rank: int, world_size: int, attempt: int) -> None:
        """Warm restart: drop the process group and all training state, keep the task and its dataset.

        Only valid once ``run_epoch`` has returned (a worker blocked in a collective must be killed)."""
        self.shutdown()
        self._writer = None
        self._store = None
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self.global_step = self.epoch = self.step_in_epoch = 0
        self._max_step_time = 0.0
        self._last_step_at = time.time()
        self.faults = self._faults()
        for attr in ("model", "raw_model", "optimizer", "scheduler", "sampler"):
            self.__dict__.pop(attr, None)


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


def set_niceness(value: int | None) -> str:
    """Give every thread of this process niceness ``value`` (scaling.worker_niceness); returns the outcome.

    Ray starts worker processes at niceness 15 (``RAY_worker_niceness``), so its raylet, GCS, agents and any
    other process on the node preempt a training rank whenever they wake, and the other ranks wait for it at
    the next all-reduce. Linux keeps niceness per thread and a new thread inherits its creator's, so all of
    ``/proc/self/task`` is set (again after the process group made its threads). Lowering niceness needs
    CAP_SYS_NICE; without it the ranks stay where Ray put them and the result says what to set.
    """
    if value is None:
        return "ray's"
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]  # no /proc (macOS): the whole process
    denied = False
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != value:
                os.setpriority(os.PRIO_PROCESS, tid, value)
        except PermissionError:
            denied = True
        except OSError:
            continue  # the thread exited meanwhile
    now = os.getpriority(os.PRIO_PROCESS, 0)
    if denied:
        return (f"{now} (not permitted to set scaling.worker_niceness={value}: start Ray with "
                f"RAY_worker_niceness={value}, or give the workers CAP_SYS_NICE)")
    return str(now)


# glibc ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
ALLOCATOR_SETTINGS = ((_M_MMAP_THRESHOLD, 256 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))


def tune_allocator() -> str:
    """Stop glibc's malloc from handing freed memory back to the kernel between steps.

    By default glibc serves large blocks (above a threshold that adapts up to 32 MiB) with fresh ``mmap``s and
    trims the heap's top as soon as 128 KiB of it is free. A training step allocates and frees the same
    activations and gradients every time, so each step faults them back in: about a thousand minor page
    faults per step on the benchmark's small model, 5-10% of a CPU step. With a 256 MiB mmap threshold and a
    1 GiB trim threshold the memory freed at the end of a step is reused by the next one (no faults); the
    process keeps its peak heap instead of shrinking between steps. Process-wide and permanent, so it is
    only ever called in a worker process. Returns ``tuned``, or why it was not.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "system (no mallopt: not glibc)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    failed = [param for param, value in ALLOCATOR_SETTINGS if mallopt(param, value) != 1]
    return "tuned" if not failed else f"system (mallopt refused {failed})"


@contextlib.contextmanager
def worker_env(cfg: JobConfig) -> Iterator[None]:
    """Environment a worker process needs before torch starts threads or sockets."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, int(cfg.scaling.cpus_per_worker))))
    os.environ.update(cfg.scaling.env)
    if cfg.scaling.socket_ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = cfg.scaling.socket_ifname
        os.environ["NCCL_SOCKET_IFNAME"] = cfg.scaling.socket_ifname
    yield
