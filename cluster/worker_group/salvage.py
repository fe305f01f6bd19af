"""Keeping workers for the next group: after a failure (the survivors, once out of the failed collective,
and the hot spare in a dead rank's place) or after a stop for a move (every rank but those leaving, the
move's replacements in their place). Both go through one routine: plan who stays and who joins, ask each
to get ready for the next group (reset, or release with its state in memory), keep those that answered,
kill the rest, hand the resources over."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster.core.errors import Failure, device_broken
from cluster.seam.mismatch import suspect_ranks
from cluster.seam.peers import PeerState
from cluster.seam.protocol import EpochResult, Heartbeat, Salvage
from cluster.worker_group.calls import kill, short
from cluster.worker_group.classify import node_dead, rank_errors
from cluster.worker_group.gang import Gang
from cluster.worker_group.placement import Slot
from cluster.worker_group.suspect import end_process

logger = logging.getLogger(__name__)

RELEASE_S = 10.0
"""Seconds the survivors of a failure get to leave the failed collective (and then to reset or report
their state) before they are killed; while they keep coming out, up to ``RELEASE_MAX_S``
(``wait_released``)."""
RELEASE_MAX_S = 40.0
"""The longest the survivors of one failure are waited for, however steadily they come out."""

_WARM_KINDS = ("worker_died", "user_error", "node_lost", "replica_mismatch")
"""The failures after which survivors are kept (the others start a new group from scratch)."""


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


@dataclass
class _Plan:
    """Who a salvage offers to the next group, before they are asked to get ready."""

    world: int
    """The world size the workers are reset to."""
    stay: dict[int, int]
    """next rank -> this group's rank, for the workers that stay."""
    slots: dict[int, Slot]
    """The next group's ranks -> the bundle each runs in."""
    join: dict[int, Any] = field(default_factory=dict)
    """next rank -> a worker that joins: the hot spare (after a failure), a move's replacement."""
    join_wait: float | None = None
    """Seconds the joiners get to get ready; None: the same wait as the workers that stay, together."""
    whole: bool = False
    """All or nothing: one worker that does not get ready and none is kept."""
    not_source: int | None = None
    """This group's rank whose own error caused the failure: reset, never released as a state source."""
    lost_nodes: set[str] = field(default_factory=set)
    rows: list[dict[str, Any]] = field(default_factory=list)
    spare: str | None = None
    """The hot spare's state when it joined: "prepared" or "preparing"."""
    out_s: float = 0.0
    rows_s: float = 0.0


def salvage(
    g: Gang,
    attempt: int,
    failure: Failure | None,
    leaving: Collection[int],
    keep_state: bool | None,
) -> Salvage | None:
    """``RayWorkerGroup.salvage``: see there."""
    if failure is not None:
        plan = _after_failure(g, failure)
        keep_state = g.cfg.failures.recover_from_peers if keep_state is None else keep_state
    else:
        plan = _after_stop(g, leaving)
    if plan is None:
        return None
    t0 = time.perf_counter()
    kept, peers = _get_ready(g, plan, attempt, bool(keep_state))
    if plan.whole and len(kept) < len(plan.stay) + len(plan.join):
        kept = {}  # start anew (after a stop: from the checkpoint the driver made sure of)
    if plan.lost_nodes and kept and not g.placement.bundles_replaced(plan.lost_nodes):
        logger.warning(
            "the lost node's ranks found no room within scaling.resource_wait_s=%gs: the survivors are "
            "not kept, the group starts anew",
            g.cfg.scaling.resource_wait_s,
        )
        kept, peers = {}, {}
    logger.debug(
        "salvage: survivors out %.3fs, rank 0's rows %.3fs, %s %.3fs",
        plan.out_s,
        plan.rows_s,
        "released" if keep_state else "reset",
        time.perf_counter() - t0,
    )
    g.spare.kill()
    _kill_others(g, plan, kept)
    if not kept:
        g.placement.remove()
        g.actors = []
        return None
    joined = all(r in kept for r in plan.join)  # after a failure, the spare is the only one that joins
    result = Salvage(
        resources=g.placement.hand_over(plan.slots),
        actors=kept,
        peers=peers if keep_state else None,
        rows=plan.rows,
        spare=plan.spare if plan.spare is not None and joined else None,
    )
    g.actors = []
    return result


def _after_failure(g: Gang, failure: Failure) -> _Plan | None:
    """The survivors that left the failed collective keep their ranks; the hot spare takes a single
    missing rank's place. None when no warm restart is due."""
    t0 = time.perf_counter()
    fcfg = g.cfg.failures
    if not fcfg.warm_restart or (failure.kind not in _WARM_KINDS and not hung_alone(failure)):
        return None
    if not g.placement.slots or not g.pending:
        return None
    g.cancel_move()  # a failure during a move: the ranks recover as from any failure
    dead, lost_nodes = _dead(g, failure)
    out = _released(g, dead)
    t_out = time.perf_counter()
    rows = _rank0_rows(g) if 0 in out else []
    plan = _Plan(
        world=g.world_size,
        stay={r: r for r in out},
        slots=dict(g.placement.slots),
        not_source=failure.rank,
        lost_nodes=lost_nodes,
        rows=rows,
        out_s=t_out - t0,
        rows_s=time.perf_counter() - t_out,
    )
    missing = [r for r in range(len(g.actors)) if r not in out]
    if g.spare.actor is not None and g.spare.node in lost_nodes:
        g.spare.kill()  # it went with its node
    plan.spare = g.spare.state() if len(missing) == 1 else None
    if plan.spare is not None:
        # The hot spare becomes the dead rank, where it runs (the bundle it was placed in: under auto,
        # on a node with a free CPU share). One still preparing is taken too: it is further along than
        # a process started now would be. Its reset runs beside its preparation (the actor takes two
        # calls at once); setup waits for the task it builds.
        plan.join = {missing[0]: g.spare.take()}
        # a spare still starting answers once its process is up: as long as a new process would take
        plan.join_wait = RELEASE_S if plan.spare == "prepared" else fcfg.process_group_timeout_s
    return plan


def _dead(g: Gang, failure: Failure) -> tuple[set[int], set[str]]:
    """The ranks whose processes are gone or must not be reused, and the nodes lost with the failure."""
    dead = {r for r, e in rank_errors(g.pending, 0.0).items() if isinstance(e, RayActorError)}
    lost_nodes: set[str] = set()
    if failure.kind == "node_lost":
        # one incident: every rank of every lost node went with it, however many that is
        lost_nodes = {n for n in {n for n, _ in g.nodes} if node_dead(n)}
        dead |= {r for r, (n, _) in enumerate(g.nodes) if n in lost_nodes}
    if failure.rank is not None and (
        failure.kind == "worker_died" or (g.cfg.scaling.use_gpu and device_broken(failure.error))
    ):
        dead.add(failure.rank)  # a CUDA error may be sticky (a device-side assert): that process goes
    dead |= suspect_ranks(failure)  # ranks whose parameters differed: never reused
    if hung_alone(failure) and failure.rank is not None:
        # SIGKILL by pid: a stopped process answers no actor call, but its sockets close at once, which
        # fails the collective its peers wait in
        dead.add(failure.rank)
        if failure.rank < len(g.pids):
            end_process(g.nodes[failure.rank][0], g.pids[failure.rank])
    return dead, lost_nodes


def hung_alone(failure: Failure) -> bool:
    """A hang whose suspect the stacks told apart (``cluster.driver.hang``): only that rank is replaced."""
    return failure.kind == "hang" and failure.hang is not None and failure.hang.keep_survivors


def _released(g: Gang, dead: set[int]) -> list[int]:
    """Kill ``dead``; the other ranks that left the failed collective within the release wait."""
    for r in dead:
        kill(g.actors[r], f"rank {r}")  # a dead process's sockets close: its peers' collectives fail
    alive = [r for r in range(len(g.actors)) if r not in dead]
    if g.cfg.scaling.use_gpu:  # NCCL does not fail a collective whose peer is gone: abort it
        for r in alive:
            g.actors[r].abort.remote()
    refs = [g.pending[r] for r in alive]
    done = wait_released(refs, lambda rs, n, t: ray.wait(rs, num_returns=n, timeout=t)[0])
    errors = rank_errors(g.pending, 0.0)
    out = [r for r in alive if g.pending[r] in done and not isinstance(errors.get(r), RayActorError)]
    for r in alive:
        if r not in out:
            logger.warning("rank %d did not leave the failed collective within %gs: not kept", r, RELEASE_S)
    return out


def _after_stop(g: Gang, leaving: Collection[int]) -> _Plan:
    """Every rank but ``leaving`` stays; a ready move's replacements take the leaving ranks (same
    numbers), or, without one, the others are renumbered 0..K-1."""
    move, g.move = g.move, None
    g.spare.kill()
    keep = [r for r in range(len(g.actors)) if r not in leaving]
    plan = _Plan(world=0, stay={}, slots={}, whole=True)
    if move is not None and move.actors is not None and sorted(move.ranks) == sorted(leaving):
        plan.stay = {r: r for r in keep}
        for i, r in enumerate(move.ranks):
            plan.join[r], plan.slots[r] = move.actors[r], (move.pg, i)
        g.placement.extra_pgs.append(move.pg)
    else:
        if move is not None:
            g.move = move
            g.cancel_move()
        plan.stay = dict(enumerate(keep))  # renumbered 0..K-1
    for new, old in plan.stay.items():
        plan.slots[new] = g.placement.slots[old]
    plan.world = len(plan.stay) + len(plan.join)
    return plan


def _get_ready(
    g: Gang, plan: _Plan, attempt: int, keep_state: bool
) -> tuple[dict[int, Any], dict[int, PeerState]]:
    """Reset (or, with ``keep_state``, release) every worker of ``plan`` to its next rank; the workers that
    answered in time (next rank -> worker) and the state each released one holds."""
    workers = {new: g.actors[old] for new, old in plan.stay.items()} | plan.join
    calls: dict[int, Any] = {}
    for new, old in plan.stay.items():
        method = "release" if keep_state and old != plan.not_source else "reset"
        calls[new] = getattr(g.actors[old], method).remote(new, plan.world, attempt)
    joins = {new: actor.reset.remote(new, plan.world, attempt) for new, actor in plan.join.items()}
    if plan.join_wait is None:
        batches = [(calls | joins, RELEASE_S)]
    else:
        batches = [(calls, RELEASE_S), (joins, plan.join_wait)]
    kept: dict[int, Any] = {}
    peers: dict[int, PeerState] = {}
    for batch, wait_s in batches:
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
                logger.warning("rank %d could not be reset, not kept: %s", r, short(exc))
                continue
            kept[r] = workers[r]
            if isinstance(state, PeerState):
                peers[r] = state
    return kept, peers


def _kill_others(g: Gang, plan: _Plan, kept: dict[int, Any]) -> None:
    """Kill every worker of this group and every joiner not in ``kept`` (next rank -> worker)."""
    staying = {old for new, old in plan.stay.items() if new in kept}
    for r, actor in enumerate(g.actors):
        if r not in staying:
            kill(actor, f"rank {r}")
    for r, actor in plan.join.items():
        if r not in kept:
            kill(actor, f"the worker that was to join as rank {r}")


def _rank0_rows(g: Gang) -> list[dict[str, Any]]:
    """Rank 0's step rows not yet reported (its epoch result, or its buffer), once it left the group."""
    try:
        result = ray.get(g.pending[0], timeout=0)
        if isinstance(result, EpochResult):
            return list(result.step_rows)
    except (RayTaskError, RayActorError, GetTimeoutError):
        pass  # its epoch failed: the rows are still in its buffer
    rows: list[dict[str, Any]] = []
    for ref in [g.beats.pop(0, None), g.actors[0].heartbeat.remote()]:
        if ref is None:
            continue
        try:
            beat: Heartbeat = ray.get(ref, timeout=5.0)
            rows.extend(beat.rows)
        except Exception as exc:
            logger.warning("rank 0's last step rows could not be collected: %s", short(exc))
    return rows
