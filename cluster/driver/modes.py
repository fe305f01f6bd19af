"""What changes a running group's mode (``cluster.driver.states.Mode``), the part of the driver that watches
while the ranks train: drain notices, slow ranks and room to grow back (decided by
``cluster.driver.moves.MoveWatch``, carried out here), and a stop asked for (``cluster.driver.control``).
Each halts the group at a step boundary; what happens then is the state machine's (``Driver._halted``,
``Driver._moved``).

:class:`GroupModes` is a base of :class:`cluster.driver.driver.Driver`, on the driver's own fields (named
below): it keeps the decisions on modes in one place, apart from the states' steps.
"""

from __future__ import annotations

from cluster.driver.control import RunControl, answer_requests, grace_note
from cluster.driver.listeners import DriverListener
from cluster.driver.moves import Decision, MoveWatch, carry_out
from cluster.driver.record import RunRecord
from cluster.driver.states import Grow, Mode, Stop
from cluster.run.quarantine import Quarantine
from cluster.seam.preemption import Move
from cluster.seam.protocol import WorkerGroup


class GroupModes:
    """The mode of the live group: watched at heartbeats and epoch ends, changed only here (and cleared by
    the state machine when the group halts or fails)."""

    group: WorkerGroup | None
    mode: Mode
    moves: MoveWatch
    control: RunControl
    record: RunRecord
    announce: DriverListener
    quarantine: Quarantine
    world_size: int
    global_step: int
    attempt: int
    _seen_step: int

    @property
    def stopping(self) -> bool:
        """A stop was asked for (a second signal then stops at once)."""
        return self.control.stop is not None

    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary, every rank at the same one, with a checkpoint there; the run ends
        with status ``stopped`` and a resubmission resumes from that checkpoint exactly. Only sets a field:
        safe to call from a signal handler (the loop acts on it at its next heartbeat) or another thread."""
        self.control.request_stop(reason)

    def _watch_moves(self, running: bool) -> None:
        """Drain notices and a move in progress; while an epoch runs, room to grow back."""
        if self.group is None or self.stopping:
            return  # (a stop asked for checkpoints every rank's state anyway)
        self._apply(self.moves.drains(self.group, self.mode, running, self.world_size, self.global_step))
        if running and self.mode is None:
            self._apply(self.moves.grow(self.group, self.world_size))

    def _apply(self, d: Decision | None) -> None:
        """Carry out a decision of the move watch on the group (``cluster.driver.moves.carry_out``)."""
        if d is not None and self.group is not None:
            self.mode = carry_out(d, self.group, self.mode, self._slow_move)

    def _slow_move(self, m: Move) -> None:
        """A slow rank is moved: an incident of the node it leaves."""
        nodes, hosts = self.moves.rank_nodes, self.moves.rank_hosts
        self.quarantine.ranks("slow_rank_move", m.ranks, self._step_seen(), nodes, hosts)

    def _drop_mode(self) -> None:
        if isinstance(self.mode, Move):
            self.moves.forget(self.mode)
        self.mode = None

    def _watch_control(self) -> None:
        """While an epoch runs: answer stacks and profile requests, and act on a stop asked for: every rank
        stops at the same step boundary with a checkpoint there (``WorkerGroup.stop``). A grow already
        stopping the group with a checkpoint serves as the stop; a move that is stopping it is let finish
        (the stop is acted on once the moved group trains), one still preparing is dropped."""
        assert self.group is not None
        hosts, step = self.moves.rank_hosts, self._step_seen()
        answer_requests(self.control, self.group, self.record, self.world_size, step, self.attempt, hosts)
        req = self.control.stop
        if req is None or isinstance(self.mode, Stop):
            return
        if isinstance(self.mode, Move):
            if self.mode.stopping:
                return
            self.group.cancel_move()
            self._drop_mode()
        step = self.mode.step if isinstance(self.mode, Grow) else self.group.stop(checkpoint=True)
        self.mode = Stop(step)
        self.announce.stop_requested(req.reason, step, grace_note(req.reason))

    def _step_seen(self) -> int:
        return max(self.global_step, self._seen_step)
