"""The step's optional parts (cluster.rank.step_hooks): only those that are on are asked, each at its moments,
in the order the hooks were added."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.rank.faults import Faults
from cluster.rank.replica import ReplicaGuard
from cluster.rank.rollback_points import MemorySnapshots
from cluster.rank.step_hooks import FaultHook, ReplicaHook, SnapshotHook, StepHook, StepHooks, step_hooks
from cluster.spec.load import load_config


def test_parts_that_are_off_are_not_in_the_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLUSTER_INJECT_FAULT", raising=False)
    cfg = load_config(None, [])
    hooks = step_hooks(Faults(cfg, 0, 0), None, ReplicaGuard(0), MemorySnapshots(cfg), 1)
    assert (hooks.before, hooks.after, hooks.end) == ([], [], [])

    on = load_config(
        None,
        [
            "failures.inject=[{rank: 0, step: 3, kind: raise}]",
            "failures.nan_skip_steps=2",
            "failures.nan_snapshot_steps=5",
        ],
    )
    guard = ReplicaGuard(4)
    guard._world = 2  # a group of two (``begin``)
    hooks = step_hooks(Faults(on, 0, 0), None, guard, MemorySnapshots(on), 2)
    kinds = [[type(m.__self__) for m in moments] for moments in (hooks.before, hooks.after, hooks.end)]
    assert kinds == [[FaultHook], [FaultHook], [ReplicaHook, SnapshotHook]]


def test_each_hook_is_asked_at_the_moments_it_acts_at_in_order() -> None:
    heard: list[tuple[str, str]] = []

    class Before(StepHook):
        def before_step(self, s: Any, p: Any) -> None:
            heard.append(("before", "a"))

    class Around(StepHook):
        def before_step(self, s: Any, p: Any) -> None:
            heard.append(("before", "b"))

        def after_step(self, s: Any, p: Any) -> None:
            heard.append(("after", "b"))

    hooks = StepHooks(Before())
    hooks.add(Around())
    for moments in (hooks.before, hooks.after, hooks.end):
        for hook in moments:
            hook(None, None)  # type: ignore[arg-type]
    assert heard == [("before", "a"), ("before", "b"), ("after", "b")]
    assert hooks.end == []
