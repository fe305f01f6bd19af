"""RayWorkerGroup: one gang of DDP workers on Ray, the implementation of
:class:`cluster.seam.protocol.WorkerGroup` (the driver's only view of it). It starts the ranks (rendezvous
through rank 0's store, in waves), runs epochs and collects them, answers heartbeats and stack dumps, stops
the ranks at one step, prepares a move off a draining node, and shuts down; placement, the hot spare,
classifying errors and salvaging workers for the next group live in the modules beside it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.core.errors import Failure, ResourcesUnavailableError
from cluster.rank.dist import share_gpus
from cluster.rank.worker import HOLD_STEPS
from cluster.run.checkpoint import CommitRecord
from cluster.seam.peers import PeerPlan
from cluster.seam.preemption import DrainNotice
from cluster.seam.protocol import EpochResult, Heartbeat, Salvage, SetupInfo
from cluster.spec.config import JobConfig
from cluster.spec.schedule import Window
from cluster.worker_group import classify as classify_
from cluster.worker_group import salvage as salvage_
from cluster.worker_group.actor import _WorkerActor, check_same_code
from cluster.worker_group.calls import Stamped, get_all, kill, read_later, read_settled, short
from cluster.worker_group.gang import MoveInProgress
from cluster.worker_group.placement import Placement, Resources, Slot, bundle_nodes, draining
from cluster.worker_group.pulse import (
    SPARE_ROLE,
    Lineage,
    detached_options,
    generation_of,
    pulse,
    run_key,
    taken_over,
)
from cluster.worker_group.spare import HotSpare

logger = logging.getLogger(__name__)

UNREAD_WAIT_S = 1.0
"""At a shutdown, how long the calls of the ranks just killed may take to settle (they fail at once)."""

CONNECT_WAVE = 16
"""Ranks that connect to rank 0's store at once in the first wave; each later wave doubles."""


def connect_waves(world_size: int) -> list[list[int]]:
    """Ranks 1..N-1 in waves of 16, 32, 64, ...: a wave starts once the previous one is connected.

    The store looks up the host name of each connecting address in its one event-loop thread (see
    ``cluster.rank.dist.bind_store``); where DNS is slow to answer, many connects at once queue behind each
    other's lookups. Measured with torch 2.13 on 2 cores, before the store had its own IPv4 socket: 31
    clients at once, about half took 5 s; 15 first and then the rest, every one under 0.1 s. Waves still
    bound the lookups in flight for ranks on other nodes than rank 0's, for one more round trip per wave
    (about log2 N waves)."""
    waves, start, size = [], 1, CONNECT_WAVE
    while start < world_size:
        waves.append(list(range(start, min(world_size, start + size))))
        start += size
        size *= 2
    return waves


class RayWorkerGroup:
    """One gang of DDP workers on Ray. ``start`` either returns with every rank set up or raises."""

    def __init__(
        self, cfg: JobConfig, run_url: str, attempt: int, task_cls: Any = None, detached: bool = False
    ) -> None:
        self.cfg = cfg
        self.run_url = run_url
        self.attempt = attempt
        self.task_cls = task_cls
        """A Task class given to ``cluster.train(task=...)``: sent to every actor by value (cloudpickle), so a
        class defined in a notebook or a script's ``__main__`` reaches the workers."""
        self.generation = generation_of(cfg)
        """The driver's lease generation: every call to a rank carries it (``calls.Stamped``)."""
        self.lineage = Lineage(run_key(run_url), self.generation) if detached else None
        """Set on a running Ray cluster: the ranks and placement groups outlive the driver
        (``cluster.worker_group.pulse``), for the next submission to adopt."""
        lineage = self.lineage
        self.placement = Placement(cfg, (lambda n: lineage.pg_name(attempt, n)) if lineage else None)
        self.move: MoveInProgress | None = None
        self._dispatch = 0  # numbers run_epoch calls, for planned stops
        self.actors: list[Any] = []
        self.nodes: list[tuple[str, str]] = []
        """rank -> (Ray node id, ip) it runs on."""
        self.pids: list[int] = []
        """rank -> its process id (on its node), once set up: a hung rank is ended by it."""
        self.world_size = 0
        self.pending: list[Any] = []
        """rank -> its call of the running (or last) epoch."""
        self._adopted: dict[int, Any] = {}
        self.beats: dict[int, Any] = {}
        """rank -> heartbeat call not yet collected."""
        self.reused = 0
        self.spare = HotSpare()
        self.spare_note = "off"

    # --------------------------------------------------------------- resources
    def available_for(self, n: int) -> bool:
        return self.placement.available_for(n)

    def reserve(self, sizes: list[int], wait_s: float, cancelled: Callable[[], bool] | None = None) -> int:
        """``Placement.reserve``: bundles for ``sizes[0]`` workers, or the largest smaller size granted."""
        return self.placement.reserve(sizes, wait_s, cancelled)

    def room_without(self, nodes: list[str], n: int) -> bool:
        """``Placement.room_without``: capacity for ``n`` ranks off ``nodes``."""
        return self.placement.room_without(nodes, n)

    def keep_off(self, nodes: list[str]) -> None:
        """Quarantined ``nodes`` (``cluster.run.quarantine``): no new bundle goes there, a salvage re-places
        the ranks still there, and a hot spare there is stopped now (it would take a dead rank's place
        there)."""
        self.placement.avoid = list(nodes)
        if self.spare.actor is not None and self.spare.node in nodes:
            self.spare.kill()

    # --------------------------------------------------------------- lifecycle
    def start(
        self,
        world_size: int,
        peers: PeerPlan | None = None,
        skips: list[Window] | None = None,
        rollback: Window | None = None,
    ) -> list[SetupInfo]:
        """Create the actors in the reserved placement group, rendezvous, set up every rank (taking the
        state from rank ``peers.source`` when a peer plan is given; ``skips`` and ``rollback``: as
        ``Worker.setup``'s)."""
        slots = self.placement.slots
        assert slots, "reserve() first"
        self.world_size = world_size
        cls = ray.remote(_WorkerActor)
        self.reused = len(self._adopted)
        for rank in range(world_size):
            if rank in self._adopted:
                self.actors.append(self._adopted.pop(rank))
                continue
            self.actors.append(self._new_actor(cls, rank, world_size, slots[rank], f"rank{rank}"))
        timeout = self.cfg.failures.process_group_timeout_s
        self.nodes = get_all([a.node.remote() for a in self.actors], timeout)
        check_same_code(get_all([a.code.remote() for a in self.actors], timeout), self.nodes)
        spare_early = self.cfg.failures.hot_spare == "auto"
        if spare_early:  # it has a CPU share of its own: it prepares while the group rendezvouses
            self._start_spare(cls)
        if self.cfg.scaling.use_gpu:
            self._share_gpus(timeout)
        # one address, never every interface: loopback when the group is on one node (cluster.rank.dist)
        spans_nodes = len({node for node, _ in self.nodes}) > 1
        host, port = get_all([self.actors[0].bind_store.remote(spans_nodes)], timeout)[0]
        for wave in connect_waves(world_size):
            get_all([self.actors[r].connect.remote(host, port) for r in wave], timeout)
        infos: list[SetupInfo] = get_all(
            [a.setup.remote(host, port, peers, skips, rollback) for a in self.actors], timeout
        )
        for info, (node_id, _) in zip(infos, self.nodes):
            info.node_id = node_id
        self.pids = [info.pid for info in infos]
        if not spare_early:  # hot_spare=true shares the ranks' CPUs: it prepares after their setup
            self._start_spare(cls)
        return infos

    def _share_gpus(self, timeout: float) -> None:
        """Each rank sees every GPU the group holds on its node and selects its own (see
        ``cluster.rank.dist.share_gpus``), before any of them starts CUDA."""
        ids = get_all([a.gpu_ids.remote() for a in self.actors], timeout)
        try:
            shared = share_gpus(
                [(node, gpus) for (node, _), gpus in zip(self.nodes, ids)],
                shared=self.cfg.scaling.gpus_per_worker < 1,
            )
        except ValueError as exc:
            raise ResourcesUnavailableError(f"Ray's GPU assignment cannot be used: {exc}") from None
        get_all([a.use_gpus.remote(v, i) for a, (v, i) in zip(self.actors, shared)], timeout)

    def _new_actor(self, cls: Any, rank: int, world_size: int, slot: Slot, what: str) -> Any:
        s = self.cfg.scaling
        options: dict[str, Any] = {
            "max_concurrency": 2,
            "name": f"cluster:{self.cfg.name}:{what}:attempt{self.attempt}",
        }
        lineage = None
        if self.lineage is not None:
            lineage = dataclasses.replace(self.lineage, bundle=slot[1])
            options = detached_options(self.lineage, self.attempt, what)
        handle = cls.options(
            num_cpus=s.cpus_per_worker,
            num_gpus=s.gpus_per_worker if s.use_gpu else 0,
            resources=dict(s.resources_per_worker),
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=slot[0], placement_group_bundle_index=slot[1]
            ),
            **options,
        ).remote(self.cfg, rank, world_size, self.run_url, self.attempt, self.task_cls, lineage)
        actor = Stamped(handle, self.generation)
        if lineage is not None:
            pulse(self.cfg).add(actor)
        return actor

    def _start_spare(self, cls: Any) -> None:
        """failures.hot_spare: one idle, prepared worker that can take a dead rank's place at once."""

        def spawn(slot: Slot) -> Any:
            # Detached like the ranks when they are (it may become one: a rank that outlives its driver)
            options: dict[str, Any] = {
                "max_concurrency": 2,
                "name": f"cluster:{self.cfg.name}:spare:attempt{self.attempt}",
            }
            lineage = None
            if self.lineage is not None:
                lineage = dataclasses.replace(self.lineage, bundle=slot[1])
                options = detached_options(self.lineage, self.attempt, SPARE_ROLE)
            actor = Stamped(
                cls.options(  # no CPU of its own: it idles until it inherits a dead rank's bundle
                    num_cpus=0,
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=slot[0], placement_group_bundle_index=slot[1]
                    ),
                    **options,
                ).remote(self.cfg, 0, self.world_size, self.run_url, self.attempt, self.task_cls, lineage),
                self.generation,
            )
            if lineage is not None:
                pulse(self.cfg).add(actor)
            return actor

        self.spare_note = self.spare.start(self.cfg, self.placement.slots, self.nodes, spawn)

    def spare_ready(self) -> float | None:
        """The seconds the hot spare took to prepare, once it has; None while it prepares or with no spare."""
        return self.spare.ready_s()

    # --------------------------------------------------------------- epochs
    def run_epoch(self, epoch: int, start_step: int, evaluate_first: bool = False, seq: int = 0) -> None:
        self._dispatch += 1
        self.pending = [
            a.run_epoch.remote(epoch, start_step, self._dispatch, evaluate_first, seq) for a in self.actors
        ]

    def poll(self, timeout: float) -> list[EpochResult] | None:
        """Results of the epoch when every rank is done; None while running; raises on the first error."""
        ready, _ = ray.wait(self.pending, num_returns=len(self.pending), timeout=timeout)
        for ref in ready:
            try:
                ray.get(ref)  # surfaces errors as soon as one rank fails
            except BaseException:
                read_later([r for r in self.pending if r is not ref])
                raise
        if len(ready) < len(self.pending):
            return None
        return list(ray.get(self.pending))

    def stop(self, checkpoint: bool) -> int:
        """Stop every rank at the same step boundary of the running epoch (``Worker.hold_stop``, then
        ``Worker.stop_at``); rank 0 commits a checkpoint there when ``checkpoint``. Returns the step; the
        epoch's results (``poll``) come back with ``stopped`` set, or whole if the epoch ended first."""
        timeout = self.cfg.failures.process_group_timeout_s
        steps = get_all([a.hold_stop.remote(self._dispatch) for a in self.actors], timeout)
        step = max(steps) + HOLD_STEPS
        get_all([a.stop_at.remote(self._dispatch, step, checkpoint) for a in self.actors], timeout)
        return step

    def heartbeats(self, timeout: float = 2.0) -> list[Heartbeat | None]:
        """One heartbeat per rank. A call that did not answer within ``timeout`` is not repeated but
        collected by a later round: it carries rank 0's step rows, which must not be dropped."""
        for rank, actor in enumerate(self.actors):
            if rank not in self.beats:
                self.beats[rank] = actor.heartbeat.remote()
        refs = [self.beats[r] for r in range(len(self.actors))]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out: list[Heartbeat | None] = []
        for rank, ref in enumerate(refs):
            if ref not in ready:
                out.append(None)
                continue
            del self.beats[rank]
            try:
                out.append(ray.get(ref))
            except RayActorError:
                out.append(None)
        return out

    def finish(self) -> list[CommitRecord]:
        return list(get_all([self.actors[0].finish.remote()], self.cfg.failures.process_group_timeout_s)[0])

    def profile(self, req_id: str, steps: int, ranks: list[int], folder: str) -> None:
        """Ask ``ranks`` to profile their next ``steps`` steps into ``<run>/<folder>/`` (returns once they
        have the request; the files follow)."""
        get_all(
            [self.actors[r].profile.remote(req_id, steps, folder) for r in ranks],
            self.cfg.failures.process_group_timeout_s,
        )

    def stacks(self, timeout: float = 5.0) -> list[list[dict[str, Any]] | None]:
        """Each rank's thread stacks (``Worker.stacks``, plain data); None for a rank that did not answer
        within ``timeout`` (its process holds the GIL, is gone, or its second thread is busy)."""
        refs = [a.stacks.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out: list[list[dict[str, Any]] | None] = []
        for ref in refs:
            if ref not in ready:
                out.append(None)
                continue
            try:
                out.append(ray.get(ref))
            except (RayActorError, RayTaskError) as exc:
                logger.warning("no stacks from a rank: %s", type(exc).__name__)
                out.append(None)
        return out

    # --------------------------------------------------------------- moves off draining nodes
    def draining(self) -> list[DrainNotice]:
        """Ray's drain notices for the nodes that hold ranks of this group."""
        return draining(self.nodes)

    def prepare_move(self, ranks: list[int], avoid: list[str] | None = None) -> None:
        """Start replacements for ``ranks`` while training goes on: a placement group of their bundles
        (Ray places none on a draining node, nor on the nodes in ``avoid``; an autoscaler adds a node for
        it), an actor per rank, each preparing its task and dataset. ``move_status`` says when they are
        ready."""
        self.cancel_move()
        pg = self.placement.request(len(ranks), avoid)
        self.move = MoveInProgress(list(ranks), pg, pg.ready())

    def move_status(self) -> str:
        """``placing``, ``preparing``, ``ready``, or ``failed: <why>`` for the move ``prepare_move`` began."""
        m = self.move
        if m is None:
            return "failed: no move in progress"
        if m.actors is None:
            ready, _ = ray.wait([m.placed], timeout=0)
            if not ready:
                return "placing"
            cls = ray.remote(_WorkerActor)
            m.actors = {
                r: self._new_actor(cls, r, self.world_size, (m.pg, i), f"rank{r}:move")
                for i, r in enumerate(m.ranks)
            }
            m.prepared = [a.prepare.remote() for a in m.actors.values()]
        ready, _ = ray.wait(m.prepared, num_returns=len(m.prepared), timeout=0)
        if len(ready) < len(m.prepared):
            return "preparing"
        try:
            ray.get(m.prepared)
        except Exception as exc:
            return f"failed: a replacement could not start: {short(exc)}"
        return "ready"

    def move_nodes(self) -> list[str]:
        """The nodes the replacements run on (after ``move_status`` said ready)."""
        m = self.move
        if m is None or m.actors is None:
            return []
        return bundle_nodes(m.pg, len(m.ranks))

    def cancel_move(self) -> None:
        m, self.move = self.move, None
        if m is None:
            return
        for rank, actor in (m.actors or {}).items():
            kill(actor, f"the replacement of rank {rank}")
        remove_placement_group(m.pg)

    # --------------------------------------------------------------- failures and hand-over
    def classify(self, exc: BaseException, starting: bool = False) -> Failure:
        """``cluster.worker_group.classify.classify`` over this group's ranks: the root cause and rank of
        the first error seen; with ``starting``, an error that is not Ray's is ``start_failed``."""
        return classify_.classify(exc, self.pending, self.nodes, starting)

    def salvage(
        self,
        failure: Failure | None,
        attempt: int,
        *,
        leaving: Collection[int] = (),
        keep_state: bool | None = None,
    ) -> Salvage | None:
        """Keep what can serve the next group (attempt ``attempt``), kill the rest; None when nothing is
        kept.

        After a ``failure`` (a worker died or raised; a warm restart): wait (bounded) for the survivors to
        leave the failed collective, then keep them at their ranks, with their state in memory when
        ``keep_state`` (default ``failures.recover_from_peers``; each reports a :class:`PeerState`), else
        reset. A survivor that does not come out within :data:`RELEASE_S` is killed; the hot spare takes a
        single dead rank's place.

        After ``stop`` (``failure`` None): keep every rank but ``leaving``, with its state in memory when
        ``keep_state``; the replacements ``prepare_move`` made take the leaving ranks (same numbers). With
        no ready move the remaining ranks are renumbered 0..K-1 (the group continues smaller, from a
        checkpoint). All of them or none."""
        return self.placement.relocate(salvage_.salvage(self, attempt, failure, leaving, keep_state))

    def adopt(self, salvage: Salvage) -> None:
        res: Resources = salvage.resources
        self.placement.adopt(res)
        self._adopted = dict(salvage.actors)

    def take_over(
        self,
        actors: list[Any],
        nodes: list[tuple[str, str]],
        infos: list[SetupInfo],
        res: Resources,
        dispatch: int,
    ) -> None:
        """Hold the ranks a previous driver left running (``cluster.worker_group.adoption``), set up and
        given epoch number ``dispatch``: ``poll`` returns that epoch's result (their ``collect``)."""
        self.actors, self.nodes, self.world_size = list(actors), list(nodes), len(actors)
        self.pids = [i.pid for i in infos]
        self.placement.adopt(res)
        self._dispatch = dispatch
        self.pending = [a.collect.remote() for a in self.actors]
        for actor in self.actors:
            pulse(self.cfg).add(actor)
        self._start_spare(ray.remote(_WorkerActor))  # the previous driver's idle spare was set aside

    def shutdown(self, graceful: bool) -> None:
        """Graceful: destroy process groups and stop actors. Otherwise kill at once (a survivor may be
        blocked in a collective that will not return before the process-group timeout)."""
        self.spare.kill()
        self.cancel_move()
        if self.lineage is not None and taken_over(self.cfg, self.run_url, self.generation):
            # a newer driver took the run (and may have adopted these ranks): they are its to end
            logger.warning("the run was taken over: its ranks are left to the driver that holds it now")
            self.actors, self._adopted = [], {}
            self.placement.forget()
            return
        if graceful and self.actors:
            try:
                ray.get([a.shutdown.remote() for a in self.actors], timeout=10)
            except Exception as exc:  # killed below either way
                logger.warning("graceful shutdown of the workers failed, killing them: %s", short(exc))
        for rank, actor in enumerate(self.actors):
            kill(actor, f"rank {rank}")
        for rank, actor in self._adopted.items():  # survivors handed over, not started (a stop, no room)
            kill(actor, f"rank {rank}")
        self.actors, self._adopted = [], {}
        self.placement.remove()
        read_settled(UNREAD_WAIT_S)  # the killed ranks' calls settle at once
