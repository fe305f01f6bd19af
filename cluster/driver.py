"""The coordinator: an explicit state machine that starts the group, drives epochs, watches heartbeats,
decides on failures through a small policy object, and resumes from the latest verified checkpoint.

States carry their data and ``Driver._step`` returns the next one; ``Driver._transition`` is the only place
the state changes::

    Starting --> Running --(epoch done)--> Running | Resizing --> Starting | Finishing --> Finished
        |           |
        |           +--(a stop asked for: a checkpoint at the next step)--> Stopped
        +-----------+--(failure)--> Recovering --> Starting | Failed

Whether a run is already complete is decided once, before any worker starts (``_initial_state``).

It never sits on a training step's path: workers train a whole epoch autonomously; the driver waits on the
epoch's result and reads a heartbeat (global step, time of the last step): once a second while a live bar
is drawn in a terminal, otherwise every twentieth of the hang timeout (3 s by default), because each
heartbeat is a call into every worker while it trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import platform
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch

from cluster import local_ray
from cluster import stacks as stack_dump
from cluster.checkpoint import CheckpointInfo, CheckpointStore, CommitRecord, step_dir
from cluster.config import JobConfig, Window, merge_windows, resolve_notify_url, skip_windows
from cluster.control import (
    ANSWERED,
    PROFILE_FILE,
    STACKS_FILE,
    STOP_FILE,
    STOP_POLL_S,
    DriverBeat,
    StopRequest,
    clear_stop_request,
    pending,
    read_request,
    read_stop_request,
    take_request,
)
from cluster.errors import (
    CheckpointError,
    ConfigError,
    Failure,
    ResourcesUnavailableError,
    StorageError,
    TrainingFailedError,
)
from cluster.evaluate import eval_due
from cluster.group import EpochResult, GroupFactory, Salvage, SetupInfo, StartCancelled, WorkerGroup
from cluster.metrics import EventLog, ProgressDisplay, write_metrics
from cluster.peer import PeerPlan, plan_recovery
from cluster.policy import Decision, FailurePolicy, HangWatch, SlowRank, SlowRankWatch
from cluster.preemption import DrainNotice, Move
from cluster.profiling import MAX_STEPS as MAX_PROFILE_STEPS
from cluster.states import (
    Failed,
    Finished,
    Finishing,
    Moving,
    Recovering,
    RecoveryTiming,
    Resizing,
    Running,
    Starting,
    State,
    Stopped,
)
from cluster.storage import PROBE_ENV, Storage, join, normalize_url, write_probe
from cluster.task import Task, task_path
from cluster.tracking import MlflowSink, Sink, TensorBoardSink, Tracker, WebhookSink

__all__ = [
    "Decision",
    "Driver",
    "Failed",
    "FailurePolicy",
    "Finished",
    "Finishing",
    "HangWatch",
    "Recovering",
    "Resizing",
    "Result",
    "Running",
    "Starting",
    "State",
    "Stopped",
    "check_cluster",
    "ensure_ray",
    "result_to_json",
    "train",
]

__version__ = "0.1.0"

logger = logging.getLogger(__name__)


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
    slow_ranks: list[dict[str, Any]] = field(default_factory=list)
    """Each ``slow_rank`` event of this submission: a rank that held the others up (docs/failures.md)."""
    evaluation: dict[str, Any] | None = None
    """The latest evaluation of this submission (``global_step``, ``epoch``, ``loss`` and the task's eval
    metrics); None when the task has no eval set or none ran."""
    stopped_early: bool = False
    """Early stopping (``evaluation.patience``) ended the run before its last epoch."""
    stop_reason: str | None = None
    """With status ``stopped``: who asked (``SIGINT``, ``SIGTERM``, ``python -m cluster stop by ...``). The
    ranks stopped at ``global_step`` with a checkpoint there; resubmitting the same job resumes from it."""
    skipped_steps: list[tuple[int, int]] = field(default_factory=list)
    """The run's skip windows (first and last step, inclusive): ``training.skip_steps`` and each NaN
    rollback's (``failures.nan_skip_steps``). Their batches were not trained."""


# ---------------------------------------------------------------------------------------------- driver
class Driver:
    """Runs one job to its end. ``run`` loops ``state = self._step(state)`` until a terminal state; every
    transition goes through ``_transition``. What outlives a state (the run's history: attempts, failures,
    the position reached, the live worker group) is on the driver."""

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
        self.state: State = Starting()
        self.storage = Storage(join(normalize_url(cfg.storage.url), cfg.name), cfg.storage.options)
        self.run_url = self.storage.root
        self.attempt = 0
        self.epoch = 0
        self.global_step = 0
        self.steps_per_epoch = 0
        self.world_size = 0
        self.group: WorkerGroup | None = None
        self.failures: list[Failure] = []
        self.last_metrics: dict[str, Any] = {}
        self._display: ProgressDisplay | None = None
        self._probe_token: str | None = None
        self._streak = 0  # failures since the last completed epoch
        self._spare_announced = False  # the current group's hot spare was reported ready
        self._rows: list[dict[str, Any]] = []  # rank 0's step rows streamed by heartbeats, not yet written
        self.tracker: Tracker | None = None
        self._move: Move | None = None  # a drain notice being acted on
        self._drained: set[str] = set()  # nodes whose notice was acted on (never twice)
        self._next_drain_check = 0.0
        self._drain_error_logged = False
        self._grow_at: int | None = None  # the step a growing group stops at
        self._next_grow_check = 0.0
        self._slow: SlowRankWatch | None = None  # the current group's, when failures.slow_rank_ratio is set
        self._rank_hosts: list[str] = []  # the current group's, by rank
        self._rank_nodes: list[str] = []  # the current group's Ray node ids, by rank
        self._slow_nodes: set[str] = set()  # nodes a slow rank was moved off: no replacement goes there
        self._slow_reports: list[dict[str, Any]] = []
        self._evaluated: set[int] = set()  # global steps whose evaluation was recorded (any submission)
        self.last_eval: dict[str, Any] | None = None
        self.stopped_early = False
        self._stop_request: StopRequest | None = None  # set by request_stop (a signal) or the stop file
        self._stop_step: int | None = None  # the step the group was asked to stop at, for it
        self._next_stop_check = 0.0
        self._next_wait_check = 0.0  # _stop_asked's, while no group trains
        self._seen_step = 0  # the furthest step a heartbeat reported
        self._live_step, self._live_evals = -1, 0  # the live bar's: step, and eval batches done then
        self._eval_total = 0  # batches of one evaluation (the live bar's total)
        self._started_at = time.time()
        # The stop file is read without retries: an outage must never stall the loop that watches the ranks.
        self._control = Storage(self.run_url, cfg.storage.options, retries=0, retry_budget_s=0.0)
        self._control_error_logged = False
        self.skips: list[Window] = skip_windows(
            cfg.training.skip_steps
        )  # and the checkpoints' and rollbacks'
        self._rollback: Window | None = None  # the next start rolls back before it (after a NaN loss)

    # ------------------------------------------------------------------ public
    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary, every rank at the same one, with a checkpoint there; the run ends
        with status ``stopped`` and a resubmission resumes from that checkpoint exactly. Only sets a field:
        safe to call from a signal handler (the loop acts on it at its next heartbeat) or another thread."""
        if self._stop_request is None:
            self._stop_request = StopRequest(reason, time.time())

    def run(self) -> Result:
        self._prepare_storage()
        self.events.append("run_start", attempt=self.attempt, config=self.cfg.to_dict())
        beat = DriverBeat(self._control, self._beat_fields)  # `list`/`show` see that a driver is alive
        beat.start()
        try:
            self._transition(self._initial_state())
            while not self.state.is_terminal:
                self._transition(self._step(self.state))
        finally:
            if self.group is not None:
                self.group.shutdown(graceful=isinstance(self.state, Finished | Stopped))
                self.group = None
            self._close_tracking()
            beat.stop()
        result = self._result()
        if isinstance(self.state, Failed):
            raise self.state.error
        return result

    def _beat_fields(self) -> dict[str, Any]:
        """What ``driver.json`` says besides the driver's host and pid (read on the beat's thread)."""
        return {
            "state": self.state.name,
            "global_step": max(self.global_step, self._seen_step),
            "attempt": self.attempt,
        }

    def _transition(self, new: State) -> None:
        """The only place the state changes."""
        logger.debug("state %s -> %s (%s)", self.state.name, new.name, new.describe())
        self.state = new

    def _step(self, state: State) -> State:
        if isinstance(state, Starting):
            return self._start(state)
        if isinstance(state, Running):
            return self._run_epoch(state)
        if isinstance(state, Recovering):
            return self._recover(state)
        if isinstance(state, Resizing):
            return self._resize(state)
        if isinstance(state, Moving):
            return self._moved(state)
        if isinstance(state, Finishing):
            return self._finish(state)
        raise AssertionError(f"no step for state {state!r}")

    # ------------------------------------------------------------------ storage
    def _prepare_storage(self) -> None:
        self.events = EventLog(self.storage)
        try:
            previous = json.loads(self.storage.read_bytes("run.json"))
        except FileNotFoundError:
            previous = None
        stale = read_stop_request(self.storage)
        if stale is not None and stale.requested_at <= self._started_at:
            logger.warning(
                "removing a stop request from before this job started (%s, %s): no job was running then",
                stale.reason,
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stale.requested_at)),
            )
            clear_stop_request(self.storage)
        for path in ANSWERED:  # asked while no job trained the run: nothing answered them then
            asked = read_request(self.storage, path)
            if asked is not None and float(asked.get("requested_at", 0)) <= self._started_at:
                logger.warning("removing %s, from before this job started: no job was running then", path)
                take_request(self.storage, path)
        if previous is not None:
            _check_compatible(previous.get("config", {}), self.cfg)
            self._evaluated = {
                int(r["global_step"]) for r in self.events.records() if r.get("event") == "evaluation"
            }
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
        self.tracker = self._make_tracker()
        if self.tracker is not None:
            self.events.listeners.append(self.tracker.event)

    def _make_tracker(self) -> Tracker | None:
        tr = self.cfg.tracking
        sinks: list[Sink] = []
        if tr.tensorboard:
            sinks.append(TensorBoardSink(self.storage))
        if tr.mlflow_uri:
            config = self.cfg.to_dict()
            history = self.events.records()
            sinks.append(
                MlflowSink(tr.mlflow_uri, tr.mlflow_experiment, self.storage, config, self.cfg.name, history)
            )
        url = resolve_notify_url(tr)
        if url:
            sinks.append(WebhookSink(url, tr.notify_events, self.cfg.name, self.run_url))
        return Tracker(sinks, tr.queue_size, tr.flush_timeout_s) if sinks else None

    def _track(self, rows: list[dict[str, Any]]) -> None:
        """Hand metric rows to tracking (returns at once) and record what the sinks reported."""
        if self.tracker is None:
            return
        self.tracker.rows(rows)
        for event, fields in self.tracker.notes():
            self.events.append(event, **fields)

    def _close_tracking(self) -> None:
        """Send the summary and wait for tracking (at most ``tracking.flush_timeout_s``); never raises."""
        tracker, self.tracker = self.tracker, None
        if tracker is None:
            return
        records = self.events.records()
        infos = CheckpointStore(self.storage).list()
        summary = {
            "status": self.state.name,
            "checkpoint": step_dir(infos[-1].step) if infos and isinstance(self.state, Finished) else None,
            "attempts": sum(1 for r in records if r["event"] == "group_started"),
            "failures_survived": sum(1 for r in records if r["event"] == "recovered"),
        }
        try:
            left = tracker.close(summary)
            for event, fields in tracker.notes():
                self.events.append(event, **fields)
            if left is not None:
                self.events.append("tracking_incomplete", timeout_s=tracker.flush_timeout_s, **left)
        except Exception as exc:  # the run's own result must not be lost to a tracking problem
            logger.warning("closing tracking failed: %s: %s", type(exc).__name__, exc)

    def _initial_state(self) -> State:
        """Decided once, before any worker starts: a run whose newest verified checkpoint covers every epoch
        is already complete. The workers resume from that same checkpoint, so they never disagree."""
        store = CheckpointStore(self.storage)
        for info in reversed(store.list()):
            if info.epoch < self.cfg.training.epochs and not self._ended_early(info):
                return Starting()  # the newest usable checkpoint (this or an older one) leaves work to do
            try:
                store.read_verified(info)
            except (CheckpointError, StorageError) as exc:
                logger.warning(
                    "final checkpoint at step %d does not verify, looking further back: %s", info.step, exc
                )
                continue
            self.global_step, self.epoch = info.step, info.epoch
            if info.epoch < self.cfg.training.epochs:  # ended by early stopping
                self.stopped_early = True
                self._print(
                    f"[{self.cfg.name}] stopped early at step {self.global_step} (evaluation.patience="
                    f"{self.cfg.evaluation.patience}); nothing to train. Raise evaluation.patience, or set "
                    "it to null, to train on"
                )
            else:
                self._print(
                    f"[{self.cfg.name}] all {self.cfg.training.epochs} epochs are already done "
                    "(checkpoint at step "
                    f"{self.global_step}); nothing to train"
                )
            self.events.append(
                "already_complete", global_step=self.global_step, early_stopped=self.stopped_early
            )
            return Finished()
        return Starting()

    def _ended_early(self, info: CheckpointInfo) -> bool:
        """The checkpoint early stopping wrote at the run's end, and this job stops as early: with the same
        ``evaluation.patience`` (or a smaller one) a resubmission has nothing to train."""
        stopped, patience = info.manifest.get("early_stopped"), self.cfg.evaluation.patience
        return isinstance(stopped, dict) and patience is not None and int(stopped.get("since", 0)) >= patience

    # ------------------------------------------------------------------ steps
    def _start(self, s: Starting) -> State:
        cfg = self.cfg
        target, minimum = cfg.scaling.num_workers, cfg.effective_min_workers
        t0 = time.time()
        # Every worker checks it sees this token (Worker.setup): storage visible only here fails at once.
        # One token per driver: workers kept across a warm restart already carry it.
        if self._probe_token is None:
            self._probe_token = write_probe(self.storage)
        probe_env = {**cfg.scaling.env, PROBE_ENV: self._probe_token}
        group_cfg = dataclasses.replace(cfg, scaling=dataclasses.replace(cfg.scaling, env=probe_env))
        group = self.group = self.group_factory(group_cfg, self.run_url, self.attempt)
        if s.salvage is not None:
            group.adopt(s.salvage)
        sizes = list(range(target, minimum - 1, -1))
        try:
            # A stop asked while Ray has no room ends the run here; one asked when the group can start (a
            # backoff's, a signal at start-up) is acted on at its first step, with a checkpoint there.
            n = group.reserve(sizes, cfg.scaling.resource_wait_s, self._stop_asked)
        except ResourcesUnavailableError as exc:
            self.events.append("failed", reason=str(exc))
            return self._fail(exc)
        except StartCancelled as exc:
            return self._stop_unstarted(str(exc), s.salvage)
        t_reserved = time.time()
        if n < target and s.move is None:  # a shrink for a drain is recorded with its own reason
            self.events.append(
                "resize",
                old=self.world_size or target,
                new=n,
                reason=(
                    f"resources for {target} workers not available within {cfg.scaling.resource_wait_s:g}s"
                ),
            )
            self._print(f"continuing with {n}/{target} workers (scaling.min_workers={minimum})")
        try:
            infos = group.start(n, s.peers, self.skips, self._rollback)
        except (ConfigError, StorageError) as exc:
            # e.g. workers import other code than the driver, or cannot see its storage (after the retry
            # budget): retrying cannot help. Raised in a worker, Ray wraps it with its traceback: the
            # user gets the error itself.
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ConfigError | StorageError):
                raise cause from None
            raise
        except Exception as exc:
            failure = (
                group.classify(exc)
                if _is_remote_error(exc)
                else Failure("start_failed", None, f"{type(exc).__name__}: {exc}")
            )
            return self._on_failure(failure)
        t_ready = time.time()
        self.world_size = n
        head = infos[0]
        for step, reason in head.skipped_checkpoints:
            self.events.append("checkpoint_skipped", step=step, reason=reason)
            self._print(f"skipped checkpoint step {step}: {reason}")
        self.steps_per_epoch = head.steps_per_epoch
        r = head.resume
        self.epoch, self.global_step = r.epoch, r.global_step
        self.skips = merge_windows([*self.skips, *r.skipped_steps])  # a checkpoint's (an earlier driver's)
        if r.rollback is not None:
            self._record_rollback(r.rollback, r.global_step)
        self._rollback = None
        self._display = ProgressDisplay(self.steps_per_epoch * cfg.training.epochs, self.out)
        niceness = sorted({i.niceness for i in infos})
        self.events.append(
            "group_started",
            attempt=self.attempt,
            world_size=n,
            backend=head.backend,
            resume_step=r.global_step,
            resume_epoch=r.epoch,
            resume_checkpoint=r.checkpoint_url,
            resume_world_size=r.world_size,
            resume_source=r.source,
            init_from=r.init_from,
            pids=[i.pid for i in infos],
            nodes=[i.node_id for i in infos],
            hosts=sorted({i.hostname for i in infos}),
            seconds=round(t_ready - t0, 3),
            setup_s=_phase_max(infos),
            hot_spare=group.spare_note,
            allocator=sorted({i.allocator for i in infos}),
            niceness=niceness,
        )
        for note in niceness:
            if "not permitted" in note:
                self._print(f"[{cfg.name}] warning: workers run at niceness {note}")
        self._spare_announced = False
        ratio = cfg.failures.slow_rank_ratio
        self._slow = SlowRankWatch(ratio) if ratio is not None and n > 1 else None
        self._rank_hosts = [i.hostname for i in infos]
        self._eval_total = head.eval_batches
        self._rank_nodes = [i.node_id for i in infos]
        if s.recovery is not None:
            s.recovery.group_started(t_reserved, t_ready, infos, r.global_step)
        if s.move is not None:
            self._record_move(s.move, infos, t_ready)
        where = (
            f"from step {r.global_step} (epoch {r.epoch + 1}, step {r.step_in_epoch})"
            if r.global_step
            else "fresh"
        )
        if r.source == "peers":
            where += f", state from rank {r.peer_source}'s memory"
        if r.init_from is not None:
            kept = r.init_from["kept_init"]
            where += f", with the weights of {r.init_from['url']}" + (
                f" ({len(kept)} tensors keep their own init: {', '.join(kept[:5])}"
                + (" ..." if len(kept) > 5 else "")
                + ")"
                if kept
                else ""
            )
        self._print(
            f"[{cfg.name}] attempt {self.attempt}: {n} workers ({head.backend}) ready in "
            f"{t_ready - t0:.1f}s, starting {where}"
        )
        return Running(r.epoch, r.step_in_epoch, recovery=s.recovery)

    def _run_epoch(self, s: Running) -> State:
        assert self.group is not None and self._display is not None
        group = self.group
        if s.dispatched_at is None:
            if self._eval_missing(s.epoch * self.steps_per_epoch + s.start_step):
                group.run_epoch(s.epoch, s.start_step, evaluate_first=True)
            else:
                group.run_epoch(s.epoch, s.start_step)
        t_epoch = s.dispatched_at or time.time()
        watch = HangWatch(self.cfg.failures, self.global_step)
        while True:
            try:
                self._watch_stop()  # here, not only between heartbeats: epochs may be shorter than those
                results = group.poll(self._heartbeat_every(watch) if self._move is None else 0.25)
                if results is None:
                    self._watch_preemption(s, running=True)
                    self._maybe_grow()
            except Exception as exc:
                self._grow_at = None
                if self._move is not None:  # a failure during a move: recovered as any failure, and
                    self._drained -= self._move.nodes  # the next group acts on the notice again
                    self._move = None
                failure = group.classify(exc)
                watch.update(self._beats(timeout=0.5))  # survivors know how far training got
                return self._on_failure(failure, watch.max_step)
            if results is not None:
                if results[0].early_stopped:
                    return self._stopped_early(s, results[0], time.time() - t_epoch)
                if self._stop_step is not None:
                    return self._stopped(s, results, time.time() - t_epoch)
                if self._move is not None and self._move.stopping:
                    return Moving(self._move, results, s.start_step, time.time() - t_epoch, s.recovery)
                if self._grow_at is not None:
                    return self._grown(s, results, time.time() - t_epoch)
                if self._move is None:  # epochs shorter than the heartbeat interval: look at epoch ends too
                    self._watch_preemption(s, running=False)
                return self._epoch_done(s, results, time.time() - t_epoch)
            beats = self._beats()
            hung = watch.update(beats)
            self._seen_step = watch.max_step
            self._watch_pace(beats, watch.max_step)
            self._announce_spare()
            self._display.live(
                watch.max_step, self.cfg.training.global_batch_size, self._evaluating(beats), self._eval_total
            )
            if hung is not None:
                self._move = None
                self._dump_stacks(f"hang: {hung[1]}", "hang", watch.max_step)  # before the group is killed
                return self._on_failure(Failure("hang", hung[0], hung[1]), watch.max_step)

    def _epoch_done(self, s: Running, results: list[EpochResult], wall_s: float) -> State:
        """Record the epoch; return what comes next. A next epoch is dispatched before the recording, so the
        workers train while this epoch's metrics, events and progress line are written."""
        assert self.group is not None
        head = results[0]
        next_state = self._after_epoch(head)
        if isinstance(next_state, Running):
            self.group.run_epoch(next_state.epoch, next_state.start_step)
        self._record_epoch(head, wall_s, s.recovery)
        return next_state

    def _stopped_early(self, s: Running, head: EpochResult, wall_s: float) -> State:
        """Early stopping (``evaluation.patience``) ended the run at ``head.global_step``; the ranks
        checkpointed there. Record what was trained and finish."""
        if self._move is not None and self.group is not None:
            self.group.cancel_move()  # the run ends here: nothing left to move
        self._move, self._grow_at, self._stop_step = None, None, None
        if self.steps_per_epoch and head.global_step % self.steps_per_epoch == 0:
            self._record_epoch(head, wall_s, s.recovery)  # the evaluation ended a whole epoch
        else:
            self._record_partial(head, s.recovery)
            self.global_step = head.global_step
        best = head.best or {}
        metric = self.cfg.checkpoint.best_metric
        self.stopped_early = True
        self.events.append(
            "early_stopped",
            global_step=head.global_step,
            metric=metric,
            best_step=best.get("step"),
            best_value=best.get("value"),
            evaluations_since_best=best.get("since"),
            patience=self.cfg.evaluation.patience,
        )
        self._print(
            f"[{self.cfg.name}] stopping early at step {head.global_step}: {metric} has not improved for "
            f"{best.get('since')} evaluations (evaluation.patience={self.cfg.evaluation.patience}); the "
            f"best, {best.get('value', float('nan')):.4g} at step {best.get('step')}, is kept: "
            f'load_model(run, step="best")'
        )
        return Finishing(loss=head.loss)

    def _after_epoch(self, head: EpochResult) -> State:
        cfg = self.cfg
        next_epoch = head.epoch + 1
        if next_epoch >= cfg.training.epochs:
            return Finishing(loss=head.loss)
        missing = cfg.scaling.num_workers - self.world_size
        if missing > 0 and self.group is not None and self.group.available_for(missing):
            return Resizing(new_size=cfg.scaling.num_workers)
        return Running(next_epoch, 0, dispatched_at=time.time())

    def _record_epoch(self, head: EpochResult, wall_s: float, recovery: RecoveryTiming | None) -> None:
        assert self._display is not None
        cfg = self.cfg
        self.global_step = head.global_step
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
            "lr": next((r["lr"] for r in reversed(head.step_rows) if r.get("lr") is not None), None),
            **{f"m_{k}": v for k, v in head.metrics.items()},
        }
        streamed, self._rows = self._rows, []  # tracked as their heartbeats brought them
        unstreamed = [{"kind": "step", **r} for r in self._arrived(head.step_rows)] + [epoch_row]
        write_metrics(
            self.storage, [{"kind": "step", **r} for r in streamed] + unstreamed, head.epoch, self.attempt
        )
        self._track(unstreamed)
        for c in head.commits:
            self._commit_event(c)
        if recovery is not None and head.first_step_at is not None:
            self._recovered(recovery, head.first_step_at)
        self.events.append(
            "epoch_end",
            epoch=head.epoch,
            global_step=head.global_step,
            loss=head.loss,
            seconds=round(wall_s, 3),
            samples_per_s=round(samples_per_s, 1),
            world_size=self.world_size,
            **({"skipped_steps": head.skipped} if head.skipped else {}),
        )
        self.last_metrics = {
            "epoch": head.epoch,
            "loss": head.loss,
            "samples_per_s": samples_per_s,
            "global_step": head.global_step,
            "epoch_seconds": wall_s,
            **head.metrics,
        }
        remaining_steps = (cfg.training.epochs - head.epoch - 1) * self.steps_per_epoch
        eta = remaining_steps * (wall_s / max(1, head.steps))
        self._display.epoch_line(
            head.epoch, cfg.training.epochs, head.global_step, head.loss, samples_per_s, eta
        )
        self.epoch = head.epoch + 1
        self._streak = 0

    def _finish(self, s: Finishing) -> State:
        assert self.group is not None
        for c in self.group.finish():
            self._commit_event(c)
        self.events.append("finished", global_step=self.global_step, loss=s.loss, attempts=self.attempt + 1)
        self._print(
            f"[{self.cfg.name}] finished: {self.global_step} steps, loss {s.loss:.4f}, "
            f"checkpoints in {self.run_url}/checkpoints"
        )
        return Finished()

    def _resize(self, s: Resizing) -> State:
        """Grow back at an epoch boundary: the epoch-end checkpoint is flushed, then a new gang starts."""
        assert self.group is not None
        for c in self.group.finish():
            self._commit_event(c)
        self.events.append(
            "resize",
            old=self.world_size,
            new=s.new_size,
            reason="resources returned",
            at_step=self.global_step,
        )
        self._print(f"resources returned: growing {self.world_size} -> {s.new_size} workers")
        self.group.shutdown(graceful=True)
        self.group = None
        self.attempt += 1
        return Starting()

    # ------------------------------------------------------------------ preemption
    def _watch_preemption(self, s: Running, running: bool) -> None:
        """Between heartbeats and at epoch ends: look for drain notices (at most once a second). While an
        epoch runs (``running``), push a move in progress on: stop once its replacements are ready, or with
        a checkpoint when time runs out (a stop needs a running epoch: it is agreed by the ranks in it)."""
        f = self.cfg.failures
        if self.group is None or self._stop_request is not None:
            return  # (a stop asked for checkpoints every rank's state anyway)
        now = time.time()
        m = self._move
        if m is None and not f.preemption:
            return
        if m is None:
            if now < self._next_drain_check:
                return
            self._next_drain_check = now + DRAIN_POLL_S
            try:
                notices = [n for n in self.group.draining() if n.node_id not in self._drained]
            except Exception as exc:  # reading Ray's drains must never stop training
                if not self._drain_error_logged:
                    logger.warning("could not read Ray's draining nodes: %s: %s", type(exc).__name__, exc)
                    self._drain_error_logged = True
                return
            if notices:
                self._begin_move(notices, now)
            return
        if m.stopping or not running:
            return
        if not m.prepared:  # the notice was too short to place anything
            self._stop_for(m)
            return
        status = self.group.move_status()
        late = m.must_stop_by is not None and now >= m.must_stop_by
        waited_out = m.must_stop_by is None and now - m.noticed_at > self.cfg.scaling.resource_wait_s
        if m.slow and status != "ready" and (status.startswith("failed") or waited_out):
            why = (
                status.removeprefix("failed: ")
                if status.startswith("failed")
                else "no room on another node within scaling.resource_wait_s="
                f"{self.cfg.scaling.resource_wait_s:g}s"
            )
            self.group.cancel_move()
            self._move = None
            self.events.append("slow_rank_move_failed", ranks=m.ranks, reason=why)
            self._print(f"[{self.cfg.name}] slow rank(s) {m.ranks} stay where they are: {why}")
            return
        if status == "ready":
            m.replaced = True
            self._stop_for(m)
        elif status.startswith("failed") or late or waited_out:
            m.reason = (
                status.removeprefix("failed: ")
                if status.startswith("failed")
                else f"no room for {len(m.ranks)} replacement(s) on a node that is not draining "
                + (
                    f"by {f.preemption_margin_s:g}s before the deadline (failures.preemption_margin_s)"
                    if late
                    else f"within scaling.resource_wait_s={self.cfg.scaling.resource_wait_s:g}s"
                )
            )
            self.group.cancel_move()
            self._stop_for(m)

    def _begin_move(self, notices: list[DrainNotice], now: float) -> None:
        assert self.group is not None
        f = self.cfg.failures
        ranks = sorted({r for n in notices for r in n.ranks})
        for n in notices:
            left = n.seconds_left(now)
            self.events.append(
                "preemption_notice",
                node=n.node_id,
                ranks=list(n.ranks),
                deadline=n.deadline,
                seconds_left=None if left is None else round(left, 1),
                step=self.global_step,
            )
            self._print(
                f"[{self.cfg.name}] node {n.node_id[:12]} (ranks {list(n.ranks)}) is draining"
                + (f": it goes in {left:.0f}s" if left is not None else " (no deadline)")
            )
        stays = len(ranks) < self.world_size
        via = "peers" if f.recover_from_peers and f.warm_restart and stays else "checkpoint"
        m = Move(notices, ranks, via, now, None, nodes={n.node_id for n in notices})
        if m.deadline is not None:
            m.must_stop_by = m.deadline - f.preemption_margin_s
        self._drained |= m.nodes
        self._move = m
        if m.must_stop_by is not None and now >= m.must_stop_by:
            m.reason = (
                f"the notice leaves {m.deadline - now:.0f}s, under failures.preemption_margin_s="  # type: ignore[operator]
                f"{f.preemption_margin_s:g}s: no time to place replacements"
            )
        else:
            self.group.prepare_move(ranks)
            m.prepared = True

    def _stop_for(self, m: Move) -> None:
        """Stop the group at a step boundary; with a checkpoint unless the replacements take the state
        from a healthy rank."""
        assert self.group is not None
        m.stop_requested_at = time.time()
        m.stop_step = self.group.stop(checkpoint=not m.replaced or m.via == "checkpoint")

    def _moved(self, s: Moving) -> State:
        """The group stopped for a move: record the steps trained, then start again without the draining
        ranks (replacements, or fewer ranks), or go on with the same ranks when neither is possible."""
        assert self.group is not None and self._display is not None
        m, group, head = s.move, self.group, s.results[0]
        self._move = None
        commits = group.finish()  # the checkpoint the stop asked for is committed before anything goes
        if not head.stopped:  # the epoch ended before the stop step: an ordinary epoch end
            next_state = self._after_epoch(head)
            self._record_epoch(head, s.wall_s, s.recovery)
            if isinstance(next_state, Finishing | Resizing):
                for c in commits:
                    self._commit_event(c)
                return next_state
            epoch, start = head.epoch + 1, 0
        else:
            epoch, start = head.epoch, s.start_step + head.steps
            self._record_partial(head, s.recovery)
            self.global_step = head.global_step
        for c in commits:
            self._commit_event(c)
        committed = any(c.step == head.global_step and not c.error for c in [*head.commits, *commits])
        if not m.replaced:
            self.events.append(
                "preemption_checkpoint",
                step=head.global_step,
                committed=committed,
                ranks=m.ranks,
                reason=m.reason,
                seconds_before_deadline=(
                    round(m.deadline - time.time(), 1) if m.deadline is not None else None
                ),
            )
            self._print(
                f"[{self.cfg.name}] checkpoint at step {head.global_step} before the node goes: {m.reason}"
            )
            survivors = self.world_size - len(m.ranks)
            if survivors < max(1, self.cfg.effective_min_workers):
                self._print(
                    f"[{self.cfg.name}] continuing on all {self.world_size} ranks until the node goes "
                    f"(scaling.min_workers={self.cfg.effective_min_workers} rules out {survivors})"
                )
                return Running(epoch, start)
        salvage = group.salvage_stopped(self.attempt + 1, m.ranks, keep_state=m.replaced and m.via == "peers")
        self.group = None
        plan = None
        if salvage is not None and salvage.peers is not None:
            chosen = plan_recovery(salvage.peers)
            plan = chosen if isinstance(chosen, PeerPlan) else None
            if plan is None:
                m.reason = f"the ranks' states disagree ({chosen}): from the checkpoint instead"
        if salvage is None:
            group.shutdown(graceful=False)
        self.attempt += 1
        return Starting(salvage=salvage, peers=plan, move=m)

    def _record_move(self, m: Move, infos: list[SetupInfo], t_ready: float) -> None:
        r = infos[0].resume
        event = ("slow_rank_moved" if m.slow else "preemption_move") if m.replaced else "resize"
        fields: dict[str, Any] = {
            "ranks": m.ranks,
            "from_nodes": sorted(m.nodes),
            "stop_step": m.stop_step,
            "resume_step": r.global_step,
            "lost_steps": max(0, (m.stop_step or 0) - r.global_step),
            "source": r.source,
            "stall_s": round(t_ready - (m.stop_requested_at or t_ready), 3),
            "seconds_before_deadline": round(m.deadline - t_ready, 1) if m.deadline is not None else None,
            "notice_to_moved_s": round(t_ready - m.noticed_at, 3),
        }
        if m.replaced:
            fields["to_nodes"] = [infos[rank].node_id for rank in m.ranks]
            fields["bytes"] = max(i.resume.nbytes for i in infos)
            if m.reason:
                fields["note"] = m.reason
        else:
            fields = {"old": len(infos) + len(m.ranks), "new": len(infos), "at_step": m.stop_step, **fields}
            fields["reason"] = f"preemption: {m.reason}"
        self.events.append(event, **fields)
        self._print(
            f"[{self.cfg.name}] moved ranks {m.ranks} off the draining node(s) "
            f"({r.source}), {fields['lost_steps']} steps lost, training stalled {fields['stall_s']:.1f}s"
            if m.replaced
            else f"[{self.cfg.name}] continuing with {len(infos)} workers without the draining node(s)"
        )

    def _maybe_grow(self) -> None:
        """While a smaller group trains: once the cluster has room for the missing workers, stop at the next
        step boundary with a checkpoint there and start the full group from it (no waiting for the epoch's
        end; nothing lost). Checked at heartbeats, at most every ``GROW_POLL_S``."""
        missing = self.cfg.scaling.num_workers - self.world_size
        if missing <= 0 or self._move is not None or self._grow_at is not None or self.group is None:
            return
        if self._stop_request is not None:  # the run is stopping: a resubmission starts at full size
            return
        now = time.time()
        if now < self._next_grow_check:
            return
        self._next_grow_check = now + GROW_POLL_S
        if self.group.available_for(missing):
            self._grow_at = self.group.stop(checkpoint=True)

    def _grown(self, s: Running, results: list[EpochResult], wall_s: float) -> State:
        """The group stopped to grow: record what it trained, then resize (from the checkpoint at the
        stop)."""
        self._grow_at = None
        head = results[0]
        if not head.stopped:  # the epoch ended first: an ordinary epoch end
            next_state = self._after_epoch(head)
            self._record_epoch(head, wall_s, s.recovery)
            if isinstance(next_state, Finishing):
                return next_state
        else:
            self._record_partial(head, s.recovery)
            self.global_step = head.global_step
        return Resizing(new_size=self.cfg.scaling.num_workers)

    # ------------------------------------------------------------------ stopping on request
    def _watch_stop(self) -> None:
        """While an epoch runs: read the stop file (at most every ``STOP_POLL_S``), and act on a stop asked
        for: every rank stops at the same step boundary with a checkpoint there (``WorkerGroup.stop``). A
        grow already stopping the group with a checkpoint serves as the stop; a move that is stopping it is
        let finish (the stop is acted on once the moved group trains), one still preparing is dropped."""
        assert self.group is not None
        now = time.time()
        if now >= self._next_stop_check:
            self._next_stop_check = now + STOP_POLL_S
            self._read_control()
        self._check_time_limit(now)
        req = self._stop_request
        if req is None or self._stop_step is not None:
            return
        if self._move is not None:
            if self._move.stopping:
                return
            self.group.cancel_move()
            self._drained -= self._move.nodes
            self._move = None
        if self._grow_at is not None:
            self._stop_step, self._grow_at = self._grow_at, None
        else:
            self._stop_step = self.group.stop(checkpoint=True)
        self.events.append("stop_requested", reason=req.reason, stop_step=self._stop_step)
        self._print(
            f"[{self.cfg.name}] stopping ({req.reason}): every rank stops after step {self._stop_step} "
            f"with a checkpoint there{_grace_note(req.reason)}. Once more to stop at once (no checkpoint)"
        )

    def _stop_asked(self) -> bool:
        """While no group trains (backing off, waiting for room): whether the run is asked to stop (a
        signal, the stop file read at most every ``STOP_POLL_S``, ``training.time_limit_s``)."""
        now = time.time()
        if self._stop_request is None and now >= self._next_wait_check:
            self._next_wait_check = now + STOP_POLL_S
            self._read_control(group_requests=False)
        self._check_time_limit(now)
        return self._stop_request is not None

    def _check_time_limit(self, now: float) -> None:
        limit = self.cfg.training.time_limit_s
        if limit is not None and now - self._started_at >= limit:
            self.request_stop(f"training.time_limit_s={limit:g} reached")

    def _stop_unstarted(self, why: str, salvage: Salvage | None) -> Stopped:
        """A stop asked before the group trained: nothing to checkpoint but what survivors of a failure hold
        in memory, which is lost (said, with the steps)."""
        if self.group is not None:
            self.group.shutdown(graceful=False)  # the adopted survivors too
            self.group = None
        held = max((p.global_step for p in (salvage.peers or {}).values()), default=0) if salvage else 0
        infos = CheckpointStore(self.storage).list()
        newest = infos[-1].step if infos else 0
        lost = (
            f"; the survivors of the failure held step {held}, which is lost (steps {newest + 1}-{held})"
            if held > newest
            else ": nothing trained since the newest checkpoint"
        )
        return self._end_stopped(False, f"{why}{lost}")

    def _read_control(self, group_requests: bool = True) -> None:
        """One listing of ``control/``: a stop asked for (``python -m cluster stop``), stacks asked for
        (``python -m cluster stacks``: answered at once). Storage trouble only delays them. Without
        ``group_requests`` (no group trains) only a stop is taken; stacks and profiles wait for the ranks."""
        try:
            found = pending(self._control)
            if STOP_FILE in found and self._stop_request is None:
                req = read_stop_request(self._control)
                if req is not None:
                    self.request_stop(req.reason)
            if not group_requests:
                return
            if STACKS_FILE in found:
                asked = take_request(self._control, STACKS_FILE)
                by = asked.get("by", "python -m cluster stacks")
                step = max(self.global_step, self._seen_step)
                self._dump_stacks(f"asked for by {by}", "request", step, asked.get("id"))
            if PROFILE_FILE in found:
                self._start_profile(take_request(self._control, PROFILE_FILE))
        except StorageError as exc:  # storage down: the next poll tries again; training goes on
            if not self._control_error_logged:
                logger.warning("could not read the run's control requests: %s", exc)
                self._control_error_logged = True

    def _start_profile(self, asked: dict[str, Any]) -> None:
        """Hand a profile request to the ranks it names (``cluster.profiling``); they write the files."""
        assert self.group is not None
        req_id = str(asked.get("id") or uuid.uuid4().hex[:12])
        steps = min(max(int(asked.get("steps") or 5), 1), MAX_PROFILE_STEPS)
        wanted = asked.get("ranks")
        ranks = sorted({int(r) for r in wanted if 0 <= int(r) < self.world_size}) if wanted else []
        ranks = ranks or list(range(self.world_size))
        folder = f"profiles/{time.strftime('%Y%m%d-%H%M%S')}-{req_id}"
        self.group.profile(req_id, steps, ranks, folder)
        self.events.append(
            "profile_requested",
            request=req_id,
            by=asked.get("by"),
            ranks=ranks,
            steps=steps,
            folder=folder,
            step=max(self.global_step, self._seen_step),
            attempt=self.attempt,
        )
        self._print(
            f"[{self.cfg.name}] profiling {steps} step(s) on ranks {stack_dump.ranges(ranks)} "
            f"(asked for by {asked.get('by', '?')}): {self.storage.url(folder)}"
        )

    def _dump_stacks(self, reason: str, kind: str, step: int | None, request: str | None = None) -> None:
        """Every rank's thread stacks to ``diagnostics/`` (the full report), a ``stacks`` event (where each
        group of ranks stands) and console lines. Never raises: it serves a diagnosis, and must not stand
        in the way of the recovery that follows a hang."""
        if self.group is None:
            return
        try:
            raw = self.group.stacks(STACKS_TIMEOUT_S)
            stacks = {r: stack_dump.from_wire(x) if x is not None else None for r, x in enumerate(raw)}
            groups, silent = stack_dump.group(stacks)
            rel = f"diagnostics/stacks_{time.strftime('%Y%m%d-%H%M%S')}_attempt{self.attempt}_{kind}.txt"
            self.storage.write_atomic(rel, stack_dump.render(reason, stacks, self._rank_hosts, step).encode())
            self.events.append(
                "stacks",
                reason=reason,
                kind=kind,
                step=step,
                attempt=self.attempt,
                request=request,
                path=rel,
                groups=[{"ranks": g.ranks, "where": g.where} for g in groups],
                silent=silent,
            )
            lines = [f"  ranks {stack_dump.ranges(g.ranks)}: {g.where}" for g in groups]
            if silent:
                lines.append(f"  ranks {stack_dump.ranges(silent)}: no answer")
            self._print(
                f"[{self.cfg.name}] where the ranks are ({reason}); every thread in {self.storage.url(rel)}\n"
                + "\n".join(lines)
            )
        except Exception as exc:  # a diagnosis that fails is logged; the run goes on
            logger.warning("could not take the ranks' stacks: %s: %s", type(exc).__name__, exc)

    def _stopped(self, s: Running, results: list[EpochResult], wall_s: float) -> State:
        """The group stopped as asked (or its epoch ended first, with the checkpoint the stop asked for):
        record what it trained, flush the checkpoint, record the stop."""
        assert self.group is not None and self._stop_request is not None
        self._stop_step = None
        head = results[0]
        if head.stopped:
            self._record_partial(head, s.recovery)
            self.global_step = head.global_step
        else:  # the epoch ended before the stop step; the stop's checkpoint was taken at its end
            next_state = self._after_epoch(head)
            self._record_epoch(head, wall_s, s.recovery)
            if isinstance(next_state, Finishing):
                return next_state  # that was the last epoch: the run is done, not stopped
        commits = self.group.finish()  # the stop's checkpoint is committed before the workers go
        for c in commits:
            self._commit_event(c)
        committed = any(c.step == head.global_step and not c.error for c in [*head.commits, *commits])
        return self._end_stopped(committed)

    def _end_stopped(self, committed: bool, note: str | None = None) -> Stopped:
        req = self._stop_request
        assert req is not None
        infos = CheckpointStore(self.storage).list()
        latest = infos[-1].step if infos else None
        self.events.append(
            "stopped",
            reason=req.reason,
            global_step=self.global_step,
            checkpoint_step=latest,
            committed=committed,
            seconds=round(time.time() - req.requested_at, 3),
            note=note,
        )
        where = (
            f"its checkpoint at step {latest} is committed"
            if committed
            else f"no checkpoint at the stop ({note or 'it failed to commit'}); the newest is at step "
            f"{latest}"
        )
        self._print(
            f"[{self.cfg.name}] stopped at step {self.global_step} ({req.reason}) in "
            f"{time.time() - req.requested_at:.1f}s: {where}. Resubmit the same job to resume"
        )
        try:
            clear_stop_request(self.storage)
        except StorageError as exc:  # the next submission removes it as stale
            logger.warning("could not remove the stop request file: %s", exc)
        return Stopped()

    def _record_partial(self, head: EpochResult, recovery: RecoveryTiming | None = None) -> None:
        """A stopped epoch's step rows (its end is recorded by the epoch that finishes it), and the
        ``recovered`` event when this was the first stretch of training after a failure."""
        streamed, self._rows = self._rows, []
        rows = [{"kind": "step", **r} for r in streamed + self._arrived(head.step_rows)]
        if rows:
            write_metrics(self.storage, rows, head.epoch, self.attempt)
            self._track(rows[len(streamed) :])
        for c in head.commits:
            self._commit_event(c)
        if recovery is not None and head.first_step_at is not None:
            self._recovered(recovery, head.first_step_at)

    def _on_failure(self, failure: Failure, seen_step: int | None = None) -> Recovering:
        self.failures.append(failure)
        self._streak += 1
        self.events.append(
            "failure",
            kind=failure.kind,
            rank=failure.rank,
            attempt=self.attempt,
            message=failure.message[-4000:],
            step=seen_step,
        )
        self._print(f"FAILURE ({failure.kind}, rank {failure.rank}): {failure.message.splitlines()[0][:300]}")
        timing = RecoveryTiming(failure.kind, time.time(), seen_step or self.global_step)
        return Recovering(failure, timing)

    def _recover(self, s: Recovering) -> State:
        failure, timing = s.failure, s.recovery
        if self._stop_request is not None:  # asked to stop: no restart, whatever the failure
            self._stop_step = None
            if self.group is not None:
                self.group.shutdown(graceful=False)
                self.group = None
            self._flush_rows([])  # the step rows the heartbeats brought: nothing recorded is lost
            return self._end_stopped(False, f"a failure during the stop: {failure.kind}, rank {failure.rank}")
        decision = self.policy.decide(failure, self.failures, self._streak)
        salvage: Salvage | None = None
        if self.group is not None:
            # Survivors leave the failed collective (bounded wait) and are kept for a warm restart, with
            # their state when recovering from peers; the dead, the hung and the stuck are killed.
            salvage = self.group.salvage(failure, self.attempt + 1) if decision.restart else None
            if salvage is None:
                self.group.shutdown(graceful=False)
            timing.reused_workers = salvage.count if salvage is not None else 0
            timing.spare = salvage.spare if salvage is not None else None
            self.group = None
        timing.t_teardown = time.time()
        self._flush_rows(salvage.rows if salvage is not None else [])
        plan = self._peer_plan(failure, salvage, timing) if decision.restart else None
        if decision.restart and _diverged(failure):
            assert failure.error is not None  # _diverged
            last = int(failure.error.detail["first_step"])
            self._rollback = (max(1, last - self.cfg.failures.nan_skip_steps + 1), last)
            self.skips = merge_windows([*self.skips, self._rollback])
        self.events.append(
            "decision",
            restart=decision.restart,
            reason=decision.reason,
            delay_s=decision.delay_s,
            source=None if not decision.restart else "peers" if plan is not None else "checkpoint",
            fallback=timing.fallback or None,
            peer_source=plan.source if plan is not None else None,
            peer_step=plan.global_step if plan is not None else None,
        )
        if not decision.restart:
            detail = failure.error.traceback if failure.error is not None else failure.message
            return self._fail(
                TrainingFailedError(
                    f"{decision.reason}. Last failure ({failure.kind}, rank "
                    f"{failure.rank}):\n{detail}\nCheckpoints are intact in "
                    f"{self.run_url}/checkpoints; rerun the same job to resume."
                )
            )
        source = (
            f"from rank {plan.source}'s memory at step {plan.global_step}"
            if plan is not None
            else "from the latest checkpoint" + (f" ({timing.fallback})" if timing.fallback else "")
        )
        self._print(f"recovering ({decision.reason}) in {decision.delay_s:.1f}s, {source}")
        wake = time.monotonic() + decision.delay_s
        while time.monotonic() < wake and not self._stop_asked():  # a stop cuts the wait short
            time.sleep(min(0.5, max(0.0, wake - time.monotonic())))
        self.attempt += 1
        return Starting(recovery=timing, salvage=salvage, peers=plan)

    def _record_rollback(self, back: dict[str, Any], resume_step: int) -> None:
        first, last = back["window"]
        trained = max(first, resume_step + 1)  # the window's steps the resumed weights have not trained
        self.events.append(
            "rollback",
            window=[first, last],
            skipped=[trained, last],
            checkpoint_step=back["checkpoint_step"],
            discarded=back["discarded"],
            resume_step=resume_step,
        )
        where = f"checkpoint step {resume_step}" if back["checkpoint_step"] is not None else "the run's start"
        note = (
            f" (the newer kept checkpoints leave none before step {first}: steps {first}-{trained - 1} stay "
            "trained)"
            if trained > first
            else ""
        )
        gone = f"; deleted the newer checkpoints {back['discarded']}" if back["discarded"] else ""
        self._print(
            f"[{self.cfg.name}] rolled back to {where} after a loss that was not finite: the batches of "
            f"steps {trained}-{last} are skipped{note}{gone}"
        )

    def _peer_plan(
        self, failure: Failure, salvage: Salvage | None, timing: RecoveryTiming
    ) -> PeerPlan | None:
        """Whom to copy the state from, or None (checkpoint) with the reason in ``timing.fallback``."""
        if not self.cfg.failures.recover_from_peers:
            return None
        if _diverged(failure):
            timing.fallback = "a loss that was not finite: no rank's weights can be trusted; rolling back"
            return None
        if failure.kind == "hang":
            timing.fallback = "a hang: the hung rank's memory is not trusted"
        elif salvage is None or salvage.peers is None:
            timing.fallback = (
                "a node was lost and no survivor could be kept (no room for its ranks within "
                "scaling.resource_wait_s, or no rank left)"
                if failure.kind == "node_lost"
                else "no survivor could be kept"
            )
        else:
            plan = plan_recovery(salvage.peers)
            if isinstance(plan, PeerPlan):
                return plan
            timing.fallback = plan
        if failure.kind != "hang" and not self.cfg.failures.warm_restart:
            timing.fallback = "failures.warm_restart is off: no survivor keeps its process"
        return None

    def _beats(self, timeout: float = 2.0) -> list[Any]:
        """One heartbeat round; keeps the step rows rank 0 streams with it."""
        assert self.group is not None
        beats = self.group.heartbeats(timeout=timeout)
        for b in beats:
            if b is not None and b.rows:
                rows = self._arrived(b.rows)
                self._rows.extend(rows)
                self._track([{"kind": "step", **r} for r in rows])  # live in TensorBoard / MLflow
        return beats

    def _arrived(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Metric rows as rank 0 hands them over; each new evaluation is recorded (event, console line)
        and one repeated after a recovery is dropped: it was recorded once already."""
        if not any(r.get("kind") == "eval" for r in rows):
            return rows
        out = []
        for r in rows:
            if r.get("kind") == "eval":
                if r["global_step"] in self._evaluated:
                    continue
                self._record_eval(r)
            out.append(r)
        return out

    def _record_eval(self, row: dict[str, Any]) -> None:
        step = int(row["global_step"])
        self._evaluated.add(step)
        metrics = {k[2:]: v for k, v in row.items() if k.startswith("m_")}
        self.last_eval = {"global_step": step, "epoch": row["epoch"], "loss": row["loss"], **metrics}
        self.events.append(
            "evaluation",
            global_step=step,
            epoch=row["epoch"],
            loss=row["loss"],
            metrics=metrics,
            samples=row.get("eval_samples"),
            seconds=round(row["step_time_s"], 3),
            world_size=row.get("world_size"),
        )
        shown = "".join(f", {k} {v:.4g}" for k, v in metrics.items())
        self._print(
            f"[{self.cfg.name}] eval at step {step} (epoch {row['epoch'] + 1}): loss {row['loss']:.4f}{shown}"
            f" ({row.get('eval_samples')} samples, {row['step_time_s']:.1f}s)"
        )

    def _eval_missing(self, step: int) -> bool:
        """An evaluation is due right at ``step`` (where training resumes) and was never recorded: the
        failure took it (or its result) with it."""
        return eval_due(step, self.steps_per_epoch, self.cfg.training.epochs, self.cfg.evaluation) and (
            step not in self._evaluated
        )

    def _flush_rows(self, more: list[dict[str, Any]]) -> None:
        """After a failure: write every step row rank 0 logged before it (nothing recorded is lost)."""
        more = self._arrived(more)
        rows, self._rows = self._rows + more, []
        if rows:
            step_rows = [{"kind": "step", **r} for r in rows]
            write_metrics(self.storage, step_rows, self.epoch, self.attempt)
            self._track(step_rows[len(rows) - len(more) :])  # the heartbeats' rows are tracked already

    def _fail(self, exc: BaseException) -> Failed:
        self.events.append("run_failed", error=str(exc)[:4000])
        return Failed(exc)

    # ------------------------------------------------------------------ helpers
    def _announce_spare(self) -> None:
        """One ``spare_ready`` event per group, once its hot spare is prepared: from then on a dead rank is
        replaced without starting a process. Checked at each heartbeat and each epoch end."""
        if self._spare_announced or self.group is None:
            return
        prepare_s = self.group.spare_ready()
        if prepare_s is not None:
            self._spare_announced = True
            self.events.append("spare_ready", attempt=self.attempt, prepare_s=round(prepare_s, 3))

    def _watch_pace(self, beats: list[Any], step: int) -> None:
        """Report a rank that holds the others up (and when it no longer does): events and console."""
        if self._slow is None:
            return
        became, cleared = self._slow.update(beats)
        name = self.cfg.name
        for r in became:
            host = self._rank_hosts[r.rank] if r.rank < len(self._rank_hosts) else ""
            report = {
                "rank": r.rank,
                "host": host,
                "step": step,
                "attempt": self.attempt,
                "ratio": round(r.ratio, 2),
                "compute_ms": round(r.compute_s * 1000, 1),
                "others_ms": round(r.others_s * 1000, 1),
                "step_ms": round(r.step_s * 1000, 1),
                "input_ms": round(r.input_s * 1000, 1),
                "others_input_ms": round(r.others_input_s * 1000, 1),
            }
            self.events.append("slow_rank", **report)
            self._slow_reports.append(report)
            self._print(
                f"[{name}] rank {r.rank} on {host} is slow: its own part of each step takes "
                f"{r.compute_s * 1000:.0f} ms against {r.others_s * 1000:.0f} ms on the other ranks "
                f"({r.ratio:.1f}x), and every rank waits for it (steps take {r.step_s * 1000:.0f} ms). "
                + _slow_cause(r)
            )
        for r in cleared:
            host = self._rank_hosts[r.rank] if r.rank < len(self._rank_hosts) else ""
            self.events.append("slow_rank_cleared", rank=r.rank, host=host, step=step, attempt=self.attempt)
            self._print(f"[{name}] rank {r.rank} on {host} keeps pace again")
        if became and self.cfg.failures.slow_rank_action == "move":
            self._move_slow(became[0].rank, step)

    def _move_slow(self, rank: int, step: int) -> None:
        """``failures.slow_rank_action=move``: place a replacement for a slow rank on another node and let
        the move machinery of drain notices take it there (prepared while training goes on, then a stop
        between two steps and the state from a healthy rank). One move at a time; never during a stop, a
        grow or another move."""
        f = self.cfg.failures
        if (
            self.group is None
            or self._move is not None
            or self._stop_request is not None
            or self._grow_at is not None
            or self.world_size < 2
            or rank >= len(self._rank_nodes)
        ):
            return
        node = self._rank_nodes[rank]
        self._slow_nodes.add(node)
        via = "peers" if f.recover_from_peers and f.warm_restart else "checkpoint"
        notice = DrainNotice(node, (rank,), None)
        m = Move([notice], [rank], via, time.time(), None, nodes={node}, slow=True)
        self.group.prepare_move([rank], avoid=sorted(self._slow_nodes))
        m.prepared = True
        self._move = m
        host = self._rank_hosts[rank] if rank < len(self._rank_hosts) else ""
        self.events.append("slow_rank_move", rank=rank, host=host, node=node, step=step, via=via)
        self._print(
            f"[{self.cfg.name}] moving slow rank {rank} off {host} (failures.slow_rank_action=move): placing "
            "a replacement on another node while training goes on"
        )

    def _evaluating(self, beats: list[Any]) -> int | None:
        """Eval batches the ranks have done since the step last moved (the live bar shows an evaluation's
        progress while the step stands still); None while training steps."""
        step = max((b.global_step for b in beats if b is not None), default=0)
        done = sum(b.eval_batches for b in beats if b is not None)
        if step != self._live_step:
            self._live_step, self._live_evals = step, done
            return None
        return done - self._live_evals if done > self._live_evals else None

    def _heartbeat_every(self, watch: HangWatch) -> float:
        """Seconds between heartbeats: ``poll_s`` for a terminal's live bar, else a twentieth of the hang
        timeout within [poll_s, 5 * poll_s]. A death is seen at once either way (the epoch's result fails)."""
        assert self._display is not None
        if self._display.tty:
            return self.poll_s
        return min(max(self.poll_s, watch.timeout() / 20), 5 * self.poll_s)

    def _recovered(self, timing: RecoveryTiming, first_step_at: float) -> None:
        phases = timing.phases(first_step_at)
        self.events.append(
            "recovered",
            kind=timing.kind,
            source=timing.source,
            fallback=timing.fallback or None,
            resume_step=timing.resume_step,
            lost_steps=timing.lost_steps,
            bytes=timing.nbytes,
            storage_reads=timing.storage_reads,
            storage_read_bytes=timing.storage_read_bytes,
            reused_workers=timing.reused_workers,
            spare=timing.spare,
            **{k: round(v, 3) for k, v in phases.items()},
        )
        self._print(
            f"recovered from {timing.kind} ({timing.source}): first step "
            f"{phases['detect_to_first_step_s']:.1f}s after detection, {timing.lost_steps} steps of work "
            "lost, "
            f"{_fmt_bytes(timing.nbytes)} of state moved in {timing.transfer_s:.2f}s"
        )

    def _commit_event(self, c: CommitRecord) -> None:
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

    def _print(self, text: str) -> None:
        if self._display is not None:
            self._display.line(text)
        else:
            self.out.write(text + "\n")
            self.out.flush()

    def _result(self) -> Result:
        infos = CheckpointStore(self.storage).list()
        error = self.state.error if isinstance(self.state, Failed) else None
        return Result(
            name=self.cfg.name,
            run_url=self.run_url,
            status=self.state.name,
            epochs_completed=self.epoch,
            global_step=self.global_step,
            metrics=self.last_metrics,
            latest_checkpoint=infos[-1].url if infos else None,
            attempts=self.attempt + 1,
            failures=[{"kind": f.kind, "rank": f.rank, "message": f.message[:2000]} for f in self.failures],
            world_size=self.world_size,
            error=str(error) if error is not None else None,
            slow_ranks=list(self._slow_reports),
            evaluation=self.last_eval,
            stopped_early=self.stopped_early,
            skipped_steps=list(self.skips),
            stop_reason=self._stop_request.reason
            if isinstance(self.state, Stopped) and self._stop_request is not None
            else None,
        )


STACKS_TIMEOUT_S = 5.0
"""How long the driver waits for the ranks' stacks; a rank that did not answer by then is named silent."""
GROW_POLL_S = 2.0
"""While smaller than ``scaling.num_workers``: at most one check for room to grow per this many seconds."""
DRAIN_POLL_S = 1.0
"""At most one read of Ray's draining nodes (one GCS query) per this many seconds; reads happen at
heartbeats and epoch ends."""


def _grace_note(reason: str) -> str:
    """Under ``ray job submit``, ``ray job stop`` SIGKILLs the driver RAY_JOB_STOP_WAIT_TIME_S (3 by default)
    after its SIGTERM: say how long the stop has, and how to give it more."""
    if reason != "SIGTERM" or "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        return ""
    wait = os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", "3")
    return (
        f" (`ray job stop` kills this driver {wait}s after its SIGTERM; a longer RAY_JOB_STOP_WAIT_TIME_S in "
        "the job's runtime_env env_vars gives the checkpoint time to commit)"
    )


def _slow_cause(r: SlowRank) -> str:
    """Where a slow rank's extra time goes: waiting for its batches, or its forward and backward."""
    extra_input = r.input_s - r.others_input_s
    extra = r.compute_s - r.others_s
    where = f"Its wait for input: {r.input_s * 1000:.0f} ms against {r.others_input_s * 1000:.0f} ms"
    if extra > 0 and extra_input >= extra / 2:
        return f"{where}: its input pipeline (storage, loader processes: training.loader_workers)."
    return f"{where}: its forward and backward (its device or host)."


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _phase_max(infos: list[SetupInfo]) -> dict[str, float]:
    """Slowest rank's seconds per setup phase (each phase ends at the named timestamp)."""
    out: dict[str, float] = {}
    for info in infos:
        marks = list(info.timings.items())
        for (_, t0), (name, t1) in itertools.pairwise(marks):
            out[name] = max(out.get(name, 0.0), round(t1 - t0, 3))
    return out


def _diverged(failure: Failure) -> bool:
    """A rank's loss was not finite (``DivergedError``), and it says where that began."""
    e = failure.error
    return e is not None and e.exc_type == "DivergedError" and bool(e.detail.get("first_step"))


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
                f"{name}={new!r} differs from {old!r} in the existing run {cfg.name!r}; "
                "resuming would mix two "
                f"different trainings. Keep {name}={old!r}, or choose a new name (--set name=...)"
            )


def _ray_version() -> str:
    try:
        import ray

        return str(ray.__version__)
    except ImportError:  # pragma: no cover
        return "missing"


def _ray_group_factory(cfg: JobConfig, run_url: str, attempt: int, task_cls: Any = None) -> WorkerGroup:
    from cluster.worker_group import RayWorkerGroup

    return RayWorkerGroup(cfg, run_url, attempt, task_cls)


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
            "scaling.use_gpu=true but the Ray cluster has no GPUs; "
            "set scaling.use_gpu=false to train on CPUs, "
            "or connect to a cluster with GPU nodes (RAY_ADDRESS)"
        )


def preflight(cfg: JobConfig, task: type[Task] | None = None) -> None:
    """Checks that need no Ray and write nothing, run before Ray starts: the task imports (unless given as
    a class), and the storage is one that the workers (other processes, often other machines) can see."""
    from cluster.task import load_task_class

    if task is None:
        load_task_class(cfg.task)  # an unknown task is a config error, found before anything starts
    resolve_notify_url(cfg.tracking)  # env:NAME set where the driver runs
    if cfg.training.init_from is not None:
        from cluster.load import check_init_from

        run = Storage(join(normalize_url(cfg.storage.url), cfg.name), cfg.storage.options)
        if not CheckpointStore(run).list():  # a run that resumes from its own checkpoint ignores init_from
            check_init_from(cfg.training.init_from, cfg.training.init_from_step, cfg.storage.options)
    if cfg.storage.url.strip().lower().startswith("memory://"):
        raise ConfigError(
            f"storage.url={cfg.storage.url!r}: memory:// lives inside one process, and the workers are Ray "
            "actors in other processes that would each see an empty store; use a local folder (./runs), "
            "a shared mount, or an object store (s3://, gs://)"
        )


def train(cfg: JobConfig, out: TextIO | None = None, task: type[Task] | None = None) -> Result:
    """Run (or resume) the job described by ``cfg`` to completion and return its Result.

    ``task``: the Task class itself instead of ``cfg.task``'s import path (which then records it): sent to
    the workers by value, so a class defined in a notebook or in the running script works. Uses the Ray
    cluster in ``RAY_ADDRESS`` or an already initialised one; otherwise starts an embedded local Ray and
    shuts it down afterwards.
    """
    if task is not None:
        cfg = dataclasses.replace(cfg, task=task_path(task))
    preflight(cfg, task)
    started = ensure_ray(cfg)
    try:
        check_cluster(cfg)
        factory = functools.partial(_ray_group_factory, task_cls=task) if task is not None else None
        driver = Driver(cfg, group_factory=factory, out=out)
        with stop_on_signals(driver):
            return driver.run()
    finally:
        if started:
            local_ray.shutdown()


@contextlib.contextmanager
def stop_on_signals(driver: Driver) -> Iterator[None]:
    """While ``driver`` runs in the main thread: the first SIGINT (Ctrl-C) or SIGTERM (``ray job stop``)
    stops it cleanly (``Driver.request_stop``: a checkpoint at the next step, status ``stopped``); a second
    raises KeyboardInterrupt, which kills the workers at once. The previous handlers come back after.
    Installed after ``ray.init``, whose own SIGTERM handler would end the process without the checkpoint."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names: dict[int, str] = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: object) -> None:
        if driver._stop_request is not None:
            raise KeyboardInterrupt(f"{names.get(signum, signum)} again while stopping")
        driver.request_stop(names.get(signum, str(signum)))  # only sets a field: the loop prints and acts

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def result_to_json(result: Result) -> str:
    return json.dumps(asdict(result), indent=1, default=str)
