"""The coordinator: an explicit state machine that starts the group, drives epochs, watches heartbeats,
decides on failures through a small policy object, and resumes from the latest verified checkpoint.

It never sits on a training step's path: workers train a whole epoch autonomously; the driver waits on the
epoch's result and reads a heartbeat (global step, time of the last step): once a second while a live bar
is drawn in a terminal, otherwise every twentieth of the hang timeout (3 s by default), because each
heartbeat is a call into every worker while it trains.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TextIO

import torch

from cluster import local_ray
from cluster.checkpoint import CheckpointStore
from cluster.config import FailureConfig, JobConfig
from cluster.errors import ConfigError, Failure, ResourcesUnavailableError, StorageError, TrainingFailedError
from cluster.metrics import EventLog, Progress, write_metrics
from cluster.storage import PROBE_ENV, Storage, join, normalize_url, write_probe
from cluster.worker import EpochResult, SetupInfo

__version__ = "0.1.0"


class State(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (State.FINISHED, State.FAILED)


class WorkerGroup(Protocol):
    """What the driver needs from a gang of workers (the seam the driver's unit tests replace)."""

    world_size: int
    spare_note: str  # the hot spare's state after start(): "off", "off: <why>", "preparing"

    def reserve(self, sizes: list[int], wait_s: float) -> int: ...
    def start(self, world_size: int) -> list[SetupInfo]: ...
    def run_epoch(self, epoch: int, start_step: int) -> None: ...
    def poll(self, timeout: float) -> list[EpochResult] | None: ...
    def progress(self, timeout: float = 2.0) -> list[Any]: ...
    def finish(self) -> list[Any]: ...
    def spare_ready(self) -> float | None: ...
    def classify(self, exc: BaseException) -> Failure: ...
    def available_for(self, n: int) -> bool: ...
    def salvage(self, failure: Failure, attempt: int) -> Any: ...
    def adopt(self, token: Any) -> None: ...
    def shutdown(self, graceful: bool) -> None: ...


GroupFactory = Callable[[JobConfig, str, int], WorkerGroup]


@dataclass(frozen=True)
class Decision:
    restart: bool
    reason: str
    delay_s: float = 0.0


class FailurePolicy:
    """Restart with exponential backoff until ``max_failures``; the same user error at the same step
    twice is a bug, not bad luck, and fails at once."""

    def __init__(self, cfg: FailureConfig) -> None:
        self.cfg = cfg

    def decide(self, failure: Failure, history: list[Failure], streak: int | None = None) -> Decision:
        """``history`` holds every failure so far, this one last; ``streak`` counts the failures since
        training last completed an epoch (default: all of them)."""
        count = len(history)
        if failure.kind == "user_error" and failure.error is not None:
            for prev in history[:-1]:
                if prev.error is not None and prev.error.signature == failure.error.signature:
                    return Decision(
                        False,
                        f"the same {failure.error.exc_type} happened twice at step {failure.error.step}: "
                        "a bug in the task, not a transient failure",
                    )
        if self.cfg.max_failures != -1 and count > self.cfg.max_failures:
            return Decision(
                False,
                f"failures.max_failures={self.cfg.max_failures} exhausted ({count} failures); "
                "raise it (or -1 for unlimited) to keep retrying",
            )
        # The first restart after progress is immediate (like torchrun); repeated failures back off.
        streak = count if streak is None else streak
        delay = 0.0 if streak <= 1 else min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2 ** (streak - 2))
        return Decision(True, f"restart {count}/{self._budget()}", delay)

    def _budget(self) -> str:
        return "unlimited" if self.cfg.max_failures == -1 else str(self.cfg.max_failures)


@dataclass
class Result:
    """What a finished (or failed) run returns."""

    name: str
    run_url: str
    status: str
    epochs_completed: int
    global_step: int
    metrics: dict[str, Any]
    latest_checkpoint: str | None
    attempts: int
    failures: list[dict[str, Any]] = field(default_factory=list)
    world_size: int = 0
    error: str | None = None


class Driver:
    def __init__(
        self,
        cfg: JobConfig,
        group_factory: GroupFactory | None = None,
        policy: FailurePolicy | None = None,
        out: TextIO | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.cfg = cfg
        self.group_factory = group_factory or _ray_group_factory
        self.policy = policy or FailurePolicy(cfg.failures)
        self.out = out or sys.stdout
        self.poll_s = poll_s
        self._dispatched_at: float | None = None  # the next epoch was already started by _epoch_done
        self.state = State.STARTING
        self.storage = Storage(join(normalize_url(cfg.storage.url), cfg.name), cfg.storage.options)
        self.run_url = self.storage.root
        self.attempt = 0
        self.epoch = 0
        self.start_step = 0
        self.global_step = 0
        self.steps_per_epoch = 0
        self.world_size = 0
        self.group: WorkerGroup | None = None
        self.failures: list[Failure] = []
        self.last_metrics: dict[str, Any] = {}
        self.error: BaseException | None = None
        self._recovery: dict[str, Any] | None = None
        self._progress: Progress | None = None
        self._probe_token: str | None = None
        self._streak = 0  # failures since the last completed epoch
        self._salvage: Any = None
        self._spare_announced = False  # the current group's hot spare was reported ready

    # ------------------------------------------------------------------ public
    def run(self) -> Result:
        self._prepare_storage()
        self.events.append("run_start", attempt=self.attempt, config=self.cfg.to_dict())
        try:
            while not self.state.is_terminal:
                self._step()
        finally:
            if self.group is not None:
                self.group.shutdown(graceful=self.state is State.FINISHED)
                self.group = None
        result = self._result()
        if self.state is State.FAILED and self.error is not None:
            raise self.error
        return result

    def _step(self) -> None:
        if self.state is State.STARTING:
            self._start()
        elif self.state is State.RUNNING:
            self._run_epoch()
        elif self.state is State.RECOVERING:
            self._recover()

    # ------------------------------------------------------------------ storage
    def _prepare_storage(self) -> None:
        self.events = EventLog(self.storage)
        try:
            previous = json.loads(self.storage.read_bytes("run.json"))
        except FileNotFoundError:
            previous = None
        if previous is not None:
            _check_compatible(previous.get("config", {}), self.cfg)
        else:
            info = {
                "name": self.cfg.name,
                "created": time.time(),
                "config": self.cfg.to_dict(),
                "versions": {
                    "cluster": __version__,
                    "torch": torch.__version__,
                    "ray": _ray_version(),
                    "python": platform.python_version(),
                },
            }
            self.storage.write_atomic("run.json", json.dumps(info, indent=1, default=str).encode())

    # ------------------------------------------------------------------ states
    def _already_complete(self) -> bool:
        """True when the newest checkpoint verifies and covers every epoch: no workers are needed."""
        store = CheckpointStore(self.storage)
        infos = store.list()
        if not infos or infos[-1].epoch < self.cfg.training.epochs:
            return False
        try:
            store.read_verified(infos[-1])
        except Exception:
            return False  # let the workers' resume path skip it and report why
        self.global_step, self.epoch = infos[-1].step, infos[-1].epoch
        return True

    def _start(self) -> None:
        cfg = self.cfg
        target, minimum = cfg.scaling.num_workers, cfg.effective_min_workers
        t0 = time.time()
        if self.attempt == 0 and self._already_complete():
            self._print(
                f"[{cfg.name}] all {cfg.training.epochs} epochs are already done (checkpoint at step "
                f"{self.global_step}); nothing to train"
            )
            self.events.append("already_complete", global_step=self.global_step)
            self.state = State.FINISHED
            return
        # Every worker checks it sees this token (Worker.setup): storage visible only here fails at once.
        # One token per driver: workers kept across a warm restart already carry it.
        if self._probe_token is None:
            self._probe_token = write_probe(self.storage)
        probe_env = {**cfg.scaling.env, PROBE_ENV: self._probe_token}
        group_cfg = dataclasses.replace(cfg, scaling=dataclasses.replace(cfg.scaling, env=probe_env))
        self.group = self.group_factory(group_cfg, self.run_url, self.attempt)
        if self._salvage is not None:
            self.group.adopt(self._salvage)
            self._salvage = None
        sizes = list(range(target, minimum - 1, -1))
        try:
            n = self.group.reserve(sizes, cfg.scaling.resource_wait_s)
        except ResourcesUnavailableError as exc:
            self.events.append("failed", reason=str(exc))
            self._fail(exc)
            return
        t_reserved = time.time()
        if n < target:
            self.events.append(
                "resize",
                old=self.world_size or target,
                new=n,
                reason="resources for "
                f"{target} workers not available within {cfg.scaling.resource_wait_s:g}s",
            )
            self._print(f"continuing with {n}/{target} workers (scaling.min_workers={minimum})")
        try:
            infos = self.group.start(n)
        except (ConfigError, StorageError):
            # e.g. workers import other code than the driver, or cannot see its storage (after the retry
            # budget): retrying cannot help
            raise
        except Exception as exc:
            self._on_failure(
                self.group.classify(exc)
                if _is_remote_error(exc)
                else Failure("start_failed", None, f"{type(exc).__name__}: {exc}")
            )
            return
        t_ready = time.time()
        self.world_size = n
        head = infos[0]
        for step, reason in head.skipped_checkpoints:
            self.events.append("checkpoint_skipped", step=step, reason=reason)
            self._print(f"skipped checkpoint step {step}: {reason}")
        self.steps_per_epoch = head.steps_per_epoch
        r = head.resume
        self.epoch, self.start_step, self.global_step = r.epoch, r.step_in_epoch, r.global_step
        total = self.steps_per_epoch * cfg.training.epochs
        self._progress = Progress(total, self.out)
        self.events.append(
            "group_started",
            attempt=self.attempt,
            world_size=n,
            backend=head.backend,
            resume_step=r.global_step,
            resume_epoch=r.epoch,
            pids=[i.pid for i in infos],
            nodes=[i.node_id for i in infos],
            hosts=sorted({i.hostname for i in infos}),
            seconds=round(t_ready - t0, 3),
            setup_s=_phase_max(infos),
            hot_spare=self.group.spare_note,
            allocator=sorted({i.allocator for i in infos}),
            niceness=(niceness := sorted({i.niceness for i in infos})),
        )
        for note in niceness:
            if "not permitted" in note:
                self._print(f"[{cfg.name}] warning: workers run at niceness {note}")
        self._spare_announced = False
        if self._recovery is not None:
            self._recovery.update(
                reserve_s=t_reserved - self._recovery["t_teardown"],
                start_s=t_ready - t_reserved,
                resume_step=r.global_step,
                load_s=max(i.timings["checkpoint_load"] - i.timings["task"] for i in infos),
                actors_s=max(i.timings["start"] for i in infos) - t_reserved,
                rendezvous_s=max(i.timings["process_group"] - i.timings["start"] for i in infos),
                task_s=max(i.timings["task"] - i.timings["process_group"] for i in infos),
                t_ready=t_ready,
            )
        where = (
            f"from step {r.global_step} (epoch {r.epoch + 1}, step {r.step_in_epoch})"
            if r.global_step
            else "fresh"
        )
        self._print(
            f"[{cfg.name}] attempt {self.attempt}: {n} workers ({head.backend}) ready in "
            f"{t_ready - t0:.1f}s, starting {where}"
        )
        if self.epoch >= cfg.training.epochs:
            self._print(f"[{cfg.name}] all {cfg.training.epochs} epochs are already done; nothing to train")
            self.events.append("already_complete", global_step=self.global_step)
            self.state = State.FINISHED
            return
        self.state = State.RUNNING

    def _run_epoch(self) -> None:
        assert self.group is not None and self._progress is not None
        cfg = self.cfg
        group = self.group
        if self._dispatched_at is None:
            group.run_epoch(self.epoch, self.start_step)
        t_epoch, self._dispatched_at = self._dispatched_at or time.time(), None
        watch = _Heartbeat(cfg.failures, self.global_step)
        while True:
            try:
                results = group.poll(self._heartbeat_every(watch))
            except Exception as exc:
                failure = group.classify(exc)
                watch.update(group.progress(timeout=0.5))  # survivors know how far training got
                self._on_failure(failure, watch.max_step)
                return
            if results is not None:
                break
            beats = group.progress()
            hung = watch.update(beats)
            self._announce_spare()
            self._progress.live(watch.max_step, cfg.training.global_batch_size)
            if hung is not None:
                self._on_failure(Failure("hang", hung[0], hung[1]), watch.max_step)
                return
        self._epoch_done(results, time.time() - t_epoch)

    def _announce_spare(self) -> None:
        """One ``spare_ready`` event per group, once its hot spare is prepared: from then on a dead rank is
        replaced without starting a process. Checked at each heartbeat and each epoch end."""
        if self._spare_announced or self.group is None:
            return
        prepare_s = self.group.spare_ready()
        if prepare_s is not None:
            self._spare_announced = True
            self.events.append("spare_ready", attempt=self.attempt, prepare_s=round(prepare_s, 3))

    def _heartbeat_every(self, watch: _Heartbeat) -> float:
        """Seconds between heartbeats: ``poll_s`` for a terminal's live bar, else a twentieth of the hang
        timeout within [poll_s, 5 * poll_s]. A death is seen at once either way (the epoch's result fails)."""
        assert self._progress is not None
        if self._progress.tty:
            return self.poll_s
        return min(max(self.poll_s, watch.timeout() / 20), 5 * self.poll_s)

    def _epoch_done(self, results: list[EpochResult], wall_s: float) -> None:
        assert self._progress is not None and self.group is not None
        cfg = self.cfg
        head = results[0]
        self.global_step = head.global_step
        next_epoch = head.epoch + 1
        finished = next_epoch >= cfg.training.epochs
        grow = (
            not finished
            and self.world_size < cfg.scaling.num_workers
            and self.group.available_for(cfg.scaling.num_workers - self.world_size)
        )
        if not finished and not grow:
            # The workers start the next epoch now; this epoch's metrics, events and progress line are
            # written while they train, not in a gap between epochs.
            self.group.run_epoch(next_epoch, 0)
            self._dispatched_at = time.time()
        self._announce_spare()
        samples_per_s = head.samples / wall_s if wall_s > 0 else 0.0
        epoch_row = {
            "kind": "epoch",
            "time": time.time(),
            "global_step": head.global_step,
            "epoch": head.epoch,
            "step_in_epoch": self.steps_per_epoch,
            "loss": head.loss,
            "step_time_s": head.seconds / max(1, head.steps),
            "samples_per_s": samples_per_s,
            "checkpoint_stall_s": sum(c.stall_s for c in head.commits),
            "world_size": self.world_size,
            "attempt": self.attempt,
            "lr": head.step_rows[-1]["lr"] if head.step_rows else None,
        }
        rows = [{"kind": "step", **r} for r in head.step_rows] + [epoch_row]
        write_metrics(self.storage, rows, head.epoch, self.attempt)
        for c in head.commits:
            self._commit_event(c)
        if self._recovery is not None:
            self._finish_recovery(head)
        self.events.append(
            "epoch_end",
            epoch=head.epoch,
            global_step=head.global_step,
            loss=head.loss,
            seconds=round(wall_s, 3),
            samples_per_s=round(samples_per_s, 1),
            world_size=self.world_size,
        )
        self.last_metrics = {
            "epoch": head.epoch,
            "loss": head.loss,
            "samples_per_s": samples_per_s,
            "global_step": head.global_step,
            "epoch_seconds": wall_s,
        }
        remaining_steps = (cfg.training.epochs - head.epoch - 1) * self.steps_per_epoch
        eta = remaining_steps * (wall_s / max(1, head.steps))
        self._progress.epoch_line(
            head.epoch, cfg.training.epochs, head.global_step, head.loss, samples_per_s, eta
        )
        self.epoch, self.start_step = next_epoch, 0
        self._streak = 0
        if finished:
            for c in self.group.finish():
                self._commit_event(c)
            self.events.append(
                "finished", global_step=self.global_step, loss=head.loss, attempts=self.attempt + 1
            )
            self._print(
                f"[{cfg.name}] finished: {self.global_step} steps, loss {head.loss:.4f}, "
                f"checkpoints in {self.run_url}/checkpoints"
            )
            self.state = State.FINISHED
            return
        if grow:
            # Grow back at this epoch boundary: the epoch-end checkpoint is flushed, then a new gang starts.
            for c in self.group.finish():
                self._commit_event(c)
            self.events.append(
                "resize",
                old=self.world_size,
                new=cfg.scaling.num_workers,
                reason="resources returned",
                at_step=self.global_step,
            )
            self._print(f"resources returned: growing {self.world_size} -> {cfg.scaling.num_workers} workers")
            self.group.shutdown(graceful=True)
            self.group = None
            self.attempt += 1
            self.state = State.STARTING

    def _commit_event(self, c: Any) -> None:
        if c.error:
            self.events.append("checkpoint_failed", step=c.step, error=c.error)
            self._print(f"checkpoint at step {c.step} FAILED (not used): {c.error}")
        else:
            self.events.append(
                "checkpoint",
                step=c.step,
                epoch=c.epoch,
                url=c.url,
                bytes=c.bytes,
                stall_s=round(c.stall_s, 4),
                write_s=round(c.write_s, 3),
            )

    def _on_failure(self, failure: Failure, seen_step: int | None = None) -> None:
        now = time.time()
        self._dispatched_at = None
        self.failures.append(failure)
        self._streak += 1
        self._recovery = {"t_detect": now, "kind": failure.kind, "seen_step": seen_step or self.global_step}
        self.events.append(
            "failure",
            kind=failure.kind,
            rank=failure.rank,
            attempt=self.attempt,
            message=failure.message[-4000:],
            step=seen_step,
        )
        self._print(f"FAILURE ({failure.kind}, rank {failure.rank}): {failure.message.splitlines()[0][:300]}")
        self.state = State.RECOVERING

    def _recover(self) -> None:
        assert self._recovery is not None
        failure = self.failures[-1]
        decision = self.policy.decide(failure, self.failures, self._streak)
        if self.group is not None:
            # Workers still in a collective are killed at once (never wait for the process-group
            # timeout); idle healthy ones may be kept for a warm restart.
            token = self.group.salvage(failure, self.attempt + 1) if decision.restart else None
            if token is None:
                self.group.shutdown(graceful=False)
            self._salvage = token
            self._recovery["reused"] = len(token["actors"]) if isinstance(token, dict) else 0
            self.group = None
        self._recovery["t_teardown"] = time.time()
        self.events.append(
            "decision", restart=decision.restart, reason=decision.reason, delay_s=decision.delay_s
        )
        if not decision.restart:
            detail = failure.error.traceback if failure.error is not None else failure.message
            self._fail(
                TrainingFailedError(
                    f"{decision.reason}. Last failure ({failure.kind}, rank "
                    f"{failure.rank}):\n{detail}\nCheckpoints are intact in "
                    f"{self.run_url}/checkpoints; rerun the same job to resume."
                )
            )
            return
        self._print(f"recovering ({decision.reason}) in {decision.delay_s:.1f}s")
        time.sleep(decision.delay_s)
        self.attempt += 1
        self.state = State.STARTING

    def _finish_recovery(self, head: EpochResult) -> None:
        rec = self._recovery
        assert rec is not None
        self._recovery = None
        if head.first_step_at is None:
            return
        phases = {
            "detect_to_teardown_s": rec["t_teardown"] - rec["t_detect"],
            "reserve_s": rec.get("reserve_s", 0.0),
            "start_and_load_s": rec.get("start_s", 0.0),
            "actors_s": rec.get("actors_s", 0.0),
            "rendezvous_s": rec.get("rendezvous_s", 0.0),
            "task_s": rec.get("task_s", 0.0),
            "checkpoint_load_s": rec.get("load_s", 0.0),
            "first_step_s": head.first_step_at - rec.get("t_ready", head.first_step_at),
            "detect_to_first_step_s": head.first_step_at - rec["t_detect"],
        }
        lost = max(0, rec["seen_step"] - rec.get("resume_step", 0))
        self.events.append(
            "recovered",
            kind=rec["kind"],
            lost_steps=lost,
            reused_workers=rec.get("reused", 0),
            **{k: round(v, 3) for k, v in phases.items()},
        )
        self._print(
            f"recovered from {rec['kind']}: first step {phases['detect_to_first_step_s']:.1f}s after "
            f"detection, {lost} steps of work lost"
        )

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self.state = State.FAILED
        self.events.append("run_failed", error=str(exc)[:4000])

    def _print(self, text: str) -> None:
        if self._progress is not None:
            self._progress.line(text)
        else:
            self.out.write(text + "\n")
            self.out.flush()

    def _result(self) -> Result:
        infos = CheckpointStore(self.storage).list()
        return Result(
            name=self.cfg.name,
            run_url=self.run_url,
            status=self.state.value,
            epochs_completed=self.epoch,
            global_step=self.global_step,
            metrics=self.last_metrics,
            latest_checkpoint=infos[-1].url if infos else None,
            attempts=self.attempt + 1,
            failures=[{"kind": f.kind, "rank": f.rank, "message": f.message[:2000]} for f in self.failures],
            world_size=self.world_size,
            error=str(self.error) if self.error else None,
        )


class _Heartbeat:
    """Tracks each rank's step; a rank whose step stops advancing past the hang timeout is hung."""

    def __init__(self, cfg: FailureConfig, start_step: int) -> None:
        self.cfg = cfg
        self.max_step = start_step
        self.max_step_time = 0.0
        self._last: dict[int, tuple[int, float]] = {}
        self._t0 = time.monotonic()

    def timeout(self) -> float:
        if self.cfg.hang_timeout_s is not None:
            return self.cfg.hang_timeout_s
        return max(self.cfg.hang_timeout_floor_s, 10 * self.max_step_time)

    def update(self, beats: list[Any]) -> tuple[int, str] | None:
        now = time.monotonic()
        for rank, beat in enumerate(beats):
            if beat is None:
                continue
            self.max_step = max(self.max_step, beat.global_step)
            self.max_step_time = max(self.max_step_time, beat.max_step_time_s)
            prev = self._last.get(rank)
            if prev is None or beat.global_step != prev[0] or not beat.in_epoch:
                self._last[rank] = (beat.global_step, now)
        limit = self.timeout()
        stalled = [(now - t, rank) for rank, (_, t) in self._last.items()]
        silent = [r for r in range(len(beats)) if r not in self._last]
        if silent and now - self._t0 > limit:
            return silent[0], f"rank {silent[0]} never answered its heartbeat within {limit:.0f}s"
        if stalled:
            age, _rank = max(stalled)
            if age > limit:
                lowest = min(self._last.items(), key=lambda kv: kv[1][0])[0]
                return lowest, (
                    f"no progress for {age:.0f}s (hang timeout {limit:.0f}s); ranks stuck at step "
                    f"{ {r: s for r, (s, _) in sorted(self._last.items())} }, lowest rank {lowest}"
                )
        return None


def _phase_max(infos: list[SetupInfo]) -> dict[str, float]:
    """Slowest rank's seconds per setup phase (each phase ends at the named timestamp)."""
    out: dict[str, float] = {}
    for info in infos:
        marks = list(info.timings.items())
        for (_, t0), (name, t1) in itertools.pairwise(marks):
            out[name] = max(out.get(name, 0.0), round(t1 - t0, 3))
    return out


def _is_remote_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("ray")


def _check_compatible(previous: dict[str, Any], cfg: JobConfig) -> None:
    """Refuse to resume a run with a config that would change what its checkpoints mean."""
    now = cfg.to_dict()
    for section, key in (("", "task"), ("training", "global_batch_size"), ("training", "seed")):
        old = previous.get(section, {}).get(key) if section else previous.get(key)
        new = now[section][key] if section else now[key]
        if old is not None and old != new:
            name = f"{section}.{key}" if section else key
            raise ConfigError(
                f"{name}={new!r} differs from {old!r} in the existing run {cfg.name!r}; resuming would mix two "
                f"different trainings. Keep {name}={old!r}, or choose a new name (--set name=...)"
            )


def _ray_version() -> str:
    try:
        import ray

        return str(ray.__version__)
    except ImportError:  # pragma: no cover
        return "missing"


def _ray_group_factory(cfg: JobConfig, run_url: str, attempt: int) -> WorkerGroup:
    from cluster.worker_group import RayWorkerGroup

    return RayWorkerGroup(cfg, run_url, attempt)


def ensure_ray(cfg: JobConfig) -> bool:
    """Connect to the Ray in ``RAY_ADDRESS`` (set inside ``ray job submit``) or start an embedded one.

    Returns True when this call started Ray (the caller shuts it down).
    """
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return True
    s = cfg.scaling
    local_ray.start(max(os.cpu_count() or 1, int(s.num_workers * s.cpus_per_worker + 0.999)))
    return True


def check_cluster(cfg: JobConfig) -> None:
    """Fail before anything starts when the cluster can never run this job."""
    import ray

    total = ray.cluster_resources()
    if cfg.scaling.use_gpu and total.get("GPU", 0) < 1:
        raise ConfigError(
            "scaling.use_gpu=true but the Ray cluster has no GPUs; set scaling.use_gpu=false to train on CPUs, "
            "or connect to a cluster with GPU nodes (RAY_ADDRESS)"
        )


def train(cfg: JobConfig, out: TextIO | None = None) -> Result:
    """Run (or resume) the job described by ``cfg`` to completion and return its Result.

    Uses the Ray cluster in ``RAY_ADDRESS`` or an already initialised one; otherwise starts an embedded
    local Ray and shuts it down afterwards.
    """
    from cluster.task import load_task_class

    load_task_class(cfg.task)  # an unknown task is a config error, found before anything starts
    started = ensure_ray(cfg)
    try:
        check_cluster(cfg)
        return Driver(cfg, out=out).run()
    finally:
        if started:
            local_ray.shutdown()


def result_to_json(result: Result) -> str:
    return json.dumps(asdict(result), indent=1, default=str)
