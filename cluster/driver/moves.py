"""Changing where a running group trains, decided at heartbeats: drain notices (spot nodes about to go),
slow ranks (``failures.slow_rank_action``) and growing back once the cluster has room again.

:class:`MoveWatch` looks (at most once per ``DRAIN_POLL_S`` / ``GROW_POLL_S``), records what it sees, and
returns a decision; :func:`carry_out` carries it out on the group (the driver calls it). The watch never
changes the group itself. The group's mode (``None``, a :class:`cluster.driver.states.Stop`, a
:class:`cluster.driver.states.Grow` or a :class:`cluster.seam.preemption.Move`) is the driver's; the watch
reads it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.driver.listeners import DriverListener
from cluster.driver.policy import SlowRankWatch
from cluster.driver.states import Grow, Mode
from cluster.seam.preemption import DrainNotice, Move
from cluster.seam.protocol import SetupInfo, WorkerGroup
from cluster.spec.config import JobConfig

logger = logging.getLogger(__name__)

GROW_POLL_S = 2.0
"""While smaller than ``scaling.num_workers``: at most one check for room to grow per this many seconds."""
DRAIN_POLL_S = 1.0
"""At most one read of Ray's draining nodes (one GCS query) per this many seconds; reads happen at
heartbeats and epoch ends."""


@dataclass(frozen=True)
class Prepare:
    """Start placing replacements for ``move.ranks`` (``avoid``: nodes not to place them on), and make the
    move the group's mode. ``place=False``: the notice leaves no time to place anything."""

    move: Move
    avoid: list[str] | None = None
    place: bool = True


@dataclass(frozen=True)
class StopFor:
    """Stop the group at a step boundary for the move (replacements ready, or time is up)."""

    move: Move


@dataclass(frozen=True)
class Cancel:
    """Give up placing the move's replacements; then stop for it (``stop``: a drain's checkpoint and
    shrink) or drop it (a slow rank stays where it is)."""

    move: Move
    stop: bool


@dataclass(frozen=True)
class GrowNow:
    """The cluster has room for the missing workers: stop with a checkpoint and start the full group."""


Decision = Prepare | StopFor | Cancel | GrowNow


def carry_out(d: Decision, group: WorkerGroup, mode: Mode, slow: Callable[[Move], None]) -> Mode:
    """Carry out a decision of the watch on the group; returns the group's mode after it. ``slow`` is told
    of a slow rank's move before anything is placed (an incident of the node the rank leaves)."""
    if isinstance(d, Prepare):
        if d.move.slow:
            slow(d.move)
        if d.place:
            if d.avoid is None:
                group.prepare_move(d.move.ranks)
            else:
                group.prepare_move(d.move.ranks, avoid=d.avoid)
            d.move.prepared = True
        return d.move
    if isinstance(d, StopFor):
        stop_for(group, d.move)
    elif isinstance(d, Cancel):
        group.cancel_move()
        if d.stop:
            stop_for(group, d.move)
        else:
            return None
    elif isinstance(d, GrowNow):
        return Grow(group.stop(checkpoint=True))
    return mode


def stop_for(group: WorkerGroup, m: Move) -> None:
    """Stop the group at a step boundary; with a checkpoint unless the replacements take the state from a
    healthy rank."""
    m.stop_requested_at = time.time()
    m.stop_step = group.stop(checkpoint=not m.replaced or m.via == "checkpoint")


class MoveWatch:
    """Drains, slow-rank moves and growing back (module doc). ``new_group`` is called for each group."""

    def __init__(self, cfg: JobConfig, announce: DriverListener) -> None:
        self.cfg = cfg
        self.announce = announce
        self.drained: set[str] = set()  # nodes whose notice was acted on (never twice)
        self.slow_nodes: set[str] = set()  # nodes a slow rank was moved off: no replacement goes there
        self.rank_hosts: list[str] = []  # the current group's, by rank
        self.rank_nodes: list[str] = []  # the current group's Ray node ids, by rank
        self.slow: SlowRankWatch | None = None  # the current group's, when failures.slow_rank_ratio is set
        self._next_drain_check = 0.0
        self._next_grow_check = 0.0
        self._drain_error_logged = False
        self._grow_error_logged = False

    def new_group(self, infos: list[SetupInfo]) -> None:
        ratio = self.cfg.failures.slow_rank_ratio
        self.slow = SlowRankWatch(ratio) if ratio is not None and len(infos) > 1 else None
        self.rank_hosts = [i.hostname for i in infos]
        self.rank_nodes = [i.node_id for i in infos]

    def host(self, rank: int) -> str:
        return self.rank_hosts[rank] if rank < len(self.rank_hosts) else ""

    def forget(self, m: Move) -> None:
        """A move given up before it stopped the group: the next group acts on the notice again."""
        self.drained -= m.nodes

    # ------------------------------------------------------------------ drains
    def drains(
        self, group: WorkerGroup, mode: Any, running: bool, world_size: int, step: int
    ) -> Decision | None:
        """Between heartbeats and at epoch ends: look for drain notices (at most once a second). While an
        epoch runs (``running``), push a move in progress on: stop once its replacements are ready, or with
        a checkpoint when time runs out (a stop needs a running epoch: it is agreed by the ranks in it)."""
        f = self.cfg.failures
        now = time.time()
        if mode is None:
            if not f.preemption or now < self._next_drain_check:
                return None
            self._next_drain_check = now + DRAIN_POLL_S
            try:
                notices = [n for n in group.draining() if n.node_id not in self.drained]
            except Exception as exc:  # reading Ray's drains must never stop training
                if not self._drain_error_logged:
                    logger.warning("could not read Ray's draining nodes: %s: %s", type(exc).__name__, exc)
                    self._drain_error_logged = True
                return None
            return self._notice(notices, now, world_size, step) if notices else None
        if not isinstance(mode, Move) or mode.stopping or not running:
            return None
        return self._progress(group, mode, now)

    def _notice(self, notices: list[DrainNotice], now: float, world_size: int, step: int) -> Decision:
        f = self.cfg.failures
        ranks = sorted({r for n in notices for r in n.ranks})
        stays = len(ranks) < world_size
        via = "peers" if f.recover_from_peers and f.warm_restart and stays else "checkpoint"
        m = Move(notices, ranks, via, now, None, nodes={n.node_id for n in notices})
        self.announce.preemption_notice(m, now, step)
        if m.deadline is not None:
            m.must_stop_by = m.deadline - f.preemption_margin_s
        self.drained |= m.nodes
        if m.must_stop_by is not None and now >= m.must_stop_by:
            m.reason = (
                f"the notice leaves {m.deadline - now:.0f}s, under failures.preemption_margin_s="  # type: ignore[operator]
                f"{f.preemption_margin_s:g}s: no time to place replacements"
            )
            return Prepare(m, place=False)
        return Prepare(m)

    def _progress(self, group: WorkerGroup, m: Move, now: float) -> Decision | None:
        f, wait_s = self.cfg.failures, self.cfg.scaling.resource_wait_s
        if not m.prepared:  # the notice was too short to place anything
            return StopFor(m)
        status = group.move_status()
        late = m.must_stop_by is not None and now >= m.must_stop_by
        waited_out = m.must_stop_by is None and now - m.noticed_at > wait_s
        if m.slow and status != "ready" and (status.startswith("failed") or waited_out):
            why = (
                status.removeprefix("failed: ")
                if status.startswith("failed")
                else f"no room on another node within scaling.resource_wait_s={wait_s:g}s"
            )
            self.announce.slow_rank_move_failed(m.ranks, why)
            return Cancel(m, stop=False)
        if status == "ready":
            m.replaced = True
            return StopFor(m)
        if status.startswith("failed") or late or waited_out:
            m.reason = (
                status.removeprefix("failed: ")
                if status.startswith("failed")
                else f"no room for {len(m.ranks)} replacement(s) on a node that is not draining "
                + (
                    f"by {f.preemption_margin_s:g}s before the deadline (failures.preemption_margin_s)"
                    if late
                    else f"within scaling.resource_wait_s={wait_s:g}s"
                )
            )
            return Cancel(m, stop=True)
        return None

    # ------------------------------------------------------------------ slow ranks
    def pace(
        self, beats: list[Any], step: int, attempt: int, may_move: bool, world_size: int
    ) -> Decision | None:
        """Report a rank that holds the others up (and when it no longer does). With
        ``failures.slow_rank_action=move`` and ``may_move`` (no stop, grow or other move under way): place
        a replacement for it on another node; the move machinery of drain notices takes it there (prepared
        while training goes on, then a stop between two steps and the state from a healthy rank)."""
        if self.slow is None:
            return None
        became, cleared = self.slow.update(beats)
        for r in became:
            self.announce.slow_rank(r, self.host(r.rank), step, attempt)
        for r in cleared:
            self.announce.slow_rank_cleared(r.rank, self.host(r.rank), step, attempt)
        if not became or self.cfg.failures.slow_rank_action != "move":
            return None
        rank = became[0].rank
        if not may_move or world_size < 2 or rank >= len(self.rank_nodes):
            return None
        f = self.cfg.failures
        node = self.rank_nodes[rank]
        self.slow_nodes.add(node)
        via = "peers" if f.recover_from_peers and f.warm_restart else "checkpoint"
        m = Move([DrainNotice(node, (rank,), None)], [rank], via, time.time(), None, nodes={node}, slow=True)
        self.announce.slow_rank_move(rank, self.host(rank), node, step, via)
        return Prepare(m, avoid=sorted(self.slow_nodes))

    # ------------------------------------------------------------------ growing back
    def grow(self, group: WorkerGroup, world_size: int) -> Decision | None:
        """While a smaller group trains (and nothing else is under way): once the cluster has room for the
        missing workers, stop at the next step boundary with a checkpoint there and start the full group
        from it (no waiting for the epoch's end; nothing lost). At most every ``GROW_POLL_S``."""
        missing = self.cfg.scaling.num_workers - world_size
        now = time.time()
        if missing <= 0 or now < self._next_grow_check:
            return None
        self._next_grow_check = now + GROW_POLL_S
        return GrowNow() if self.room_for(group, missing) else None

    def room_for(self, group: WorkerGroup, missing: int) -> bool:
        """Whether the cluster has room for ``missing`` more workers now; False (with one warning) when Ray
        cannot be asked: asking must never stop training, and it is asked again later."""
        try:
            return group.available_for(missing)
        except Exception as exc:
            if not self._grow_error_logged:
                logger.warning("could not ask Ray for room to grow: %s: %s", type(exc).__name__, exc)
                self._grow_error_logged = True
            return False
