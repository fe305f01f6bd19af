"""The coordinator: an explicit state machine that starts the group, drives epochs, watches heartbeats,
decides on failures through a small policy object, and resumes from the latest verified checkpoint.

States carry their data and ``Driver._step`` returns the next one; ``Driver._transition`` is the only place
the state changes::

    Starting --> Running --(epoch done)--> Running | Resizing --> Starting | Finishing --> Finished
        |           |
        |           +--(a stop asked for: a checkpoint at the next step)--> Stopped
        +-----------+--(failure)--> Recovering --> Starting | Failed

Whether a run is already complete is decided once, before any worker starts (``_initial_state``). A running
group's mode is one value (``Driver.mode``: nothing, a stop, a grow or a move, see
``cluster.driver.states.Mode``); when a group halts at a step boundary for one of them, ``_halted`` records
what it trained and acts on it.

What the driver leaves to others: the run's record (events, console lines, metric rows, tracking:
``cluster.driver.record``, a listener to what the driver announces: ``cluster.driver.listeners``), the
decisions on failures (``cluster.driver.policy``), on drains, slow ranks and growing back
(``cluster.driver.moves``; the group's mode changes in ``cluster.driver.modes``, a base of ``Driver``), the
words of the ends it decides on (``cluster.driver.outcomes``), a group's set-up errors
(``cluster.driver.starting``), the run's requests (stop, time limit, stacks, profiles:
``cluster.driver.control``), the gang of workers (``cluster.seam.protocol``), and the entry points
(``cluster.api.train``).

It never sits on a training step's path: workers train a whole epoch autonomously; the driver waits on the
epoch's result and reads a heartbeat (global step, time of the last step): once a second while a live bar
is drawn in a terminal, otherwise every twentieth of the hang timeout (3 s by default), because each
heartbeat is a call into every worker while it trains.
"""

from __future__ import annotations

import logging
import sys
import time
from functools import partial
from typing import Any, TextIO

from cluster.core.errors import (
    ConfigError,
    Failure,
    ResourcesUnavailableError,
    StorageError,
    TrainingFailedError,
)
from cluster.driver.control import DriverBeat, RunControl, dump_stacks
from cluster.driver.hang import hang_failure
from cluster.driver.listeners import Announcer, DriverListener
from cluster.driver.modes import GroupModes
from cluster.driver.moves import MoveWatch
from cluster.driver.outcomes import (
    commits_failing,
    commits_would_fail,
    complete_checkpoint,
    final_commit_failed,
    unstarted_loss,
)
from cluster.driver.policy import FailurePolicy, HangMemory, HangStats, HangWatch, checkpoints_on
from cluster.driver.record import RunRecord
from cluster.driver.record_moves import MoveRecord
from cluster.driver.recovery_plan import move_plan, peer_plan, rollback_window
from cluster.driver.replica_rollback import after_mismatch
from cluster.driver.result import Result, result_of
from cluster.driver.starting import group_config, set_up
from cluster.driver.states import (
    Failed,
    Finished,
    Finishing,
    Grow,
    Mode,
    Moving,
    Recovering,
    RecoveryTiming,
    Resizing,
    Running,
    Starting,
    State,
    Stopped,
)
from cluster.inspect.runs import resume_advice
from cluster.run.folder import RunFolder
from cluster.run.history import read_past_groups
from cluster.run.lease import FencedError, Lease
from cluster.run.quarantine import Quarantine
from cluster.run.storage import write_probe
from cluster.seam.adoption import Adoption
from cluster.seam.preemption import Move
from cluster.seam.protocol import EpochResult, GroupFactory, Salvage, SetupInfo, StartCancelled, WorkerGroup
from cluster.spec.config import JobConfig
from cluster.spec.schedule import Window, merge_windows, skip_windows

__all__ = ["Driver", "FailurePolicy"]

logger = logging.getLogger(__name__)


class Driver(GroupModes):
    """Runs one job to its end. ``run`` loops ``state = self._step(state)`` until a terminal state; every
    transition goes through ``_transition``. What outlives a state (the position reached, the live worker
    group and its mode, the failures seen) is on the driver; the run's history is on ``record``."""

    def __init__(
        self,
        cfg: JobConfig,
        group_factory: GroupFactory,
        policy: FailurePolicy | None = None,
        out: TextIO | None = None,
        poll_s: float = 1.0,
        takeover: bool = False,
        lease: Lease | None = None,
        started_at: float | None = None,
        folder: RunFolder | None = None,
        adoption: Adoption | None = None,
    ) -> None:
        self.cfg = cfg
        self.adoption = adoption
        """The ranks a previous driver left running, adopted (or why not): the run goes on with them."""
        self.takeover = takeover
        self.lease = lease
        """The run's lease (``cluster.run.lease``): taken in ``run`` unless given, released when it ends."""
        self.group_factory = group_factory
        self.policy = policy or FailurePolicy(cfg.failures)
        self.poll_s = poll_s
        self.state: State = Starting()
        self.folder = folder or RunFolder.of(cfg)
        """The run's folder (``cluster.run.folder``): its storage and checkpoint store are the ones every part
        of the driver uses."""
        self.storage = self.folder.storage
        self.run_url = self.folder.url
        self.record = RunRecord(cfg, self.folder, out or sys.stdout)
        self.record.t0 = started_at or time.time()  # the goodput ledger's start (``cluster.run.goodput``)
        self.announce: DriverListener = Announcer(self.record, MoveRecord(self.record.event))
        """Where the driver says what happened (``cluster.driver.listeners``); the record listens first."""
        self.control = RunControl(self.storage, cfg.training.time_limit_s)
        self.moves = MoveWatch(cfg, self.announce)
        self.quarantine = Quarantine(
            self.storage, cfg.failures.quarantine_after, self.announce.event, self._keep_off
        )
        """Nodes kept out of the run after repeated incidents (``cluster.run.quarantine``)."""
        self.quarantine.room = self._room_without
        self.attempt = 0
        self.epoch = 0
        self.global_step = 0
        self.steps_per_epoch = 0
        self.world_size = 0
        self.group: WorkerGroup | None = None
        self._placer: WorkerGroup | None = None
        """The newest group made: asked whether a node can be spared (``_room_without``)."""
        self.mode: Mode = None
        self.failures: list[Failure] = []
        self.stopped_early = False
        self.skips: list[Window] = skip_windows(cfg.training.skip_steps)  # and checkpoints' and rollbacks'
        self._rollback: Window | None = None  # the next start rolls back before it (after a NaN loss)
        self._probe_token: str | None = None
        self._streak = 0  # failures since the last completed epoch
        self._spare_announced = False  # the current group's hot spare was reported ready
        self._seen_step = 0  # the furthest step a heartbeat reported
        self._hang_stats = HangStats(0)  # the group's step statistics the automatic hang timeout uses
        past = partial(read_past_groups, self.storage, self.record.events.records, cfg.to_dict())
        self._hang_memory = HangMemory(cfg.failures, checkpoints_on(cfg.checkpoint), past)
        """The run's earlier warm groups a new group's hang timeout starts from (``HangStats.history``)."""

    @property
    def events(self) -> Any:
        return self.record.events

    @property
    def out(self) -> TextIO:
        """Where console lines go (the record's)."""
        return self.record.out

    @out.setter
    def out(self, out: TextIO) -> None:
        self.record.out = out

    def run(self) -> Result:
        lease = self.lease or Lease.take_for(self.cfg, self.takeover, self.announce.print, self.folder)
        self.lease = lease
        lease.start()
        try:
            return self._run(lease)
        finally:
            lease.release()

    def _run(self, lease: Lease) -> Result:
        """Everything the run writes is fenced by ``lease``: once another job took the run over, the next
        trusted write raises FencedError and the run ends without writing more."""
        self.record.events.fence = lease.check
        self.quarantine.fence = lease.check
        self.folder.checkpoints.fence = lease.check  # a replica rollback's deletions
        self._prepare_storage()
        self.quarantine.load()  # an earlier submission's quarantined nodes stay out
        self.announce.run_start(self.attempt, lease)
        beat = DriverBeat(self.control.storage, self._beat_fields, fence=lease.check)  # `list`/`show`
        beat.start()
        try:
            self._transition(self._initial_state())
            while not self.state.is_terminal:
                self._transition(self._guarded_step(self.state))
        finally:
            if self.group is not None:
                try:
                    self.group.shutdown(graceful=isinstance(self.state, Finished | Stopped))
                except Exception as exc:  # the run's outcome stands; its workers go with the job
                    logger.warning("shutting the workers down failed: %s: %s", type(exc).__name__, exc)
                self.group = None
            self.announce.run_ended(self.state.name, isinstance(self.state, Finished))
            beat.stop()
        result = result_of(self)
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
        previous, self.state = self.state, new
        self.announce.state_changed(previous, new)

    def _guarded_step(self, state: State) -> State:
        """``_step``, where an error no state handles (an actor's error or time-out while finishing,
        resizing, moving or stopping; storage failing past its retries) ends the run as failed with its real
        cause and a ``run_failed`` event, never a bare traceback with the run left looking interrupted. The
        errors meant for the user (a config the workers refuse) keep their type; a job that was taken over
        writes nothing more."""
        try:
            return self._step(state)
        except FencedError:
            raise
        except (ConfigError, StorageError) as exc:
            self._record_failed(exc)
            raise
        except Exception as exc:
            logger.exception("the run fails while %s", state.describe())
            advice = resume_advice(self.folder.checkpoints)
            return self._fail(
                TrainingFailedError(f"{type(exc).__name__} while {state.describe()}: {exc}. {advice}")
            )

    def _record_failed(self, exc: BaseException) -> None:
        try:
            self.announce.run_failed(exc)
        except StorageError as err:  # the error itself is what the user must see
            logger.warning("could not record the run's failure: %s", err)

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

    def _prepare_storage(self) -> None:
        self.control.clear_stale(self.storage)
        self.record.open()

    def _initial_state(self) -> State:
        """Decided once, before any worker starts: a run whose newest verified checkpoint covers every epoch
        is already complete. The workers resume from that same checkpoint, so they never disagree."""
        epochs = self.cfg.training.epochs
        info = complete_checkpoint(self.folder.checkpoints, epochs, self.cfg.evaluation.patience)
        if info is None:
            return self._adopted() or Starting()
        self._drop_adopted()
        self.global_step, self.epoch = info.step, info.epoch
        self.stopped_early = info.epoch < epochs  # ended by early stopping
        self.announce.already_complete(self.global_step, self.stopped_early)
        return Finished()

    def _adopted(self) -> State | None:
        """Go on with the ranks a previous driver left running (``cluster.seam.adoption``): from the epoch
        they were given, whose result the group collects; None to start as usual (nothing adopted)."""
        a, self.adoption = self.adoption, None
        if a is None:
            return None
        if a.group is None:
            self.announce.event("adoption_refused", why=a.refused, from_generation=a.from_generation)
            return None
        self._probe_token, self.group = a.probe_token, a.group
        self._placer = a.group
        self.announce.adopted([i.pid for i in a.infos], a.step, a.from_generation)
        self._started(Starting(), a.infos, 0.0, time.time())
        return Running(a.epoch, a.start_step, dispatched_at=time.time())

    def _drop_adopted(self) -> None:
        """The run is complete: ranks a previous driver left have nothing to train."""
        if self.adoption is not None and self.adoption.group is not None:
            self.adoption.group.shutdown(graceful=False)
        self.adoption = None

    # ------------------------------------------------------------------ starting
    def _start(self, s: Starting) -> State:
        cfg = self.cfg
        target, minimum = cfg.scaling.num_workers, cfg.effective_min_workers
        t0 = time.time()
        group = self.group = self._new_group(s)
        self.announce.reserving(t0)
        try:
            # A stop asked while Ray has no room ends the run here; one asked when the group can start (a
            # backoff's, a signal at start-up) is acted on at its first step, with a checkpoint there.
            n = group.reserve(
                list(range(target, minimum - 1, -1)), cfg.scaling.resource_wait_s, self.control.stop_asked
            )
        except ResourcesUnavailableError as exc:
            self.announce.event("failed", reason=str(exc))
            return self._fail(exc)
        except StartCancelled as exc:
            return self._stop_unstarted(str(exc), s.salvage)
        t_reserved = time.time()
        self.announce.reserved(t_reserved)
        if n < target and s.move is None:  # a shrink for a drain is recorded with its own reason
            self.announce.shrunk(self.world_size or target, n)
            if self.quarantine.nodes:
                self.announce.print(f"[{cfg.name}] smaller: {self.quarantine.wait_note()}")
        infos = set_up(group, n, s.peers, self.skips, self._rollback)
        if isinstance(infos, Failure):
            return self._on_failure(infos)
        return self._started(s, infos, time.time() - t0, t_reserved)

    def _new_group(self, s: Starting) -> WorkerGroup:
        """The next gang (adopting what a failed or moved one kept), its workers told the storage probe's
        token (``Worker.setup`` checks it sees the driver's storage: storage visible only here fails at
        once; one token per driver) and the lease's generation (rank 0's commits check no newer one took
        the run over)."""
        if self._probe_token is None:
            self._probe_token = write_probe(self.storage)
        group_cfg = group_config(self.cfg, self._probe_token, self.lease)
        group = self._placer = self.group_factory(group_cfg, self.run_url, self.attempt)
        if self.quarantine.nodes:
            group.keep_off(self.quarantine.nodes)
        if s.salvage is not None:
            group.adopt(s.salvage)
        return group

    def _started(self, s: Starting, infos: list[SetupInfo], seconds: float, t_reserved: float) -> State:
        """The group is set up: take its position, record it, and train from where it resumed."""
        t_ready = time.time()
        head, r = infos[0], infos[0].resume
        self.epoch, self.global_step = r.epoch, r.global_step
        self.skips = merge_windows([*self.skips, *r.skipped_steps])  # a checkpoint's (an earlier driver's)
        self._rollback = None
        assert self.group is not None
        spare_note = self.group.spare_note
        self._spare_announced = False
        self._hang_memory.remember(self.world_size, self._hang_stats)  # the group it replaces
        self.world_size, self.steps_per_epoch = len(infos), head.steps_per_epoch
        self.moves.new_group(infos)
        memory = self._hang_memory
        self._hang_stats = HangStats(
            r.global_step, self.cfg.failures.hang_warmup_steps, memory.checkpoint_expected
        )
        if s.recovery is not None:
            s.recovery.group_started(t_reserved, t_ready, infos, r.global_step)
        self.announce.group_ready(self.attempt, infos, seconds, spare_note, self.skips, s.move, t_ready)
        return Running(r.epoch, r.step_in_epoch, recovery=s.recovery)

    # ------------------------------------------------------------------ training
    def _run_epoch(self, s: Running) -> State:
        assert self.group is not None
        group = self.group
        if s.dispatched_at is None:
            missing = self.record.eval_missing(
                s.epoch * self.steps_per_epoch + s.start_step, self.steps_per_epoch
            )
            group.run_epoch(s.epoch, s.start_step, evaluate_first=missing, seq=self.record.events.count)
        t_epoch = s.dispatched_at or time.time()
        watch = HangWatch(self.cfg.failures, self.global_step, self._hang_stats)
        while True:
            try:
                self._watch_control()  # here, not only between heartbeats: epochs may be shorter than those
                moving = isinstance(self.mode, Move)
                results = group.poll(self._poll_s(watch) if not moving else 0.25)
                if results is None:
                    self._watch_moves(running=True)
            except Exception as exc:
                self._drop_mode()  # a failure during a move: the next group acts on the notice again
                failure = group.classify(exc)
                watch.update(self._beats(timeout=0.5))  # survivors know how far training got
                return self._on_failure(failure, watch.max_step)
            if results is not None:
                wall_s = time.time() - t_epoch
                if results[0].early_stopped or self.mode is not None:
                    return self._halted(s, results[0], wall_s)
                self._watch_moves(running=False)  # epochs shorter than the heartbeat interval
                return self._epoch_done(s, results[0], wall_s)
            if self.lease is not None and self.lease.fenced_by is not None:
                self.lease.check()  # taken over: raises FencedError, the run ends without writing more
            hung = self._heartbeat(watch)
            if hung is not None:
                self.mode = None
                # before the group is killed; they tell the hung rank from the ranks waiting for it
                stacks = self._dump_stacks(f"hang: {hung[1]}", "hang", watch.max_step)
                source = watch.timeout_and_source()[1]
                failure = hang_failure(hung, stacks, watch.steps(), self.cfg.failures.warm_restart, source)
                return self._on_failure(failure, watch.max_step)

    def _heartbeat(self, watch: HangWatch) -> tuple[int, str] | None:
        """One heartbeat round while an epoch runs: rows, the hang watch, pace, the spare, the live bar."""
        beats = self._beats()
        hung = watch.update(beats)
        self._hang_memory.seed(self._hang_stats, self.world_size)  # after the group's first step
        self._seen_step = watch.max_step
        may_move = self.mode is None and not self.stopping
        self._apply(self.moves.pace(beats, watch.max_step, self.attempt, may_move, self.world_size))
        self._announce_spare()
        self.announce.live(beats, watch.max_step)
        return hung

    def _epoch_done(self, s: Running, head: EpochResult, wall_s: float) -> State:
        """Record the epoch; return what comes next. A next epoch is dispatched before the recording, so the
        workers train while this epoch's metrics, events and progress line are written."""
        assert self.group is not None
        self._hang_stats.rows(head.step_rows)  # the epoch's end checkpoint's stall
        next_state = self._after_epoch(head)
        limit = self.cfg.checkpoint.max_failed_commits  # reached: the next epoch is not dispatched
        if isinstance(next_state, Running) and not commits_would_fail(
            self.record.failed_in_a_row, head.commits, limit
        ):
            self.group.run_epoch(next_state.epoch, next_state.start_step, seq=self.record.events.count)
        self._record_epoch(head, wall_s, s.recovery)
        return self._commits_failing() or next_state

    def _after_epoch(self, head: EpochResult) -> State:
        cfg = self.cfg
        next_epoch = head.epoch + 1
        if next_epoch >= cfg.training.epochs:
            return Finishing(loss=head.loss)
        missing = cfg.scaling.num_workers - self.world_size
        if missing > 0 and self.group is not None and self.moves.room_for(self.group, missing):
            return Resizing(new_size=cfg.scaling.num_workers)
        return Running(next_epoch, 0, dispatched_at=time.time())

    def _record_epoch(self, head: EpochResult, wall_s: float, recovery: RecoveryTiming | None) -> None:
        self.global_step = head.global_step
        self._announce_spare()
        self.announce.epoch_ended(head, wall_s, self.world_size, self.attempt, self.steps_per_epoch, recovery)
        self.epoch = head.epoch + 1
        self._streak = 0

    def _record_stretch(
        self, head: EpochResult, wall_s: float, recovery: RecoveryTiming | None, whole: bool
    ) -> State | None:
        """What a halted group trained: its whole epoch (``whole``; returns the state an epoch's end leads
        to) or the stopped stretch of one (returns None)."""
        if whole:
            next_state = self._after_epoch(head)
            self._record_epoch(head, wall_s, recovery)
            return next_state
        self.announce.stretch_ended(head, self.attempt, recovery)
        self.global_step = head.global_step
        return None

    # ------------------------------------------------------------------ a group halted at a step
    def _halted(self, s: Running, head: EpochResult, wall_s: float) -> State:
        """The group's epoch ended while it had a mode, or early stopping ended the run: record what it
        trained and act on the mode (a stop, a grow, a move) or the early stop."""
        mode, self.mode = self.mode, None
        if head.early_stopped:
            if isinstance(mode, Move) and self.group is not None:
                self.group.cancel_move()  # the run ends here: nothing left to move
            if self.steps_per_epoch and head.global_step % self.steps_per_epoch == 0:
                self._record_epoch(head, wall_s, s.recovery)  # the evaluation ended a whole epoch
            else:
                self._record_stretch(head, wall_s, s.recovery, whole=False)
            self.stopped_early = True
            self.announce.early_stopped(head)
            return Finishing(loss=head.loss)
        if isinstance(mode, Move) and not mode.stopping:  # the move was still being prepared
            self.mode = mode
            return self._epoch_done(s, head, wall_s)
        if isinstance(mode, Move):
            return Moving(mode, [head], s.start_step, wall_s, s.recovery)
        next_state = self._record_stretch(head, wall_s, s.recovery, whole=not head.stopped)
        if isinstance(mode, Grow):
            return next_state if isinstance(next_state, Finishing) else Resizing(self.cfg.scaling.num_workers)
        if isinstance(next_state, Finishing):
            return next_state  # that was the last epoch: the run is done, not stopped
        assert self.group is not None
        self.announce.phase("checkpoint_stall")
        commits = self.group.finish()  # the stop's checkpoint is committed before the workers go
        self.announce.commits(commits)
        committed = any(c.step == head.global_step and not c.error for c in [*head.commits, *commits])
        return self._end_stopped(committed)

    def _finish(self, s: Finishing) -> State:
        assert self.group is not None
        self.announce.phase("checkpoint_stall")  # the final checkpoint's flush
        self.announce.commits(self.group.finish())
        if self.record.committed.get(self.global_step) is False:  # the final checkpoint did not commit
            store, error = self.folder.checkpoints, self.record.last_commit_error
            return self._fail(final_commit_failed(store, self.global_step, error))
        self.announce.finished(self.global_step, s.loss, self.attempt + 1)
        return Finished()

    def _commits_failing(self) -> Failed | None:
        """``checkpoint.max_failed_commits`` commits in a row failed: the run stops rather than train on
        with nothing durable."""
        limit, in_a_row = self.cfg.checkpoint.max_failed_commits, self.record.failed_in_a_row
        if in_a_row < limit:
            return None
        store = self.folder.checkpoints
        return self._fail(commits_failing(store, limit, in_a_row, self.record.last_commit_error))

    def _resize(self, s: Resizing) -> State:
        """Grow back at an epoch boundary: the epoch-end checkpoint is flushed, then a new gang starts."""
        assert self.group is not None
        self.announce.phase("starting")  # a grow: the new gang starts (and may wait for room)
        self.announce.commits(self.group.finish())
        self.announce.grown(self.world_size, s.new_size, self.global_step)
        self.group.shutdown(graceful=True)
        self.group = None
        self.attempt += 1
        return Starting()

    def _moved(self, s: Moving) -> State:
        """The group stopped for a move: record the steps trained, then start again without the draining
        ranks (replacements, or fewer ranks), or go on with the same ranks when neither is possible."""
        assert self.group is not None
        m, group, head = s.move, self.group, s.results[0]
        if m.stop_step is not None:  # an epoch that ended before the stop step stopped the group at its end
            m.stop_step = min(m.stop_step, head.global_step)
        commits = group.finish()  # the checkpoint the stop asked for is committed before anything goes
        next_state = self._record_stretch(head, s.wall_s, s.recovery, whole=not head.stopped)
        self.announce.phase("moves")
        if isinstance(next_state, Finishing | Resizing):
            self.announce.commits(commits)
            return next_state
        epoch, start = (head.epoch + 1, 0) if not head.stopped else (head.epoch, s.start_step + head.steps)
        self.announce.commits(commits)
        committed = any(c.step == head.global_step and not c.error for c in [*head.commits, *commits])
        if not m.replaced:
            self.announce.preemption_checkpoint(m, head.global_step, committed)
            survivors = self.world_size - len(m.ranks)
            if survivors < max(1, self.cfg.effective_min_workers):
                self.announce.print(
                    f"[{self.cfg.name}] continuing on all {self.world_size} ranks until the node goes "
                    f"(scaling.min_workers={self.cfg.effective_min_workers} rules out {survivors})"
                )
                return Running(epoch, start)
        keep = m.replaced and m.via == "peers"
        salvage = group.salvage(None, self.attempt + 1, leaving=m.ranks, keep_state=keep)
        self.group = None
        plan = move_plan(salvage, m)
        if salvage is None:
            group.shutdown(graceful=False)
        self.attempt += 1
        return Starting(salvage=salvage, peers=plan, move=m)

    # ------------------------------------------------------------------ requests (stop, stacks, profiles)
    def _dump_stacks(
        self, reason: str, kind: str, step: int | None, request: str | None = None
    ) -> dict[int, Any] | None:
        """``dump_stacks``; the stacks taken (rank -> threads, None: no answer), or None."""
        if self.group is None:
            return None
        return dump_stacks(
            self.group, self.record, reason, kind, step, self.attempt, self.moves.rank_hosts, request
        )

    def _stop_unstarted(self, why: str, salvage: Salvage | None) -> Stopped:
        """A stop asked before the group trained: nothing to checkpoint but what survivors of a failure hold
        in memory, which is lost (said, with the steps)."""
        self._drop_group()  # the adopted survivors too
        return self._end_stopped(False, f"{why}{unstarted_loss(self.folder.checkpoints, salvage)}")

    def _end_stopped(self, committed: bool, note: str | None = None) -> Stopped:
        req = self.control.stop
        assert req is not None
        self.announce.stopped(req.reason, req.requested_at, self.global_step, committed, note)
        self.control.clear_stop(self.storage)
        return Stopped()

    # ------------------------------------------------------------------ failures
    def _on_failure(self, failure: Failure, seen_step: int | None = None) -> Recovering:
        self.failures.append(failure)
        self._streak += 1
        self.announce.failure(failure, self.attempt, seen_step)
        if isinstance(self.state, Running):  # the ranks' nodes are known once a group is set up
            step = seen_step or self.global_step
            self.quarantine.failure(failure, step, self.moves.rank_nodes, self.moves.rank_hosts)
        timing = RecoveryTiming(failure.kind, time.time(), seen_step or self.global_step)
        return Recovering(failure, timing)

    def _recover(self, s: Recovering) -> State:
        failure, timing = s.failure, s.recovery
        if self.stopping:  # asked to stop: no restart, whatever the failure
            self.mode = None
            self._drop_group()
            self.announce.flush_rows([], self.epoch, self.attempt)  # the heartbeats' rows: nothing is lost
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
        self.announce.flush_rows(salvage.rows if salvage is not None else [], self.epoch, self.attempt)
        if failure.kind == "replica_mismatch":  # no checkpoint after the last agreeing check is used again
            hosts, nodes = self.moves.rank_hosts, self.moves.rank_nodes
            store = self.folder.checkpoints  # fenced by the lease (``_run``)
            after_mismatch(failure, store, self.cfg, self.announce.event, hosts, nodes, self.quarantine)
        plan = peer_plan(self.cfg, failure, salvage, timing) if decision.restart else None
        window = rollback_window(self.cfg, failure) if decision.restart else None
        if window is not None:
            self._rollback = window
            self.skips = merge_windows([*self.skips, window])
        self.announce.decision(decision, plan, timing.fallback, window)
        if not decision.restart:
            detail = failure.error.traceback if failure.error is not None else failure.message
            advice = resume_advice(self.folder.checkpoints)
            return self._fail(
                TrainingFailedError(
                    f"{decision.reason}. {advice}\nLast failure ({failure.kind}, rank "
                    f"{failure.rank}):\n{detail}"
                )
            )
        wake = time.monotonic() + decision.delay_s
        while time.monotonic() < wake and not self.control.stop_asked():  # a stop cuts the wait short
            time.sleep(min(0.5, max(0.0, wake - time.monotonic())))
        self.attempt += 1
        return Starting(recovery=timing, salvage=salvage, peers=plan)

    def _room_without(self, node: str) -> bool:
        """Whether the run fits without ``node`` and the nodes already out (``scaling.min_workers`` ranks),
        asked of the current group, or of the last one while a failed group is torn down."""
        group = self.group or self._placer
        need = max(1, self.cfg.effective_min_workers)
        return group is not None and group.room_without([*self.quarantine.nodes, node], need)

    def _keep_off(self, nodes: list[str]) -> None:
        """A node was quarantined: the current group places nothing more there (``WorkerGroup.keep_off``)."""
        if self.group is not None:
            self.group.keep_off(nodes)

    def _drop_group(self) -> None:
        """Kill the group's workers (no checkpoint flushed): the run ends, or stops before training."""
        if self.group is not None:
            self.group.shutdown(graceful=False)
            self.group = None

    def _fail(self, exc: BaseException) -> Failed:
        self._record_failed(exc)
        return Failed(exc)

    # ------------------------------------------------------------------ helpers
    def _beats(self, timeout: float = 2.0) -> list[Any]:
        """One heartbeat round; keeps the step rows rank 0 streams with it."""
        assert self.group is not None
        beats = self.group.heartbeats(timeout=timeout)
        self.announce.heartbeat(beats, self.epoch, self.attempt)
        return beats

    def _announce_spare(self) -> None:
        """One ``spare_ready`` event per group, once its hot spare is prepared: from then on a dead rank is
        replaced without starting a process. Checked at each heartbeat and each epoch end."""
        if self._spare_announced or self.group is None:
            return
        prepare_s = self.group.spare_ready()
        if prepare_s is not None:
            self._spare_announced = True
            self.announce.spare_ready(self.attempt, prepare_s)

    def _poll_s(self, watch: HangWatch) -> float:
        """Seconds between heartbeats (``HangWatch.heartbeat_every``), a terminal's live bar's or not."""
        assert self.record.display is not None
        return watch.heartbeat_every(self.poll_s, self.record.display.tty)
