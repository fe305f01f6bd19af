"""What the driver announces, and who listens: the seam between running a job and recording it.

The driver says once what happened (a state transition, a decision, something a group reported) to its
:class:`Announcer` (``Driver.announce``), which hands the announcement to each listener in the order they were
added, as Ray Train V2's controller callbacks (``after_controller_state_update``) do. The run's record
(:class:`cluster.driver.record.RunRecord`) is the first listener: it turns each announcement into the events,
console lines, metric rows and tracking it writes, so the driver reads as decisions only. Another listener
(a test's, a dashboard's) subclasses :class:`DriverListener` and overrides only what it cares about; a
listener that raises ends the run as the record's own errors do (a StorageError, a FencedError).

A few reads and set-ups still go to the record directly (``Driver.record``), none of them a recording:

- setting the record up: ``open`` (the run's files), ``t0`` (the goodput ledger's start), the event log's
  fence (the lease's check);
- what the record knows that the driver decides on: ``failed_in_a_row`` and ``last_commit_error`` (commits
  failing), ``committed`` (whether the final checkpoint committed), ``events.count`` (where the workers'
  event numbers start), ``eval_missing`` (an evaluation due at the resume step), ``display`` (a terminal's
  live bar sets the heartbeat's pace), and the driver's ``events`` / ``out`` accessors;
- the request helpers (``cluster.driver.control``: stacks, profiles), which write files with the record's
  storage besides their events, take the record itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.core.errors import Failure
    from cluster.driver.policy import Decision, SlowRank
    from cluster.driver.states import RecoveryTiming, State
    from cluster.run.checkpoint import CommitRecord
    from cluster.run.lease import Lease
    from cluster.seam.peers import PeerPlan
    from cluster.seam.preemption import Move
    from cluster.seam.protocol import EpochResult, SetupInfo
    from cluster.spec.schedule import Window


class DriverListener:
    """Every announcement the driver (and its move watch) makes; each a no-op here, so a listener subclassing
    this overrides only the ones it needs."""

    # ------------------------------------------------------------------ the run
    def state_changed(self, previous: State, current: State) -> None:
        """``Driver._transition``: the state machine moved (the record writes nothing for it)."""

    def run_start(self, attempt: int, lease: Lease) -> None:
        """The run's lease is held and its storage prepared: the run begins."""

    def already_complete(self, global_step: int, early_stopped: bool) -> None:
        """Before any worker starts: the newest verified checkpoint covers the whole run."""

    def run_ended(self, status: str, finished: bool) -> None:
        """The run reached a terminal state (``status``) and its workers are gone."""

    def run_failed(self, exc: BaseException) -> None:
        """The run fails with ``exc``."""

    def print(self, text: str) -> None:
        """A console line the driver (or its lease) says."""

    def event(self, kind: str, /, **fields: Any) -> None:
        """An event a helper decides on by itself (quarantine, a replica rollback, resources missing)."""

    def phase(self, name: str) -> None:
        """Where the run's time goes from now on (``cluster.run.goodput``: the ledger's phases)."""

    # ------------------------------------------------------------------ starting
    def adopted(self, pids: list[int], step: int, from_generation: int) -> None:
        """The ranks a previous driver left running (``pids``, at ``step``) were adopted; their group's
        ``group_ready`` follows."""

    def reserving(self, at: float) -> None:
        """A new group asks for room."""

    def reserved(self, at: float) -> None:
        """The group's room is reserved."""

    def shrunk(self, old: int, new: int) -> None:
        """The group starts with fewer workers than asked for."""

    def group_ready(
        self,
        attempt: int,
        infos: list[SetupInfo],
        seconds: float,
        spare_note: str,
        skips: list[Window],
        move: Move | None,
        t_ready: float,
    ) -> None:
        """A group is set up and loaded (``infos``: by rank); it resumed where ``infos[0].resume`` says, and
        ``move`` is the move it finished, if any."""

    # ------------------------------------------------------------------ training
    def heartbeat(self, beats: list[Any], epoch: int, attempt: int) -> None:
        """One heartbeat round (with the step rows rank 0 streams)."""

    def live(self, beats: list[Any], step: int) -> None:
        """The step the group reached at a heartbeat."""

    def spare_ready(self, attempt: int, prepare_s: float) -> None:
        """The group's hot spare is prepared."""

    def epoch_ended(
        self,
        head: EpochResult,
        wall_s: float,
        world_size: int,
        attempt: int,
        steps_per_epoch: int,
        recovery: RecoveryTiming | None,
    ) -> None:
        """A whole epoch trained (the first after a recovery with its ``recovery`` timing)."""

    def stretch_ended(self, head: EpochResult, attempt: int, recovery: RecoveryTiming | None) -> None:
        """A group halted mid-epoch: what it trained until then."""

    def commits(self, commits: list[CommitRecord]) -> None:
        """Checkpoint commits the group reported at its finish."""

    def early_stopped(self, head: EpochResult) -> None:
        """Early stopping ends the run at ``head``."""

    def finished(self, global_step: int, loss: float, attempts: int) -> None:
        """The run trained every epoch and its final checkpoint committed."""

    # ------------------------------------------------------------------ modes: stops, grows, moves
    def stop_requested(self, reason: str, stop_step: int, grace: str) -> None:
        """A stop was asked for: the group stops at ``stop_step``."""

    def stopped(
        self, reason: str, requested_at: float, global_step: int, committed: bool, note: str | None
    ) -> None:
        """The run stopped as asked."""

    def grown(self, old: int, new: int, at_step: int) -> None:
        """Room returned: the group restarts bigger at an epoch boundary."""

    def preemption_notice(self, m: Move, now: float, step: int) -> None:
        """Nodes of the group are to be drained."""

    def preemption_checkpoint(self, m: Move, step: int, committed: bool) -> None:
        """A move without replacements stopped the group with a checkpoint."""

    def slow_rank(self, r: SlowRank, host: str, step: int, attempt: int) -> None:
        """A rank holds the others up."""

    def slow_rank_cleared(self, rank: int, host: str, step: int, attempt: int) -> None:
        """A slow rank no longer holds the others up."""

    def slow_rank_move(self, rank: int, host: str, node: str, step: int, via: str) -> None:
        """A slow rank is to be moved to another node."""

    def slow_rank_move_failed(self, ranks: list[int], why: str) -> None:
        """A slow rank's move was given up."""

    # ------------------------------------------------------------------ failures and recovery
    def failure(self, failure: Failure, attempt: int, step: int | None) -> None:
        """The group failed."""

    def flush_rows(self, more: list[dict[str, Any]], epoch: int, attempt: int) -> None:
        """After a failure, the step rows logged before it (``more``: the survivors')."""

    def decision(
        self, decision: Decision, plan: PeerPlan | None, fallback: str, rollback: Window | None = None
    ) -> None:
        """What the failure policy decided, and where a restart's state comes from."""


class Announcer(DriverListener):
    """Hands each announcement to every listener, in the order they were added (module doc). Each
    announcement of :class:`DriverListener` is an attribute of its own here, made once, so
    ``announce.failure(...)`` is typed by the listener's signature and costs one call per listener."""

    def __init__(self, *listeners: DriverListener) -> None:
        self.listeners = list(listeners)
        for name in ANNOUNCEMENTS:
            setattr(self, name, self._fan_out(name))

    def add(self, listener: DriverListener) -> None:
        self.listeners.append(listener)

    def _fan_out(self, name: str) -> Callable[..., None]:
        def fan_out(*args: Any, **fields: Any) -> None:
            for listener in self.listeners:
                getattr(listener, name)(*args, **fields)

        fan_out.__name__ = name
        return fan_out


ANNOUNCEMENTS = tuple(n for n, f in vars(DriverListener).items() if callable(f) and not n.startswith("_"))
"""The names of the announcements."""
