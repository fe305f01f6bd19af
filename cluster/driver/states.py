"""The driver's states. Each carries the data its step needs (a Recovering state holds the failure that
caused it); :meth:`cluster.driver.driver.Driver._step` takes one and returns the next::

    Starting --> Running --(epoch done)--> Running | Resizing --> Starting | Finishing --> Finished
        |           |  |
        |           |  +--(drain notice, stopped at a step)--> Moving --> Starting | Running
        |           +--(stop asked for: Ctrl-C, ray job stop, python -m cluster stop)--> Stopped
        +-----------+--(failure)--> Recovering --> Starting | Failed | Stopped (a stop was asked for)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cluster.core.errors import Failure
from cluster.seam.peers import PeerPlan
from cluster.seam.preemption import Move
from cluster.seam.protocol import EpochResult, Salvage, SetupInfo


@dataclass(frozen=True)
class Stop:
    """The group's mode while a stop asked for takes effect: every rank stops after ``step`` with a
    checkpoint there."""

    step: int


@dataclass(frozen=True)
class Grow:
    """The group's mode while it stops (after ``step``, with a checkpoint there) to start again larger."""

    step: int


Mode = Stop | Grow | Move | None
"""What a running group is doing besides training: nothing, stopping, stopping to grow, or moving ranks."""


class State:
    """A state of the driver. Each carries what its step needs; ``Driver._step`` returns the next one."""

    name: ClassVar[str]
    is_terminal: ClassVar[bool] = False

    def describe(self) -> str:
        return self.name


@dataclass
class RecoveryTiming:
    """The phases of one recovery, from the failure's detection to the first step after it (the
    ``recovered`` event). Filled in as the recovery goes through Recovering, Starting and Running."""

    kind: str
    t_detect: float
    seen_step: int
    """The highest step any rank had reached when the failure was seen."""
    t_teardown: float = 0.0
    reused_workers: int = 0
    spare: str | None = None
    """The hot spare's state when it took the dead rank's place ("prepared", "preparing"); else None."""
    t_reserved: float = 0.0
    t_ready: float = 0.0
    resume_step: int = 0
    actors_s: float = 0.0
    connect_s: float = 0.0
    """The slowest rank's connect to rank 0's rendezvous store (part of ``actors_s``)."""
    rendezvous_s: float = 0.0
    task_s: float = 0.0
    ddp_s: float = 0.0
    checkpoint_load_s: float = 0.0
    source: str = "checkpoint"
    """Where the state came from: ``peers`` (a survivor's memory) or ``checkpoint`` (storage)."""
    fallback: str = ""
    """Why the survivors' state was not used (empty on the peer path, or when recover_from_peers is off)."""
    nbytes: int = 0
    """Bytes of state moved to the ranks: received from the peer, or read from storage (all ranks)."""
    transfer_s: float = 0.0
    """Seconds of the slowest rank's state transfer: the broadcast from the peer, or the checkpoint load."""
    storage_reads: int = 0
    """Files the ranks read from storage while starting (0 on the peer path)."""
    storage_read_bytes: int = 0

    def group_started(
        self, t_reserved: float, t_ready: float, infos: list[SetupInfo], resume_step: int
    ) -> None:
        self.t_reserved, self.t_ready, self.resume_step = t_reserved, t_ready, resume_step
        self.actors_s = max(i.timings["start"] for i in infos) - t_reserved
        self.connect_s = max(
            (i.timings["connected"] - i.timings["connect"] for i in infos if "connect" in i.timings),
            default=0.0,
        )
        self.rendezvous_s = max(i.timings["process_group"] - i.timings["start"] for i in infos)
        self.task_s = max(i.timings["task"] - i.timings["process_group"] for i in infos)
        before_ddp = "peer_transfer" if "peer_transfer" in infos[0].timings else "task"
        self.ddp_s = max(i.timings["ddp"] - i.timings[before_ddp] for i in infos)
        self.checkpoint_load_s = max(
            i.timings.get("checkpoint_load", i.timings["ddp"]) - i.timings["ddp"] for i in infos
        )
        self.source = infos[0].resume.source
        self.nbytes = sum(i.resume.nbytes for i in infos)
        receivers = [i for i in infos if i.rank != i.resume.peer_source] or infos
        self.transfer_s = max(i.resume.transfer_s for i in receivers)  # the source's includes its wait
        self.storage_reads = sum(i.storage_reads for i in infos)
        self.storage_read_bytes = sum(i.storage_read_bytes for i in infos)

    @property
    def lost_steps(self) -> int:
        return max(0, self.seen_step - self.resume_step)

    def phases(self, first_step_at: float) -> dict[str, float]:
        return {
            "detect_to_teardown_s": self.t_teardown - self.t_detect,
            "reserve_s": self.t_reserved - self.t_teardown,
            "start_and_load_s": self.t_ready - self.t_reserved,
            "actors_s": self.actors_s,
            "connect_s": self.connect_s,
            "rendezvous_s": self.rendezvous_s,
            "task_s": self.task_s,
            "ddp_s": self.ddp_s,
            "checkpoint_load_s": self.checkpoint_load_s,
            "transfer_s": self.transfer_s,
            "first_step_s": first_step_at - self.t_ready,
            "detect_to_first_step_s": first_step_at - self.t_detect,
        }


@dataclass(frozen=True)
class Starting(State):
    """Reserve resources and start a gang: the first one, after a failure, or a larger one."""

    name: ClassVar[str] = "starting"
    recovery: RecoveryTiming | None = None
    salvage: Salvage | None = None
    """Workers kept from the failed group, for a warm restart."""
    peers: PeerPlan | None = None
    """Take the state from this survivor over the new process group instead of from a checkpoint."""
    move: Move | None = None
    """Set when this start retires the ranks of a draining node (recorded as ``preemption_move``)."""

    def describe(self) -> str:
        if self.peers is not None:
            return f"starting from rank {self.peers.source}'s state at step {self.peers.global_step}"
        return "starting from the latest checkpoint" if self.recovery is not None else "starting"


@dataclass(frozen=True)
class Running(State):
    """The gang trains ``epoch`` from ``start_step``; the driver watches its heartbeats."""

    name: ClassVar[str] = "running"
    epoch: int
    start_step: int
    dispatched_at: float | None = None
    """When the previous epoch's handler already dispatched this epoch (workers do not wait for the driver
    between epochs); None when this step must dispatch it."""
    recovery: RecoveryTiming | None = None
    """Set until the first epoch after a recovery completes and its ``recovered`` event is written."""

    def describe(self) -> str:
        return f"running epoch {self.epoch} from step {self.start_step}"


@dataclass(frozen=True)
class Recovering(State):
    """A failure was seen: decide (restart or give up), salvage what can be kept, tear down the rest."""

    name: ClassVar[str] = "recovering"
    failure: Failure
    recovery: RecoveryTiming

    def describe(self) -> str:
        return f"recovering from {self.failure.kind} (rank {self.failure.rank})"


@dataclass(frozen=True)
class Moving(State):
    """Every rank stopped at one step boundary because of a drain notice: retire the draining ranks (their
    replacements take over, or the group shrinks), or go on with the same ranks when neither is possible."""

    name: ClassVar[str] = "moving"
    move: Move
    results: list[EpochResult]
    start_step: int
    wall_s: float
    recovery: RecoveryTiming | None = None
    """Carried from Running: the recovery whose first training this stretch was."""

    def describe(self) -> str:
        return f"moving ranks {self.move.ranks} off draining node(s) at step {self.move.stop_step}"


@dataclass(frozen=True)
class Resizing(State):
    """At an epoch boundary, resources for more workers returned: flush, stop this gang, start a larger
    one."""

    name: ClassVar[str] = "resizing"
    new_size: int


@dataclass(frozen=True)
class Finishing(State):
    """The last epoch is done: flush the last checkpoint and record the end."""

    name: ClassVar[str] = "finishing"
    loss: float


@dataclass(frozen=True)
class Finished(State):
    name: ClassVar[str] = "finished"
    is_terminal: ClassVar[bool] = True


@dataclass(frozen=True)
class Stopped(State):
    """Stopped before the end because someone asked (``Driver.request_stop``); resubmitting resumes."""

    name: ClassVar[str] = "stopped"
    is_terminal: ClassVar[bool] = True


@dataclass(frozen=True)
class Failed(State):
    name: ClassVar[str] = "failed"
    is_terminal: ClassVar[bool] = True
    error: BaseException
