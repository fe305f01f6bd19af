"""The run's record of moves (a preemption notice, a drained node's ranks moved, a slow rank moved, a
resize): a listener of its own beside :class:`cluster.driver.record.RunRecord`, writing through the
record's event log (``RunRecord.event``), so the record itself stays the run's files and its ledger."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from cluster.driver.listeners import DriverListener
from cluster.seam.preemption import Move
from cluster.seam.protocol import SetupInfo
from cluster.spec.schedule import Window


class MoveRecord(DriverListener):
    """The events of the move watch's announcements (docs/events.md: ``preemption_notice``,
    ``preemption_checkpoint``, ``preemption_move``, ``slow_rank_move``, ``slow_rank_moved``, ``resize``)."""

    def __init__(self, write: Callable[..., None]) -> None:
        self._write = write

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
        """The move a group finished, after the record's ``group_started`` (the listener after it)."""
        if move is not None:
            self.moved(move, infos, t_ready)

    def preemption_notice(self, m: Move, now: float, step: int) -> None:
        for n in m.notices:
            left = n.seconds_left(now)
            self._write(
                "preemption_notice",
                node=n.node_id,
                ranks=list(n.ranks),
                deadline=n.deadline,
                seconds_left=None if left is None else round(left, 1),
                step=step,
            )

    def slow_rank_move(self, rank: int, host: str, node: str, step: int, via: str) -> None:
        self._write("slow_rank_move", rank=rank, host=host, node=node, step=step, via=via)

    def slow_rank_move_failed(self, ranks: list[int], why: str) -> None:
        self._write("slow_rank_move_failed", ranks=ranks, reason=why)

    def preemption_checkpoint(self, m: Move, step: int, committed: bool) -> None:
        self._write(
            "preemption_checkpoint",
            step=step,
            committed=committed,
            ranks=m.ranks,
            reason=m.reason,
            seconds_before_deadline=(round(m.deadline - time.time(), 1) if m.deadline is not None else None),
        )

    def moved(self, m: Move, infos: list[SetupInfo], t_ready: float) -> None:
        r = infos[0].resume
        event = ("slow_rank_moved" if m.slow else "preemption_move") if m.replaced else "resize"
        fields: dict[str, Any] = {
            "ranks": m.ranks,
            "from_nodes": sorted(m.nodes),
            "stop_step": m.stop_step,
            "resume_step": r.global_step,
            "lost_steps": max(0, (m.stop_step or 0) - r.global_step),
            "source": r.source,
            "stall_s": round(t_ready - (m.stop_requested_at or t_ready), 3),
            "seconds_before_deadline": round(m.deadline - t_ready, 1) if m.deadline is not None else None,
            "notice_to_moved_s": round(t_ready - m.noticed_at, 3),
        }
        if m.replaced:
            fields["to_nodes"] = [infos[rank].node_id for rank in m.ranks]
            fields["bytes"] = max(i.resume.nbytes for i in infos)
            if m.reason:
                fields["note"] = m.reason
        else:
            fields = {"old": len(infos) + len(m.ranks), "new": len(infos), "at_step": m.stop_step, **fields}
            fields["reason"] = f"preemption: {m.reason}"
        self._write(event, **fields)
