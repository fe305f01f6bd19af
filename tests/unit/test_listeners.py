"""The driver's announcements (cluster.driver.listeners): the record listens to every one it writes, and the
announcer hands each to its listeners in order."""

from __future__ import annotations

from typing import Any

from cluster.driver.listeners import ANNOUNCEMENTS, Announcer, DriverListener
from cluster.driver.record import RunRecord


def test_the_record_listens_to_every_announcement_but_bare_transitions() -> None:
    inherited = [n for n in ANNOUNCEMENTS if getattr(RunRecord, n) is getattr(DriverListener, n)]
    assert inherited == ["state_changed"]


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
