"""The seam between the driver and a gang of workers: what the driver calls, and the typed objects that
cross it. :class:`cluster.worker_group.RayWorkerGroup` (the package ``cluster/worker_group/``) implements
it on Ray; the driver's unit tests
implement it with a script (``tests/unit/test_driver.py``)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.core.errors import Failure
from cluster.run.checkpoint import CommitRecord
from cluster.seam.peers import PeerPlan, PeerState
from cluster.seam.preemption import DrainNotice
from cluster.spec.config import JobConfig
from cluster.spec.schedule import Window


@dataclass(frozen=True)
class ResumePoint:
    global_step: int
    epoch: int
    step_in_epoch: int
    checkpoint_url: str | None
    """The checkpoint loaded (its step folder), or None for a fresh start."""
    world_size: int | None = None
    """The world size of the group that wrote that checkpoint."""
    source: str = "fresh"
    """Where the state came from: ``fresh``, ``checkpoint`` (storage) or ``peers`` (a survivor's memory)."""
    peer_source: int | None = None
    """The rank that sent the state (``peers`` only)."""
    nbytes: int = 0
    """Bytes of state this rank received (from storage or from a peer); 0 for the peer that sent it."""
    transfer_s: float = 0.0
    """Seconds the state took to arrive (checkpoint read and load, or the broadcast from the peer)."""
    init_from: dict[str, Any] | None = None
    """A fresh start's weights from another run (``training.init_from``): its checkpoint's ``url`` and
    ``step``, how many tensors were ``loaded``, and the names that ``kept_init`` (``init_strict=false``)."""
    skipped_steps: list[Window] = field(default_factory=list)
    """Every window of steps the run skips from here on (the driver's and the checkpoint's)."""
    rollback: dict[str, Any] | None = None
    """A restart after a NaN loss: the ``window`` asked to be skipped, the ``checkpoint_step`` resumed from
    (None: the run's start), and the newer checkpoints ``discarded`` (they trained the skipped batches)."""


@dataclass
class SetupInfo:
    """What a rank reports once it is set up and ready to train."""

    rank: int
    world_size: int
    hostname: str
    pid: int
    backend: str
    steps_per_epoch: int
    resume: ResumePoint
    skipped_checkpoints: list[tuple[int, str]]
    timings: dict[str, float]
    """Unix time at the end of each setup phase, in order: start, process_group, task, then ddp and
    checkpoint_load (from storage) or peer_transfer and ddp (from peers), then ready."""
    node_id: str = ""
    """The Ray node the rank runs on (filled in by the Ray worker group)."""
    allocator: str = "system"
    """``tuned`` where scaling.tune_allocator took effect, else ``system`` or why not."""
    niceness: str = ""
    """The rank's scheduling niceness after scaling.worker_niceness, or why it could not be set."""
    storage_reads: int = 0
    """Files this rank read from the run's storage during setup (manifests and checkpoint files)."""
    storage_read_bytes: int = 0
    eval_batches: int = 0
    """Batches of one evaluation, all ranks together (0: the task has no eval set)."""


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
    input_wait_s: float = 0.0
    """Seconds rank 0 waited for its batches in the epoch's steps (the goodput ledger's input stall)."""
    commits: list[CommitRecord] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """This rank's mean over the epoch's steps of each extra metric ``Task.compute_loss`` returned."""
    skipped: int = 0
    """Steps of the epoch whose batches were skipped (``training.skip_steps``, NaN rollbacks): not in
    ``steps``."""
    stopped: bool = False
    """The driver stopped the epoch before its end (``Worker.stop_at``); ``global_step`` is where."""
    early_stopped: bool = False
    """Early stopping (``evaluation.patience``) ended the run at ``global_step``, checkpointed there."""
    best: dict[str, Any] | None = None
    """With ``early_stopped``: the best evaluation (``TrainState.best_eval``)."""


@dataclass(frozen=True)
class Pace:
    """A rank's steps since its previous heartbeat: medians, so that a checkpoint or a log step does not
    skew them."""

    compute_s: float
    """Step start to this rank's last gradient: the part of the step that is its own."""
    step_s: float
    """The whole step, waits for the other ranks included."""
    steps: int
    input_s: float = 0.0
    """Of ``compute_s``, the host's wait for the step's batches (the input pipeline's share)."""


@dataclass(frozen=True)
class Heartbeat:
    """A rank's progress as the driver's hang watch sees it."""

    rank: int
    global_step: int
    last_step_at: float
    max_step_time_s: float
    in_epoch: bool
    rows: list[dict[str, Any]] = field(default_factory=list)
    """Rank 0's per-step metric rows logged since its previous heartbeat (streamed, so that a failure loses
    none of them); empty on other ranks."""
    pace: Pace | None = None
    """This rank's steps since its previous heartbeat (None when it took none): how long its own part took."""
    eval_batches: int = 0
    """Eval batches this process has evaluated: progress while an evaluation runs and no step does."""
    first_step_at: float | None = None
    """When this rank finished its group's first step (None before it): where the group began to train."""


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

    def run_epoch(self, epoch: int, start_step: int, evaluate_first: bool = False, seq: int = 0) -> None:
        """Dispatch an epoch to every rank and return at once; ``poll`` collects it. ``evaluate_first``:
        evaluate before the first step (the evaluation due there was lost with a failure). ``seq``: the
        run's event count now (``Worker.run_epoch``'s)."""
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
        """Each rank's thread stacks as plain data (``cluster.core.stacks.to_wire``); None for a rank that did
        not answer within ``timeout``."""
        ...

    def spare_ready(self) -> float | None:
        """Seconds the hot spare took to prepare, once it has; None before or without one."""
        ...

    def classify(self, exc: BaseException, starting: bool = False) -> Failure:
        """Turn the first error seen into a Failure naming its root cause and rank. With ``starting`` (the
        error came out of ``start``), an error that did not come from the workers' runtime (a timeout
        waiting for the ranks, a refused GPU assignment) is ``start_failed``."""
        ...

    def available_for(self, n: int) -> bool:
        """Whether the cluster has free resources for ``n`` more workers now."""
        ...

    def room_without(self, nodes: list[str], n: int) -> bool:
        """Whether the cluster could hold ``n`` ranks of this group with none on ``nodes``: the capacity of
        every other live node, busy or not (asked before a node is quarantined: never the last room)."""
        ...

    def keep_off(self, nodes: list[str]) -> None:
        """Place no rank on these (quarantined) nodes from now on: new bundles avoid them, a salvage
        re-places the ranks still there (``cluster.run.quarantine``). Called only once a node is
        quarantined."""
        ...

    def salvage(
        self,
        failure: Failure | None,
        attempt: int,
        *,
        leaving: Collection[int] = (),
        keep_state: bool | None = None,
    ) -> Salvage | None:
        """Keep what can serve the next group (attempt ``attempt``), kill the rest; None when nothing is
        kept. After a ``failure``: the survivors keep their ranks (with their state in memory when
        ``keep_state``, by default ``failures.recover_from_peers``), the hot spare may take a dead rank's
        place. After ``stop`` (``failure`` None): every rank but ``leaving`` is kept (with its state when
        ``keep_state``), the move's replacements taking the leaving ranks; without a ready move the others
        are renumbered 0..K-1."""
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

    def shutdown(self, graceful: bool) -> None:
        """Stop every worker; graceful destroys process groups first, otherwise kill at once."""
        ...


GroupFactory = Callable[[JobConfig, str, int], WorkerGroup]
"""(config, run URL, attempt) -> a new, empty group. The run's URL, not the driver's ``RunFolder``: it goes
to the ranks, other processes, each of which makes its own folder at setup (its storage, its checkpoint store
fenced by the lease's generation; the storage options are the config's). The driver's folder holds a store
fenced by the driver's lease, whose beat thread does not pickle."""
