"""The driver's announcements (cluster.driver.listeners): the record listens to every one it writes, and the
announcer hands each to its listeners in order."""

from __future__ import annotations

from typing import Any

from cluster.driver.listeners import ANNOUNCEMENTS, Announcer, DriverListener
from cluster.driver.record import RunRecord
from cluster.driver.record_moves import MoveRecord


def test_the_records_listen_to_every_announcement_but_bare_transitions() -> None:
    def heard_by(cls: type) -> set[str]:
        return {n for n in ANNOUNCEMENTS if getattr(cls, n) is not getattr(DriverListener, n)}

    record, moves = heard_by(RunRecord), heard_by(MoveRecord)
    assert [n for n in ANNOUNCEMENTS if n not in record | moves] == ["state_changed"]
    # the record writes a group's group_started, the move record the move it finished after it: no
    # announcement is written twice
    assert record & moves == {"group_ready"}


def test_the_announcer_hands_each_announcement_to_its_listeners_in_order() -> None:
    heard: list[tuple[str, Any]] = []

    class Ear(DriverListener):
        def __init__(self, name: str) -> None:
            self.name = name

        def event(self, kind: str, /, **fields: Any) -> None:
            heard.append((self.name, (kind, fields)))

    announce = Announcer(Ear("a"))
    announce.add(Ear("b"))
    announce.event("failed", reason="no room")
    announce.print("ignored by both")  # a listener hears only what it overrides
    assert heard == [("a", ("failed", {"reason": "no room"})), ("b", ("failed", {"reason": "no room"}))]
