"""Ray side of the workers: placement group, one actor per rank, rendezvous, start, poll, kill.

The actor is a thin wrapper over :class:`cluster.worker.Worker`. It runs with ``max_concurrency=2`` so
the driver's heartbeat call (``heartbeat``) is answered while ``run_epoch`` is busy training.
It implements :class:`cluster.group.WorkerGroup`, the driver's only view of it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.checkpoint import CommitRecord
from cluster.config import JobConfig, Window
from cluster.dist import share_gpus, store_host
from cluster.errors import ConfigError, Failure, ResourcesUnavailableError, WorkerError, device_broken
from cluster.group import EpochResult, Heartbeat, Salvage, SetupInfo, StartCancelled
from cluster.peer import PeerPlan, PeerState
from cluster.preemption import DrainNotice, draining_nodes
from cluster.process import worker_env
from cluster.worker import HOLD_STEPS, Worker

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its id: a bundle's label selector keeps it off given nodes."""


def avoid_selector(nodes: list[str], bundles: int) -> list[dict[str, str]]:
    """``bundle_label_selector`` that keeps each of ``bundles`` bundles off ``nodes`` (Ray node ids)."""
    return [{NODE_ID_LABEL: "!in(" + ",".join(nodes) + ")"}] * bundles


class _WorkerActor:
    def __init__(
        self, cfg: JobConfig, rank: int, world_size: int, run_url: str, attempt: int, task_cls: Any = None
    ) -> None:
        with worker_env(cfg):
            self.worker = Worker(cfg, rank, world_size, run_url, attempt, task_cls)
        # DistributedDataParallel's first construction imports torch._dynamo (~820 modules, 0.7-2.6 s on
        # 2 cores): on every rank's critical path. Import it now, while the driver checks the ranks' code
        # and hands out the store's address. (init_process_group waits for an import in progress: it
        # touches torch._dynamo when the module is in sys.modules. So the import overlaps the driver's
        # round trips, not the rendezvous itself.)
        threading.Thread(target=_import_dynamo, name="cluster-import-dynamo", daemon=True).start()

    def node(self) -> tuple[str, str]:
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address()

    def code(self) -> tuple[str, str]:
        return code_fingerprint()

    def gpu_ids(self) -> list[str]:
        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]

    def use_gpus(self, visible: str, index: int) -> str:
        return self.worker.use_gpus(visible, index)

    def bind_store(self) -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        return ip, self.worker.bind_store(ipv4=":" not in ip)

    def connect(self, host: str, port: int) -> None:
        self.worker.connect(host, port)

    def setup(
        self,
        host: str,
        port: int,
        peers: PeerPlan | None = None,
        skips: list[Window] | None = None,
        rollback: Window | None = None,
    ) -> SetupInfo:
        return self.worker.setup(host, port, peers, skips, rollback).info

    def run_epoch(
        self, epoch: int, start_step: int, dispatch: int = 0, evaluate_first: bool = False
    ) -> EpochResult:
        return self.worker.run_epoch(epoch, start_step, dispatch, evaluate_first)

    def hold_stop(self, dispatch: int) -> int:
        return self.worker.hold_stop(dispatch)

    def stop_at(self, dispatch: int, step: int, checkpoint: bool) -> None:
        self.worker.stop_at(dispatch, step, checkpoint)

    def heartbeat(self) -> Heartbeat:
        return self.worker.heartbeat()

    def stacks(self) -> list[dict[str, Any]]:
        return self.worker.stacks()

    def profile(self, req_id: str, steps: int, folder: str) -> None:
        self.worker.profile(req_id, steps, folder)

    def finish(self) -> list[CommitRecord]:
        return self.worker.finish()

    def shutdown(self) -> None:
        self.worker.shutdown()

    def reset(self, rank: int, world_size: int, attempt: int) -> None:
        self.worker.reset(rank, world_size, attempt)

    def release(self, rank: int, world_size: int, attempt: int) -> PeerState | None:
        return self.worker.release(rank, world_size, attempt)

    def abort(self) -> bool:
        return self.worker.abort()

    def prepare(self) -> float:
        return self.worker.prepare()


class RayWorkerGroup:
    """One gang of DDP workers on Ray. ``start`` either returns with every rank set up or raises."""

    def __init__(self, cfg: JobConfig, run_url: str, attempt: int, task_cls: Any = None) -> None:
        self.cfg = cfg
        self.run_url = run_url
        self.attempt = attempt
        self.task_cls = task_cls
        """A Task class given to ``cluster.train(task=...)``: sent to every actor by value (cloudpickle), so a
        class defined in a notebook or a script's ``__main__`` reaches the workers."""
        self.pg: PlacementGroup | None = None
        self.slots: dict[int, tuple[PlacementGroup, int]] = {}
        """rank -> (placement group, bundle index) it runs in: ``(self.pg, rank)`` unless the rank moved."""
        self.extra_pgs: list[PlacementGroup] = []
        """Placement groups of ranks that moved off a draining node (see ``prepare_move``)."""
        self._move: _MoveInProgress | None = None
        self._dispatch = 0  # numbers run_epoch calls, for planned stops
        self.actors: list[Any] = []
        self.nodes: list[tuple[str, str]] = []
        self.world_size = 0
        self._pending: list[Any] = []
        self._adopted: dict[int, Any] = {}
        self._beats: dict[int, Any] = {}  # rank -> heartbeat call not yet collected
        self.reused = 0
        self.spare: Any = None
        self._spare_ready: Any = None
        self._spare_node = ""  # the node the hot spare runs on
        self.spare_note = "off"

    # --------------------------------------------------------------- resources
    def bundle(self) -> dict[str, float]:
        s = self.cfg.scaling
        b: dict[str, float] = {"CPU": s.cpus_per_worker, **s.resources_per_worker}
        if s.use_gpu:
            b["GPU"] = s.gpus_per_worker
        return b

    def available_for(self, n: int) -> bool:
        avail = ray.available_resources()
        drains = draining_nodes() if self.cfg.failures.preemption else {}
        for node in ray.nodes() if drains else []:
            if node["NodeID"] in drains:  # free there, but Ray places nothing new on a draining node
                for k, v in node.get("Resources", {}).items():
                    avail[k] = avail.get(k, 0.0) - v
        return all(avail.get(k, 0) >= v * n - 1e-9 for k, v in self.bundle().items())

    def reserve(self, sizes: list[int], wait_s: float, cancelled: Callable[[], bool] | None = None) -> int:
        """Reserve bundles for ``sizes[0]`` workers, waiting up to ``wait_s``; failing that, the largest
        of the smaller ``sizes`` the cluster grants now. Raise ResourcesUnavailableError otherwise, and
        StartCancelled as soon as ``cancelled()`` (asked about every second of the wait) says so."""
        strategy = self.cfg.scaling.placement_strategy
        if self.slots and len(self.slots) in sizes:
            return len(self.slots)  # adopted from the previous attempt (warm restart): already reserved
        for i, n in enumerate(sizes):
            pg = placement_group([self.bundle()] * n, strategy=strategy)
            if _granted(pg, wait_s if i == 0 else 2.0, cancelled):
                self.pg = pg
                self.slots = {r: (pg, r) for r in range(n)}
                return n
            remove_placement_group(pg)
        need = ", ".join(f"{k}={v:g}" for k, v in self.bundle().items())
        raise ResourcesUnavailableError(
            f"the cluster did not provide {sizes[0]} workers of {{{need}}} "
            f"(nor the minimum {sizes[-1]}) within "
            f"scaling.resource_wait_s={wait_s:g}s with strategy {strategy}; the cluster has "
            f"{_fmt(ray.cluster_resources())}, free {_fmt(ray.available_resources())}. Add nodes, lower "
            "scaling.num_workers / scaling.min_workers, or raise scaling.resource_wait_s"
        )

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
        assert self.slots, "reserve() first"
        self.world_size = world_size
        cls = ray.remote(_WorkerActor)
        self.reused = len(self._adopted)
        for rank in range(world_size):
            if rank in self._adopted:
                self.actors.append(self._adopted.pop(rank))
                continue
            self.actors.append(self._new_actor(cls, rank, world_size, self.slots[rank], f"rank{rank}"))
        timeout = self.cfg.failures.process_group_timeout_s
        self.nodes = self._get([a.node.remote() for a in self.actors], timeout)
        _check_same_code(self._get([a.code.remote() for a in self.actors], timeout), self.nodes)
        spare_early = self.cfg.failures.hot_spare == "auto"
        if spare_early:  # it has a CPU share of its own: it prepares while the group rendezvouses
            self._start_spare(cls)
        if self.cfg.scaling.use_gpu:
            self._share_gpus(timeout)
        ip, port = self._get([self.actors[0].bind_store.remote()], timeout)[0]
        hosts = [store_host(node, self.nodes[0][0], ip) for node, _ in self.nodes]
        for wave in connect_waves(world_size):
            self._get([self.actors[r].connect.remote(hosts[r], port) for r in wave], timeout)
        infos: list[SetupInfo] = self._get(
            [a.setup.remote(h, port, peers, skips, rollback) for a, h in zip(self.actors, hosts)], timeout
        )
        for info, (node_id, _) in zip(infos, self.nodes):
            info.node_id = node_id
        if not spare_early:  # hot_spare=true shares the ranks' CPUs: it prepares after their setup
            self._start_spare(cls)
        return infos

    def _share_gpus(self, timeout: float) -> None:
        """Each rank sees every GPU the group holds on its node and selects its own (see
        ``cluster.dist.share_gpus``), before any of them starts CUDA."""
        ids = self._get([a.gpu_ids.remote() for a in self.actors], timeout)
        try:
            shared = share_gpus(
                [(node, gpus) for (node, _), gpus in zip(self.nodes, ids)],
                shared=self.cfg.scaling.gpus_per_worker < 1,
            )
        except ValueError as exc:
            raise ResourcesUnavailableError(f"Ray's GPU assignment cannot be used: {exc}") from None
        self._get([a.use_gpus.remote(v, i) for a, (v, i) in zip(self.actors, shared)], timeout)

    def _new_actor(
        self, cls: Any, rank: int, world_size: int, slot: tuple[PlacementGroup, int], what: str
    ) -> Any:
        s = self.cfg.scaling
        return cls.options(
            num_cpus=s.cpus_per_worker,
            num_gpus=s.gpus_per_worker if s.use_gpu else 0,
            resources=dict(s.resources_per_worker),
            max_concurrency=2,
            max_restarts=0,
            name=f"cluster:{self.cfg.name}:{what}:attempt{self.attempt}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=slot[0], placement_group_bundle_index=slot[1]
            ),
        ).remote(self.cfg, rank, world_size, self.run_url, self.attempt, self.task_cls)

    def _start_spare(self, cls: Any) -> None:
        """failures.hot_spare: one idle, prepared worker that can take a dead rank's place at once."""
        mode = self.cfg.failures.hot_spare
        if mode is False or self.cfg.scaling.use_gpu or not self.slots:
            self.spare_note = "off"
            return
        rank = self._spare_bundle() if mode == "auto" else self.world_size - 1
        if rank is None:
            self.spare_note = (
                "off: no node of the job has a free CPU share for it (failures.hot_spare=auto); "
                "set failures.hot_spare=true to keep one anyway"
            )
            return
        self.spare = cls.options(  # no CPU of its own: it idles until it inherits a dead rank's bundle
            num_cpus=0,
            max_concurrency=2,
            max_restarts=0,
            name=f"cluster:{self.cfg.name}:spare:attempt{self.attempt}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.slots[rank][0], placement_group_bundle_index=self.slots[rank][1]
            ),
        ).remote(self.cfg, 0, self.world_size, self.run_url, self.attempt, self.task_cls)
        self._spare_ready = self.spare.prepare.remote()
        self._spare_node = self.nodes[rank][0]
        self.spare_note = "preparing"

    def _spare_bundle(self) -> int | None:
        """The bundle (= rank) on the first node with a CPU share this job does not use, if any: there
        the spare's preparation (a torch import, the dataset) does not take CPU from training."""
        share = self.cfg.scaling.cpus_per_worker
        totals = {
            n["NodeID"]: float(n.get("Resources", {}).get("CPU", 0)) for n in ray.nodes() if n.get("Alive")
        }
        used: dict[str, float] = {}
        for node_id, _ in self.nodes:
            used[node_id] = used.get(node_id, 0.0) + share
        for rank, (node_id, _) in enumerate(self.nodes):
            if totals.get(node_id, 0.0) - used[node_id] >= share - 1e-9:
                return rank
        return None

    def _get(self, refs: list[Any], timeout: float) -> list[Any]:
        """ray.get that fails fast: the first error from any rank ends the wait."""
        pending = list(refs)
        deadline = time.monotonic() + timeout
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"workers did not answer within {timeout:g}s")
            ray.get(ready[0])  # raises on error
        return ray.get(refs)

    def run_epoch(self, epoch: int, start_step: int, evaluate_first: bool = False) -> None:
        self._dispatch += 1
        self._pending = [
            a.run_epoch.remote(epoch, start_step, self._dispatch, evaluate_first) for a in self.actors
        ]

    def stop(self, checkpoint: bool) -> int:
        """Stop every rank at the same step boundary of the running epoch (``Worker.hold_stop``, then
        ``Worker.stop_at``); rank 0 commits a checkpoint there when ``checkpoint``. Returns the step; the
        epoch's results (``poll``) come back with ``stopped`` set, or whole if the epoch ended first."""
        timeout = self.cfg.failures.process_group_timeout_s
        steps = self._get([a.hold_stop.remote(self._dispatch) for a in self.actors], timeout)
        step = max(steps) + HOLD_STEPS
        self._get([a.stop_at.remote(self._dispatch, step, checkpoint) for a in self.actors], timeout)
        return step

    def draining(self) -> list[DrainNotice]:
        """Ray's drain notices for the nodes that hold ranks of this group."""
        drains = draining_nodes()
        out = []
        for node_id, deadline in drains.items():
            ranks = tuple(r for r, (n, _) in enumerate(self.nodes) if n == node_id)
            if ranks:
                out.append(DrainNotice(node_id, ranks, deadline))
        return out

    def prepare_move(self, ranks: list[int], avoid: list[str] | None = None) -> None:
        """Start replacements for ``ranks`` while training goes on: a placement group of their bundles
        (Ray places none on a draining node, nor on the nodes in ``avoid``; an autoscaler adds a node for
        it), an actor per rank, each preparing its task and dataset. ``move_status`` says when they are
        ready."""
        self.cancel_move()
        selector = avoid_selector(avoid, len(ranks)) if avoid else None
        pg = placement_group(
            [self.bundle()] * len(ranks),
            strategy=self.cfg.scaling.placement_strategy,
            bundle_label_selector=selector,
        )
        self._move = _MoveInProgress(list(ranks), pg, pg.ready())

    def move_status(self) -> str:
        """``placing``, ``preparing``, ``ready``, or ``failed: <why>`` for the move ``prepare_move`` began."""
        m = self._move
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
            return f"failed: a replacement could not start: {_short(exc)}"
        return "ready"

    def move_nodes(self) -> list[str]:
        """The nodes the replacements run on (after ``move_status`` said ready)."""
        m = self._move
        if m is None or m.actors is None:
            return []
        table = placement_group_table(m.pg).get("bundles_to_node_id", {})
        return [str(table.get(i, "")) for i in range(len(m.ranks))]

    def cancel_move(self) -> None:
        m, self._move = self._move, None
        if m is None:
            return
        for rank, actor in (m.actors or {}).items():
            _kill(actor, f"the replacement of rank {rank}")
        remove_placement_group(m.pg)

    def salvage_stopped(self, attempt: int, retire: list[int], keep_state: bool) -> Salvage | None:
        """After ``stop``: keep every rank but ``retire`` for the next group, with its state in memory when
        ``keep_state``; the replacements ``prepare_move`` made take the retired ranks (same numbers). With
        no move in progress the remaining ranks are renumbered 0..K-1 (the group continues smaller, from a
        checkpoint). None when nothing is kept."""
        t0 = time.perf_counter()
        move, self._move = self._move, None
        self._kill_spare()
        keep = [r for r in range(len(self.actors)) if r not in retire]
        slots: dict[int, tuple[PlacementGroup, int]] = {}
        actors: dict[int, Any] = {}
        if move is not None and move.actors is not None and sorted(move.ranks) == sorted(retire):
            numbering = {r: r for r in keep}
            for i, r in enumerate(move.ranks):
                actors[r], slots[r] = move.actors[r], (move.pg, i)
            self.extra_pgs.append(move.pg)
        else:
            if move is not None:
                self._move = move
                self.cancel_move()
            numbering = {r: i for i, r in enumerate(keep)}
        world = len(numbering) + len(actors)
        calls: dict[int, Any] = {}
        for old, new in numbering.items():
            method = "release" if keep_state else "reset"
            calls[new] = getattr(self.actors[old], method).remote(new, world, attempt)
            actors[new], slots[new] = self.actors[old], self.slots[old]
        for r in actors:
            if r not in calls:
                calls[r] = actors[r].reset.remote(r, world, attempt)
        peers: dict[int, PeerState] = {}
        ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=RELEASE_S)
        ok = len(ready) == len(calls)
        for r, ref in calls.items():
            try:
                state = ray.get(ref, timeout=0) if ref in ready else None
            except Exception as exc:
                logger.warning("rank %d could not be kept for the next group: %s", r, _short(exc))
                ok = False
                continue
            if isinstance(state, PeerState):
                peers[r] = state
        for r in retire:
            _kill(self.actors[r], f"rank {r} (retired from a draining node)")
        logger.debug("salvage after a stop: %.3fs", time.perf_counter() - t0)
        if not ok:  # a rank failed to reset: start anew (from the checkpoint the driver made sure of)
            for r, actor in actors.items():
                _kill(actor, f"rank {r}")
            self._remove_pgs()
            self.actors = []
            return None
        salvage = Salvage(
            resources=_Resources(self.pg, slots, list(self.extra_pgs)),
            actors=actors,
            peers=peers if keep_state else None,
        )
        self.pg, self.slots, self.extra_pgs, self.actors = None, {}, [], []
        return salvage

    def poll(self, timeout: float) -> list[EpochResult] | None:
        """Results of the epoch when every rank is done; None while running; raises on the first error."""
        ready, _ = ray.wait(self._pending, num_returns=len(self._pending), timeout=timeout)
        for ref in ready:
            ray.get(ref)  # surfaces errors as soon as one rank fails
        if len(ready) < len(self._pending):
            return None
        return list(ray.get(self._pending))

    def heartbeats(self, timeout: float = 2.0) -> list[Heartbeat | None]:
        """One heartbeat per rank. A call that did not answer within ``timeout`` is not repeated but
        collected by a later round: it carries rank 0's step rows, which must not be dropped."""
        for rank, actor in enumerate(self.actors):
            if rank not in self._beats:
                self._beats[rank] = actor.heartbeat.remote()
        refs = [self._beats[r] for r in range(len(self.actors))]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out: list[Heartbeat | None] = []
        for rank, ref in enumerate(refs):
            if ref not in ready:
                out.append(None)
                continue
            del self._beats[rank]
            try:
                out.append(ray.get(ref))
            except RayActorError:
                out.append(None)
        return out

    def finish(self) -> list[CommitRecord]:
        return list(self._get([self.actors[0].finish.remote()], self.cfg.failures.process_group_timeout_s)[0])

    def profile(self, req_id: str, steps: int, ranks: list[int], folder: str) -> None:
        """Ask ``ranks`` to profile their next ``steps`` steps into ``<run>/<folder>/`` (returns once they
        have the request; the files follow)."""
        self._get(
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

    def classify(self, exc: BaseException) -> Failure:
        """Turn the first error seen into a Failure, looking at every rank for the root cause.

        A dead process beats a user exception, which beats the collateral errors (connection reset by
        peer) that a death causes on the survivors; a death whose node is gone is a lost node.
        """
        errors = self._errors(0.5)
        only_collateral = errors and all(
            not isinstance(e, RayActorError) and _collateral(_describe(e)) for e in errors.values()
        )
        if only_collateral:
            errors.update(self._errors(2.0))  # the peer that broke the collective may still be dying
        deaths = {r: e for r, e in errors.items() if isinstance(e, RayActorError)}
        if deaths:
            rank, death = min(deaths.items())
            node_id = self.nodes[rank][0] if rank < len(self.nodes) else ""
            if self._node_dead(node_id):
                return Failure("node_lost", rank, f"node {node_id} (rank {rank}) was lost: {_short(death)}")
            return Failure("worker_died", rank, f"rank {rank}'s process died: {_short(death)}")
        user = {r: e for r, e in errors.items() if isinstance(e, RayTaskError)}
        if user:
            rank, err = min(user.items(), key=lambda kv: (_collateral(_describe(kv[1])), kv[0]))
            cause = err.cause if isinstance(err.cause, WorkerError) else None
            return Failure("user_error", rank, str(cause) if cause else _short(err), cause)
        return Failure("worker_died", None, _short(exc))

    def _errors(self, timeout: float) -> dict[int, BaseException]:
        refs = self._pending
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out: dict[int, BaseException] = {}
        for rank, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except Exception as err:
                    out[rank] = err
        return out

    @staticmethod
    def _node_dead(node_id: str) -> bool:
        for node in ray.nodes():
            if node["NodeID"] != node_id:
                continue
            if not node.get("Alive", False):
                return True
            # Ray marks a node dead only after its health checks fail (seconds); its raylet refusing or
            # not answering a connection tells at once that the whole node is gone, not one process.
            return not _port_open(node["NodeManagerAddress"], int(node["NodeManagerPort"]))
        return False

    def salvage(self, failure: Failure, attempt: int) -> Salvage | None:
        """For a warm restart after a worker died or raised: wait (bounded) for the survivors to leave the
        failed collective, then keep them, with their state in memory when ``failures.recover_from_peers``
        (each reports a :class:`PeerState`), else reset. A survivor that does not come out within
        :data:`RELEASE_S` is killed; the hot spare takes a single dead rank's place. None when nothing is
        kept."""
        t0 = time.perf_counter()
        fcfg = self.cfg.failures
        if not fcfg.warm_restart or failure.kind not in ("worker_died", "user_error", "node_lost"):
            return None
        if not self.slots or not self._pending:
            return None
        self.cancel_move()  # a failure during a move: the ranks recover as from any failure
        dead = {r for r, e in self._errors(0.0).items() if isinstance(e, RayActorError)}
        lost_nodes: set[str] = set()
        if failure.kind == "node_lost":
            # one incident: every rank of every lost node went with it, however many that is
            lost_nodes = {n for n in {n for n, _ in self.nodes} if self._node_dead(n)}
            dead |= {r for r, (n, _) in enumerate(self.nodes) if n in lost_nodes}
        if failure.rank is not None and (
            failure.kind == "worker_died" or (self.cfg.scaling.use_gpu and device_broken(failure.error))
        ):
            dead.add(failure.rank)  # a CUDA error may be sticky (a device-side assert): that process goes
        for r in dead:
            _kill(self.actors[r], f"rank {r}")  # a dead process's sockets close: its peers' collectives fail
        alive = [r for r in range(len(self.actors)) if r not in dead]
        if self.cfg.scaling.use_gpu:  # NCCL does not fail a collective whose peer is gone: abort it
            for r in alive:
                self.actors[r].abort.remote()
        refs = [self._pending[r] for r in alive]
        done = wait_released(refs, lambda rs, n, t: ray.wait(rs, num_returns=n, timeout=t)[0])
        errors = self._errors(0.0)
        out = [r for r in alive if self._pending[r] in done and not isinstance(errors.get(r), RayActorError)]
        for r in alive:
            if r not in out:
                logger.warning(
                    "rank %d did not leave the failed collective within %gs: not kept", r, RELEASE_S
                )
        t_out = time.perf_counter()
        rows = self._rank0_rows() if 0 in out else []
        t_rows = time.perf_counter()
        keep_state = fcfg.recover_from_peers
        calls: dict[int, Any] = {}
        for r in out:
            # the rank whose own error caused the failure is never a source: it is reset, and receives
            method = "release" if keep_state and r != failure.rank else "reset"
            calls[r] = getattr(self.actors[r], method).remote(r, self.world_size, attempt)
        actors = dict(enumerate(self.actors))
        missing = [r for r in range(len(self.actors)) if r not in out]
        if self.spare is not None and self._spare_node in lost_nodes:
            self._kill_spare()  # it went with its node
        spare = self._spare_state() if len(missing) == 1 else None
        spare_call: dict[int, Any] = {}
        if spare is not None:
            # The hot spare becomes the dead rank, where it runs (the bundle it was placed in: under auto,
            # on a node with a free CPU share). One still preparing is taken too: it is further along than
            # a process started now would be. Its reset runs beside its preparation (the actor takes two
            # calls at once); setup waits for the task it builds.
            actors[missing[0]] = self.spare
            spare_call[missing[0]] = self.spare.reset.remote(missing[0], self.world_size, attempt)
            self.spare = None
        kept: dict[int, Any] = {}
        peers: dict[int, PeerState] = {}
        # a spare still starting answers once its process is up: as long as a new process would take
        spare_wait = RELEASE_S if spare == "prepared" else self.cfg.failures.process_group_timeout_s
        for batch, wait_s in ((calls, RELEASE_S), (spare_call, spare_wait)):
            if not batch:
                continue
            ready, _ = ray.wait(list(batch.values()), num_returns=len(batch), timeout=wait_s)
            for r, ref in batch.items():
                if ref not in ready:
                    logger.warning("rank %d did not reset within %gs: not kept", r, wait_s)
                    continue
                try:
                    state = ray.get(ref)
                except Exception as exc:
                    logger.warning("rank %d could not be reset, not kept: %s", r, _short(exc))
                    continue
                kept[r] = actors[r]
                if isinstance(state, PeerState):
                    peers[r] = state
        if lost_nodes and kept and not self._bundles_replaced(lost_nodes):
            logger.warning(
                "the lost node's ranks found no room within scaling.resource_wait_s=%gs: the survivors are "
                "not kept, the group starts anew",
                self.cfg.scaling.resource_wait_s,
            )
            kept, peers = {}, {}
        logger.debug(
            "salvage: survivors out %.3fs, rank 0's rows %.3fs, %s %.3fs",
            t_out - t0,
            t_rows - t_out,
            "released" if keep_state else "reset",
            time.perf_counter() - t_rows,
        )
        self._kill_spare()
        for r, actor in actors.items():
            if r not in kept:
                _kill(actor, f"rank {r}")
        if not kept:
            self._remove_pgs()
            self.actors = []
            return None
        salvage = Salvage(
            resources=_Resources(self.pg, dict(self.slots), list(self.extra_pgs)),
            actors=kept,
            peers=peers if keep_state else None,
            rows=rows,
            spare=spare if spare is not None and missing[0] in kept else None,
        )
        self.pg, self.slots, self.extra_pgs, self.actors = None, {}, [], []
        return salvage

    def _bundles_replaced(self, lost_nodes: set[str]) -> bool:
        """After a node loss: wait until Ray has re-placed the placement group's bundles that were on the
        lost nodes (the survivors' stay where they are), at most ``scaling.resource_wait_s`` once Ray has
        declared the nodes dead (it reschedules bundles only then)."""
        deadline = time.monotonic() + NODE_DEAD_WAIT_S
        while time.monotonic() < deadline:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if not lost_nodes & alive:
                break
            time.sleep(0.1)
        deadline = time.monotonic() + self.cfg.scaling.resource_wait_s
        while True:
            # the bundles the ranks use (a bundle vacated by a move may stay unplaced: it is not used)
            tables = {id(pg): placement_group_table(pg) for pg, _ in self.slots.values()}
            on = {tables[id(pg)].get("bundles_to_node_id", {}).get(i) for pg, i in self.slots.values()}
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if on <= alive - lost_nodes:  # an unplaced bundle maps to no node, or to an empty id
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def _rank0_rows(self) -> list[dict[str, Any]]:
        """Rank 0's step rows not yet reported (its epoch result, or its buffer), once it left the group."""
        try:
            result = ray.get(self._pending[0], timeout=0)
            if isinstance(result, EpochResult):
                return list(result.step_rows)
        except (RayTaskError, RayActorError, GetTimeoutError):
            pass  # its epoch failed: the rows are still in its buffer
        rows: list[dict[str, Any]] = []
        for ref in [self._beats.pop(0, None), self.actors[0].heartbeat.remote()]:
            if ref is None:
                continue
            try:
                beat: Heartbeat = ray.get(ref, timeout=5.0)
                rows.extend(beat.rows)
            except Exception as exc:
                logger.warning("rank 0's last step rows could not be collected: %s", _short(exc))
        return rows

    def spare_ready(self) -> float | None:
        """The seconds the hot spare took to prepare, once it has; None while it prepares or with no spare."""
        if not self._spare_prepared():
            return None
        assert self._spare_ready is not None
        return float(ray.get(self._spare_ready))

    def _spare_state(self) -> str | None:
        """ "prepared", "preparing" (its process starting, or importing and loading), or None: no spare, or
        its preparation failed (then it is gone)."""
        if self.spare is None or self._spare_ready is None:
            return None
        if self._spare_prepared():
            return "prepared"
        return "preparing" if self.spare is not None else None

    def _spare_prepared(self) -> bool:
        if self.spare is None or self._spare_ready is None:
            return False
        ready, _ = ray.wait([self._spare_ready], timeout=0)
        if not ready:
            return False
        try:
            ray.get(ready[0])
        except Exception as exc:
            logger.warning(
                "the hot spare failed to prepare; a dead rank gets a new process instead: %s", _short(exc)
            )
            self._kill_spare()
            return False
        return True

    def _kill_spare(self) -> None:
        if self.spare is not None:
            _kill(self.spare, "the hot spare")
            self.spare = None

    def adopt(self, salvage: Salvage) -> None:
        res: _Resources = salvage.resources
        self.pg, self.slots, self.extra_pgs = res.pg, dict(res.slots), list(res.extra_pgs)
        self._adopted = dict(salvage.actors)

    def shutdown(self, graceful: bool) -> None:
        """Graceful: destroy process groups and stop actors. Otherwise kill at once (a survivor may be
        blocked in a collective that will not return before the process-group timeout)."""
        self._kill_spare()
        self.cancel_move()
        if graceful and self.actors:
            try:
                ray.get([a.shutdown.remote() for a in self.actors], timeout=10)
            except Exception as exc:  # killed below either way
                logger.warning("graceful shutdown of the workers failed, killing them: %s", _short(exc))
        for rank, actor in enumerate(self.actors):
            _kill(actor, f"rank {rank}")
        for rank, actor in self._adopted.items():  # survivors handed over, not started (a stop, no room)
            _kill(actor, f"rank {rank}")
        self.actors, self._adopted = [], {}
        self._remove_pgs()

    def _remove_pgs(self) -> None:
        pgs = ([self.pg] if self.pg is not None else []) + self.extra_pgs
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception as exc:
                logger.warning(
                    "could not remove a placement group (Ray frees it with the job): %s", _short(exc)
                )
        self.pg, self.slots, self.extra_pgs = None, {}, []


def _granted(pg: PlacementGroup, wait_s: float, cancelled: Callable[[], bool] | None) -> bool:
    """Whether Ray grants ``pg`` within ``wait_s``, asking ``cancelled()`` every second meanwhile (removing
    the request and raising StartCancelled when it says so)."""
    ready = pg.ready()
    deadline = time.monotonic() + wait_s
    while True:
        done, _ = ray.wait([ready], timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        if done:
            ray.get(ready)
            return True
        if time.monotonic() >= deadline:
            return False
        if cancelled is not None and cancelled():
            remove_placement_group(pg)
            raise StartCancelled("asked to stop while waiting for resources")


@dataclass(frozen=True)
class _Resources:
    """What a group hands to the next one in a Salvage: its placement groups and where each rank runs."""

    pg: PlacementGroup | None
    slots: dict[int, tuple[PlacementGroup, int]]
    extra_pgs: list[PlacementGroup]


@dataclass
class _MoveInProgress:
    ranks: list[int]
    pg: PlacementGroup
    placed: Any
    actors: dict[int, Any] | None = None
    prepared: list[Any] = field(default_factory=list)


# The modules a worker runs; the operator tools (inspect, __main__) do not change what trains.
_TRAINING_MODULES = (
    "checkpoint.py",
    "config.py",
    "data.py",
    "dist.py",
    "errors.py",
    "evaluate.py",
    "group.py",
    "load.py",
    "pace.py",
    "parquet.py",
    "peer.py",
    "preemption.py",
    "process.py",
    "profiling.py",
    "stacks.py",
    "storage.py",
    "task.py",
    "worker.py",
    "worker_group.py",
)


@cache
def _import_dynamo() -> None:
    try:
        import torch._dynamo  # noqa: F401
    except Exception as exc:  # setup imports it again (and raises there if it must)
        logger.warning("importing torch._dynamo ahead of DDP failed: %s", exc)


def code_fingerprint() -> tuple[str, str]:
    """(directory, sha256 of its sources) of the ``cluster`` package this process imported."""
    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in _TRAINING_MODULES:
        if os.path.exists(os.path.join(here, name)):
            with open(os.path.join(here, name), "rb") as fh:
                digest.update(name.encode() + b"\0" + fh.read())
    return here, digest.hexdigest()


def _check_same_code(codes: list[tuple[str, str]], nodes: list[tuple[str, str]]) -> None:
    """Refuse to train when a worker imported a different ``cluster`` than the driver (e.g. a node's
    installed copy instead of the job's ``--working-dir``): mixed code silently breaks checkpoints."""
    here, mine = code_fingerprint()
    for rank, (where, theirs) in enumerate(codes):
        if theirs != mine:
            raise ConfigError(
                f"rank {rank} on {nodes[rank][1]} imports the cluster package from {where} (sources "
                f"{theirs[:12]}) but the driver runs {here} ({mine[:12]}): "
                "the workers would not run the job's "
                "code. Submit with `ray job submit --working-dir <repo root>` (Ray puts it first on every "
                "worker's PYTHONPATH), or install the same version of this package on every node"
            )


RELEASE_S = 10.0
"""Seconds the survivors of a failure get to leave the failed collective (and then to reset or report
their state) before they are killed; while they keep coming out, up to ``RELEASE_MAX_S``
(``wait_released``)."""
RELEASE_MAX_S = 40.0
"""The longest the survivors of one failure are waited for, however steadily they come out."""


def wait_released(
    refs: list[Any],
    wait: Callable[[list[Any], int, float], list[Any]],
    clock: Callable[[], float] = time.monotonic,
) -> list[Any]:
    """The survivors' calls that returned: wait ``RELEASE_S`` for all of them, and as long as one came out
    in the last ``RELEASE_S``, go on waiting (at most ``RELEASE_MAX_S`` in all).

    Survivors leave a failed collective in a cascade: each one's error closes its sockets, which fails the
    peers still blocked on it. On a loaded host (many ranks per core) the cascade can outlast a fixed
    wait, and a survivor cut off by it would be killed and replaced instead of kept. A survivor that is
    really stuck stops the cascade, and is given up ``RELEASE_S`` after the last one came out."""
    start = clock()
    last_progress = start
    done: list[Any] = []
    while len(done) < len(refs):
        now = clock()
        until = min(last_progress + RELEASE_S, start + RELEASE_MAX_S)
        if now >= until:
            break
        pending = [r for r in refs if r not in done]
        got = wait(pending, 1, until - now)  # the next one out, or none before ``until``
        if not got:
            break
        done += got
        last_progress = clock()
    return done


NODE_DEAD_WAIT_S = 60.0
"""After a node loss, seconds to wait for Ray to declare the node dead (its health checks; Ray re-places a
placement group's bundles only then) before waiting for room for its ranks."""

_COLLATERAL = ("Connection reset", "Connection closed", "Broken pipe", "Socket Timeout", "peer", "Gloo")


def _collateral(message: str) -> bool:
    return any(s.lower() in message.lower() for s in _COLLATERAL)


def _fmt(res: dict[str, float]) -> str:
    keep = {k: v for k, v in res.items() if not k.startswith(("node:", "memory", "object_store"))}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"


CONNECT_WAVE = 16
"""Ranks that connect to rank 0's store at once in the first wave; each later wave doubles."""


def connect_waves(world_size: int) -> list[list[int]]:
    """Ranks 1..N-1 in waves of 16, 32, 64, ...: a wave starts once the previous one is connected.

    The store looks up the host name of each connecting address in its one event-loop thread (see
    ``cluster.dist.bind_store``); where DNS is slow to answer, many connects at once queue behind each
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


def _kill(actor: Any, what: str) -> None:
    """``ray.kill`` that logs instead of raising: an actor already gone is what we wanted."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:
        logger.info("ray.kill of %s: %s", what, _short(exc))


def _port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _describe(err: BaseException) -> str:
    if isinstance(err, RayTaskError) and isinstance(err.cause, WorkerError):
        return err.cause.message
    return str(err)


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__
