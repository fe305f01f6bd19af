"""Checks of a real run's goodput account (``cluster.run.goodput``) that hold whatever the machine's speed:
every class non-negative, the classes adding up to the wall clock (within 1% or 0.5 s) and so do the
attempts', the wall clock covering the run's own events and inside the harness's clock."""

from __future__ import annotations

from typing import Any

from cluster.inspect import read_events
from cluster.run.goodput import CLASSES, Goodput, run_goodput
from cluster.run.storage import Storage


def account(run_url: str, harness_s: float | None = None) -> Goodput:
    """The run's account, checked; ``harness_s``: the seconds the test measured around the whole run."""
    g = run_goodput(run_url)
    assert g is not None, f"{run_url} has no goodput account"
    assert set(g.seconds) == set(CLASSES) and all(v >= 0 for v in g.seconds.values()), g.seconds
    total = sum(g.seconds.values())
    assert abs(total - g.wall_s) <= max(0.01 * g.wall_s, 0.5), (total, g.wall_s)
    per: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
    for classes in g.attempts.values():
        for k, v in classes.items():
            per[k] += v
    assert all(abs(per[k] - g.seconds[k]) <= 0.01 + 1e-3 * g.seconds[k] for k in CLASSES), (per, g.seconds)
    events: list[dict[str, Any]] = read_events(Storage(run_url))
    end = [e for e in events if e["event"] == "goodput"]
    assert end, "no goodput event at the run's end"
    span = float(end[-1]["time"]) - float(events[0]["time"])  # the first run_start to the account's end
    assert g.wall_s >= span - 0.5, (g.wall_s, span)
    if harness_s is not None:
        assert g.wall_s <= harness_s + 0.5, (g.wall_s, harness_s)
    assert 0 < g.ettr <= 1
    return g
