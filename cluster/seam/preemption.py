"""Spot and preemptible nodes: Ray's drain notices, and the driver's plan to move ranks off a draining node.

A cloud provider gives a notice (30 s to 2 min) before it takes a spot node; Ray learns it as a drain with a
deadline (the autoscaler, or ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds N``, both call the GCS drain API; the worker group reads them:
``cluster.worker_group.placement.draining_nodes``). Ray places no new bundle on a draining node,
and refuses an idle-termination drain of a node that runs actors (so a node holding ranks is never taken as
idle). What the driver does with a notice (docs/failures.md):

1. record ``preemption_notice`` (node, ranks on it, deadline);
2. place replacements for those ranks on nodes that are not draining and prepare them (task, dataset) while
   training goes on;
3. stop every rank at the same step boundary (``Worker.hold_stop`` / ``Worker.stop_at``), retire the
   draining ranks, and start the group again with the replacements, which receive the state from a
   healthy rank (``failures.recover_from_peers``) or from a checkpoint committed at that step;
4. when no replacement is ready ``failures.preemption_margin_s`` before the deadline: stop, commit a
   checkpoint at that step, and continue with fewer ranks when ``scaling.min_workers`` allows, else on the
   same ranks until the node goes (its loss is then recovered like any lost node).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DrainNotice:
    """A draining node that holds ranks of the group."""

    node_id: str
    ranks: tuple[int, ...]
    deadline: float | None
    """Seconds since the epoch when the node will be taken; None when the drain has no deadline."""

    def seconds_left(self, now: float | None = None) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)


@dataclass
class Move:
    """The driver's record of one move in progress: from the notice to the group started without the
    draining ranks."""

    notices: list[DrainNotice]
    ranks: list[int]
    via: str
    """``peers`` (a healthy rank sends the state) or ``checkpoint`` (committed at the stop step)."""
    noticed_at: float
    must_stop_by: float | None
    """Time (seconds since the epoch) by which the group must be stopped: the earliest deadline less
    ``failures.preemption_margin_s``; None without a deadline."""
    prepared: bool = False
    """Replacements are being placed (not when the notice was too short for it)."""
    replaced: bool = False
    """Replacements are placed and prepared: the stop moves the ranks. False at the stop: no room in time."""
    stop_step: int | None = None
    stop_requested_at: float | None = None
    reason: str = ""
    """Why the ranks are not moved (no room in time), when they are not."""
    nodes: set[str] = field(default_factory=set)
    slow: bool = False
    """A move of a slow rank (``failures.slow_rank_action=move``), not of a draining node's: no deadline,
    and when no replacement can be placed it is dropped, not turned into a checkpoint and a shrink."""

    @property
    def stopping(self) -> bool:
        return self.stop_step is not None

    @property
    def deadline(self) -> float | None:
        deadlines = [n.deadline for n in self.notices if n.deadline is not None]
        return min(deadlines) if deadlines else None
