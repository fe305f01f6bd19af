"""The seam between the driver and a gang of workers: what the driver calls, and the typed objects that
cross it. :class:`cluster.worker_group.RayWorkerGroup` implements it on Ray; the driver's unit tests
implement it with a script (``tests/unit/test_driver.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.checkpoint import CommitRecord
from cluster.config import JobConfig, Window
from cluster.errors import Failure
from cluster.peer import PeerPlan, PeerState
from cluster.preemption import DrainNotice
from cluster.worker import EpochResult, Heartbeat, SetupInfo


@dataclass(frozen=True)
class Salvage:
    """Healthy, idle workers kept from a failed group for a warm restart, with the resources they hold.

    ``resources`` and the values of ``actors`` are opaque handles of the group that made them (a Ray
    placement group and actor handles); only a group of the same kind adopts them."""

    resources: Any
    actors: dict[int, Any]
    """rank -> worker, already reset to that rank of the next group."""
    peers: dict[int, PeerState] | None = None
    """rank -> what that survivor kept in memory (``failures.recover_from_peers``); None when off."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """Rank 0's step rows that had not reached the driver when the group failed."""
    spare: str | None = None
    """The hot spare's state when it took a dead rank's place: "prepared" or "preparing"; else None."""

    @property
    def count(self) -> int:
        return len(self.actors)


class StartCancelled(Exception):
    """A group's start was given up because the run was asked to stop (``WorkerGroup.reserve``)."""


class WorkerGroup(Protocol):
    """What the driver needs from a gang of workers."""

    world_size: int
    spare_note: str
    """The hot spare's state after start(): "off", "off: <why>", "preparing"."""

    def reserve(self, sizes: list[int], wait_s: float, cancelled: Callable[[], bool] | None = None) -> int:
        """Reserve resources for ``sizes[0]`` workers, or failing that the largest of the smaller sizes;
        return how many. Raises ResourcesUnavailableError, or StartCancelled once ``cancelled()`` is true
        (asked about while it waits)."""
        ...

    def start(
        self,
        world_size: int,
        peers: PeerPlan | None = None,
        skips: list[Window] | None = None,
        rollback: Window | None = None,
    ) -> list[SetupInfo]:
        """Start (or adopt) the workers, rendezvous, set up every rank; one SetupInfo per rank, rank order.
        With a peer plan, rank ``peers.source`` sends its state to the others instead of a checkpoint load.
        ``skips`` and ``rollback``: ``Worker.setup``'s."""
        ...

    def run_epoch(self, epoch: int, start_step: int, evaluate_first: bool = False) -> None:
        """Dispatch an epoch to every rank and return at once; ``poll`` collects it. ``evaluate_first``:
        evaluate before the first step (the evaluation due there was lost with a failure)."""
        ...

    def poll(self, timeout: float) -> list[EpochResult] | None:
        """Every rank's result once the epoch is done; None while it runs; raises on the first failure."""
        ...

    def heartbeats(self, timeout: float = 2.0) -> list[Heartbeat | None]:
        """One heartbeat per rank (None for a rank that did not answer within ``timeout``)."""
        ...

    def finish(self) -> list[CommitRecord]:
        """Flush rank 0's checkpoint in flight; the commits not yet reported."""
        ...

    def profile(self, req_id: str, steps: int, ranks: list[int], folder: str) -> None:
        """Ask ``ranks`` to profile their next ``steps`` training steps into ``<run>/<folder>/``."""
        ...

    def stacks(self, timeout: float = 5.0) -> list[list[dict[str, Any]] | None]:
        """Each rank's thread stacks as plain data (``cluster.stacks.to_wire``); None for a rank that did
        not answer within ``timeout``."""
        ...

    def spare_ready(self) -> float | None:
        """Seconds the hot spare took to prepare, once it has; None before or without one."""
        ...

    def classify(self, exc: BaseException) -> Failure:
        """Turn the first error seen into a Failure naming its root cause and rank."""
        ...

    def available_for(self, n: int) -> bool:
        """Whether the cluster has free resources for ``n`` more workers now."""
        ...

    def salvage(self, failure: Failure, attempt: int) -> Salvage | None:
        """Keep what can serve a warm restart, kill the rest; None when nothing is kept."""
        ...

    def adopt(self, salvage: Salvage) -> None:
        """Take over a previous group's salvaged workers and resources (before ``reserve``)."""
        ...

    def stop(self, checkpoint: bool) -> int:
        """Stop every rank at the same step boundary of the running epoch (rank 0 checkpoints there when
        ``checkpoint``); return the step. ``poll`` then returns results with ``stopped`` set (or the whole
        epoch, had it ended first)."""
        ...

    def draining(self) -> list[DrainNotice]:
        """The drain notices (spot preemption) for nodes that hold ranks of this group."""
        ...

    def prepare_move(self, ranks: list[int], avoid: list[str] | None = None) -> None:
        """Start placing and preparing replacements for ``ranks`` on nodes that are not draining and not in
        ``avoid`` (node ids)."""
        ...

    def move_status(self) -> str:
        """``placing``, ``preparing``, ``ready`` or ``failed: <why>`` for the move in progress."""
        ...

    def move_nodes(self) -> list[str]:
        """The nodes the replacements of the move in progress run on, in the order of its ranks."""
        ...

    def cancel_move(self) -> None:
        """Give up the move in progress: stop its replacements, release their resources."""
        ...

    def salvage_stopped(self, attempt: int, retire: list[int], keep_state: bool) -> Salvage | None:
        """After ``stop``: keep every rank but ``retire`` (with its state when ``keep_state``), the move's
        replacements taking the retired ranks; without a ready move the others are renumbered 0..K-1."""
        ...

    def shutdown(self, graceful: bool) -> None:
        """Stop every worker; graceful destroys process groups first, otherwise kill at once."""
        ...


GroupFactory = Callable[[JobConfig, str, int], WorkerGroup]
"""(config, run URL, attempt) -> a new, empty group."""
