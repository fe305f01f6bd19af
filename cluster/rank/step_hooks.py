"""Step hooks: the optional parts of a training step, each asked once per step, each deciding for itself
whether it is due (as torchtitan's ``checkpointer.save(step, last_step=...)`` and
``validator.should_validate(step)`` do), so the training loop (``Worker._run_epoch``) stays one screen as
new guards arrive.

A step has three moments, asked in this order, and each hook's parts at a moment in the order the hooks
were added:

- ``before_step``: a step is about to train (its time already counted; ``p.global_step`` is still the step
  before): the injected faults (crash, hang, raise, flip a bit, slow, arm a crash in backward), then the
  profiler (starts a trace asked for);
- ``after_step``: the step just trained, its update done and counted (``p.global_step`` is the step), before
  anything else: the faults (a crash right after the update), then the profiler (marks the step);
- ``step_end``: the step boundary after a step trained or was skipped, every rank at the same step: the
  replica guard (reads the check launched earlier, launches one when due), then the rollback points in
  memory (copy the state when due).

Only the parts that are on are in the lists (:func:`step_hooks`, at each setup; the profiler joins at its
first request), so a step with none on loops over empty lists. What stays in the loop: the pace (its marks
time the step itself), the divergence watch (it reads the step's loss and rank 0's row, and its epoch-end
check is a collective of every rank), evaluation and checkpoints (the schedule's, with their own results).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.rank.faults import Faults
    from cluster.rank.profiling import StepProfiler
    from cluster.rank.replica import ReplicaGuard
    from cluster.rank.rollback_points import MemorySnapshots
    from cluster.rank.session import TrainSession
    from cluster.rank.train_state import RunPosition

Moment = Callable[["TrainSession", "RunPosition"], None]


class StepHook:
    """One optional part of a step (module doc): it overrides the moments it acts at."""

    def before_step(self, s: TrainSession, p: RunPosition) -> None:
        """Step ``p.global_step + 1`` is about to train."""

    def after_step(self, s: TrainSession, p: RunPosition) -> None:
        """Step ``p.global_step`` just trained."""

    def step_end(self, s: TrainSession, p: RunPosition) -> None:
        """Step ``p.global_step`` trained or was skipped: every rank is at this boundary."""


class StepHooks:
    """The moments of the hooks that are on, as lists of bound methods (each asked once per step)."""

    def __init__(self, *hooks: StepHook) -> None:
        self.before: list[Moment] = []
        self.after: list[Moment] = []
        self.end: list[Moment] = []
        for hook in hooks:
            self.add(hook)

    def add(self, hook: StepHook) -> None:
        """A hook after the others (the profiler's, at its first request: safe while a step runs)."""
        for name, moments in (
            ("before_step", self.before),
            ("after_step", self.after),
            ("step_end", self.end),
        ):
            if getattr(type(hook), name) is not getattr(StepHook, name):
                moments.append(getattr(hook, name))


class FaultHook(StepHook):
    """The faults injected on purpose at a step (``cluster.rank.faults``)."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    def before_step(self, s: TrainSession, p: RunPosition) -> None:
        self.faults.before_step(p.global_step + 1, s.raw_model)

    def after_step(self, s: TrainSession, p: RunPosition) -> None:
        self.faults.after_step(p.global_step)


class ProfilerHook(StepHook):
    """A profile asked for (``cluster.rank.profiling``): started before a step, each step marked."""

    def __init__(self, profiler: StepProfiler) -> None:
        self.profiler = profiler

    def before_step(self, s: TrainSession, p: RunPosition) -> None:
        self.profiler.before_step(s.device)

    def after_step(self, s: TrainSession, p: RunPosition) -> None:
        self.profiler.after_step(p.global_step)


class ReplicaHook(StepHook):
    """The ranks compare their parameters (``cluster.rank.replica``, ``failures.replica_check_steps``)."""

    def __init__(self, guard: ReplicaGuard) -> None:
        self.guard = guard

    def step_end(self, s: TrainSession, p: RunPosition) -> None:
        self.guard.after_step(p.global_step)


class SnapshotHook(StepHook):
    """Rollback points in memory after a NaN loss (``cluster.rank.rollback_points``)."""

    def __init__(self, memory: MemorySnapshots, world_size: int) -> None:
        self.memory = memory
        self.world_size = world_size

    def step_end(self, s: TrainSession, p: RunPosition) -> None:
        self.memory.after_step(s, p, self.world_size)


def step_hooks(
    faults: Faults,
    profiler: StepProfiler | None,
    replica: ReplicaGuard,
    memory: MemorySnapshots,
    world_size: int,
) -> StepHooks:
    """The hooks of a group that are on (after ``ReplicaGuard.begin``: it knows the group's size)."""
    hooks: list[StepHook] = []
    if faults.specs:
        hooks.append(FaultHook(faults))
    if profiler is not None:
        hooks.append(ProfilerHook(profiler))
    if replica.on:
        hooks.append(ReplicaHook(replica))
    if memory.on:
        hooks.append(SnapshotHook(memory, world_size))
    return StepHooks(*hooks)
