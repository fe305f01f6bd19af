"""How the driver judges a failure (restart or give up, and after how long) and a hang (a rank whose step
stopped advancing). Pure logic, tested without processes."""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.core.errors import Failure, WorkerError
from cluster.run.history import PastGroup
from cluster.seam.protocol import Heartbeat
from cluster.spec.config import CheckpointConfig, FailureConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    restart: bool
    reason: str
    delay_s: float = 0.0


class FailurePolicy:
    """Restart with exponential backoff until ``max_failures``; the same user error at the same step
    twice is a bug, not bad luck, and fails at once, as does one every rank raised in set-up (whatever
    ``max_failures`` says: the task cannot start anywhere)."""

    def __init__(self, cfg: FailureConfig) -> None:
        self.cfg = cfg

    def decide(self, failure: Failure, history: list[Failure], streak: int | None = None) -> Decision:
        """``history`` holds every failure so far, this one last; ``streak`` counts the failures since
        training last completed an epoch (default: all of them)."""
        count = len(history)
        e = failure.error
        # with failures.nan_skip_steps, a NaN loss is a rollback past its batches, counted as any failure is
        rollback = self.cfg.nan_skip_steps and e is not None and e.detail.get("first_step")
        if e is not None and e.exc_type == "DivergedError" and not rollback:
            return Decision(False, f"training diverged (rank {e.rank}): {e.message}")
        if failure.error is not None and failure.error.exc_type == "ConfigError":
            return Decision(
                False,
                f"a configuration error, found on rank {failure.error.rank} while training: "
                f"{failure.error.message}. Retrying cannot help: fix it, then rerun the same job",
            )
        if (
            failure.kind == "user_error"
            and e is not None
            and e.detail.get("phase") == "setup"
            and e.detail.get("every_rank")
        ):
            return Decision(False, _setup_reason(e))
        if failure.kind == "user_error" and failure.error is not None:
            for prev in history[:-1]:
                if prev.error is not None and prev.error.signature == failure.error.signature:
                    return Decision(
                        False,
                        f"the same {failure.error.exc_type} happened twice at step {failure.error.step}: "
                        "a bug in the task, not a transient failure",
                    )
        if self.cfg.max_failures != -1 and count > self.cfg.max_failures:
            return Decision(
                False,
                f"failures.max_failures={self.cfg.max_failures} exhausted ({count} failures); "
                "raise it (or -1 for unlimited) to keep retrying",
            )
        # The first restart after progress is immediate (like torchrun); repeated failures back off.
        streak = count if streak is None else streak
        delay = 0.0 if streak <= 1 else min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2 ** (streak - 2))
        return Decision(True, f"restart {count}/{self._budget()}", delay)

    def _budget(self) -> str:
        return "unlimited" if self.cfg.max_failures == -1 else str(self.cfg.max_failures)


def _setup_reason(e: WorkerError) -> str:
    message = " ".join(e.message.split())[:500]
    return (
        f"{e.exc_type} at {e.detail.get('where')}: {message}, raised in set-up on every rank: the task's "
        "code (or its config) fails the same way wherever it runs, so retrying cannot help. Fix it "
        "(python -m jobs.train --dry-run tries the set-up on this machine), then rerun"
    )


AUTO_HANG_FACTOR = 10
"""The automatic hang timeout is this many times the slowest step seen (and 3x the longest checkpoint
stall)."""


@dataclass(frozen=True)
class HangHistory:
    """What earlier warm groups of the run showed (``cluster.run.history``, or this driver's own groups):
    the statistics a new group's automatic hang timeout starts from once it took its first step."""

    warm_step_time: float
    """The slowest step those groups took after their warm-up (as ``HangStats.warm_step_time``)."""
    max_stall: float
    """Their longest checkpoint stall."""
    source: str
    """Which groups: ``submission 1 attempt 0, ...`` (the hang timeout's ``from``)."""


@dataclass
class HangStats:
    """What one group's heartbeats showed so far (kept across its epochs): the statistics the automatic
    hang timeout is set from, and whether the group is warm."""

    start_step: int
    """The step the group started at."""
    warmup_steps: int = 100
    """``failures.hang_warmup_steps``."""
    checkpoint_expected: bool = True
    """Checkpoints are configured: the warm-up lasts until one was seen (its stall is then known)."""
    max_step: int = 0
    max_step_time: float = 0.0
    """The slowest step any rank reported since it started (warm-up included: first steps, compilation)."""
    warm_step_time: float = 0.0
    """The slowest step seen after the warm-up steps: the largest median of a heartbeat's steps on any
    rank (``Heartbeat.pace``) and the largest ``step_time_s`` of rank 0's step rows."""
    max_stall: float = 0.0
    """The longest checkpoint stall rank 0 reported (``checkpoint_stall_s`` of its step rows)."""
    checkpoints: int = 0
    history: HangHistory | None = None
    """The run's earlier warm groups (of this world size and config): they make this group warm from its
    first step on (``history_warm``)."""
    history_asked: bool = False
    """Whether the history was looked for (once per group, after its first step)."""

    def trained(self) -> bool:
        """Whether the group trained its warm-up steps."""
        return self.max_step - self.start_step >= self.warmup_steps

    def warm(self) -> bool:
        """Whether the group trained its warm-up steps and, with checkpoints configured, took one."""
        return self.trained() and (self.checkpoints > 0 or not self.checkpoint_expected)

    def stepped(self) -> bool:
        """Whether the group took its first step (a restart's first steps may be slow: compilation, loaders,
        CUDA set-up; until then nothing but its own warm-up counts)."""
        return self.max_step > self.start_step

    def history_warm(self) -> bool:
        """Not warm by its own steps, but its first step is done and the run's history is warm."""
        return self.history is not None and self.stepped() and not self.warm()

    def beat(self, beat: Heartbeat) -> None:
        self.max_step = max(self.max_step, beat.global_step)
        self.max_step_time = max(self.max_step_time, beat.max_step_time_s)
        if beat.pace is not None and self.trained():
            self.warm_step_time = max(self.warm_step_time, beat.pace.step_s)
        if beat.rows:
            self.rows(beat.rows)

    def rows(self, rows: list[dict[str, Any]]) -> None:
        """Rank 0's step rows (streamed with its heartbeats, or with an epoch's result)."""
        for row in rows:
            stall = float(row.get("checkpoint_stall_s") or 0.0)
            if stall > 0:
                self.checkpoints += 1
                self.max_stall = max(self.max_stall, stall)
            if int(row.get("global_step") or 0) - self.start_step > self.warmup_steps:
                self.warm_step_time = max(self.warm_step_time, float(row.get("step_time_s") or 0.0))


def checkpoints_on(c: CheckpointConfig) -> bool:
    """Checkpoints are configured: a group's warm-up lasts until it took one."""
    return c.every_steps > 0 or c.every_epochs > 0


def past_stats(g: PastGroup, warmup_steps: int, checkpoint_expected: bool) -> HangStats:
    """An earlier group's statistics, judged as the hang watch judged them (``HangStats.rows``) from the
    rows and checkpoint events the run folder kept of it (``cluster.run.history``)."""
    st = HangStats(g.start_step, warmup_steps, checkpoint_expected)
    st.max_step = max(g.max_step, *(int(r.get("global_step") or 0) for r in g.rows), g.start_step)
    st.rows(g.rows)
    for stall in g.stalls:
        st.checkpoints += 1
        st.max_stall = max(st.max_stall, stall)
    return st


def warm_history(groups: list[tuple[str, HangStats]]) -> HangHistory | None:
    """What the warm ones of ``groups`` (label, statistics) showed, the slowest of each; None when none
    is warm or none logged a step after its warm-up (a history is never a guess)."""
    warm = [(label, st) for label, st in groups if st.warm() and st.warm_step_time > 0]
    if not warm:
        return None
    return HangHistory(
        max(st.warm_step_time for _, st in warm),
        max(st.max_stall for _, st in warm),
        ", ".join(label for label, _ in warm[-3:]) + (f" and {len(warm) - 3} more" if len(warm) > 3 else ""),
    )


class HangMemory:
    """The run's earlier groups a new group's hang timeout may start from (``HangStats.history``): those
    of earlier submissions, read once when first asked (``load``: ``cluster.run.history``; a read that
    fails only means no history), and this driver's own groups as each is replaced (``remember``). Only
    groups of the same world size and (earlier submissions) the same step-shaping config count."""

    def __init__(
        self, cfg: FailureConfig, checkpoint_expected: bool, load: Callable[[], list[PastGroup]]
    ) -> None:
        self.cfg = cfg
        self.checkpoint_expected = checkpoint_expected
        self._load = load
        self._past: list[tuple[int | None, str, HangStats]] | None = None
        self._own: list[tuple[int | None, str, HangStats]] = []

    def remember(self, world_size: int, stats: HangStats) -> None:
        """A group of this driver ends: its own statistics (not those its history lent it) count for the
        next ones when it was warm."""
        if stats.warm():
            label = f"this job's steps {stats.start_step}-{stats.max_step}"
            self._own.append((world_size, label, dataclasses.replace(stats, history=None)))

    def seed(self, stats: HangStats, world_size: int) -> None:
        """Once the group took its first step: its history, looked for once (the read is off the start's
        path: the group trains meanwhile)."""
        if not stats.history_asked and stats.stepped():
            stats.history_asked = True
            stats.history = self.history(world_size)

    def history(self, world_size: int) -> HangHistory | None:
        if self._past is None:
            self._past = []
            try:
                groups = self._load()
            except Exception as exc:  # no history: the group warms up as it would without one
                logger.warning(
                    "the run's earlier step times could not be read (%s): %s", type(exc).__name__, exc
                )
                groups = []
            for g in groups:
                st = past_stats(g, self.cfg.hang_warmup_steps, self.checkpoint_expected)
                self._past.append((g.world_size, f"submission {g.submission} attempt {g.attempt}", st))
        return warm_history([(lb, st) for w, lb, st in [*self._past, *self._own] if w == world_size])


class HangWatch:
    """Tracks each rank's step; a rank whose step stops advancing past the hang timeout is hung. An
    evaluation's batches count as progress too (``Heartbeat.eval_batches``): a long evaluation is no hang.

    The automatic timeout (``failures.hang_timeout_s`` null): until the group is warm (``HangStats.warm``:
    ``failures.hang_warmup_steps`` steps and a checkpoint), at least ``failures.hang_timeout_floor_s`` and
    10x the slowest step it took; then at least ``failures.hang_timeout_min_s`` and 10x the slowest step
    since its warm-up; always 3x the longest checkpoint stall seen, at most 0.9x the process-group timeout.

    A new group of a run that has a warm history (``HangStats.history``: earlier groups of the same world
    size and step-shaping config that trained their warm-up and took a checkpoint: earlier submissions' as
    the run folder recorded them, this driver's own as they ended; ``HangMemory``) is warm from its own
    first step on: before that step the floor holds as ever (a restart's first step compiles, starts its
    loaders, sets CUDA up); after it, the warm rule with the slowest warm step and the longest stall of the
    history and of the group, and never longer than the warm-up's timeout would be (the history only ever
    shortens it). Once the group is warm by its own steps, the history still counts: the warm rule over
    both (the slower steps and longer stalls win). ``timeout_and_source`` says which rule gave the timeout.
    ``clock``: seconds, monotonic (tests inject one)."""

    def __init__(
        self,
        cfg: FailureConfig,
        start_step: int,
        stats: HangStats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.stats = stats if stats is not None else HangStats(start_step, cfg.hang_warmup_steps)
        self.stats.max_step = max(self.stats.max_step, start_step)
        self._clock = clock
        self._last: dict[int, tuple[int, float]] = {}
        self._evals: dict[int, int] = {}  # each rank's eval batches at its last progress
        self._t0 = clock()

    @property
    def max_step(self) -> int:
        return self.stats.max_step

    def heartbeat_every(self, poll_s: float, tty: bool) -> float:
        """Seconds between heartbeats: ``poll_s`` for a terminal's live bar, else a twentieth of the hang
        timeout within [poll_s, 5 * poll_s]. A death is seen at once either way (the epoch's result fails)."""
        if tty:
            return poll_s
        return min(max(poll_s, self.timeout() / 20), 5 * poll_s)

    @property
    def max_step_time(self) -> float:
        return self.stats.max_step_time

    def steps(self) -> dict[int, int]:
        """rank -> the global step it last reported (the ranks that ever answered)."""
        return {r: s for r, (s, _) in self._last.items()}

    def timeout(self) -> float:
        return self.timeout_and_source()[0]

    def timeout_and_source(self) -> tuple[float, str]:
        """The hang timeout, and where it comes from: ``failures.hang_timeout_s``, ``warm-up`` (the floor,
        or the slowest step so far), ``warm`` (the group's own warm statistics) or ``history (...)``: the
        run's earlier groups, which made it shorter (before this group is warm) or longer (after)."""
        f = self.cfg
        if f.hang_timeout_s is not None:
            return f.hang_timeout_s, "failures.hang_timeout_s"
        st, h = self.stats, self.stats.history
        least = min(f.hang_timeout_min_s, f.hang_timeout_floor_s)
        by_history = 0.0
        if h is not None:
            step_s, stall = max(st.warm_step_time, h.warm_step_time), max(st.max_stall, h.max_stall)
            by_history = max(least, AUTO_HANG_FACTOR * step_s, 3 * stall)
        if st.warm():
            auto, source = max(least, AUTO_HANG_FACTOR * st.warm_step_time, 3 * st.max_stall), "warm"
            if by_history > auto:  # the history saw slower steps or stalls than this group did yet
                auto, source = by_history, f"warm + history ({_source(h)})"
        else:
            auto = max(f.hang_timeout_floor_s, AUTO_HANG_FACTOR * st.max_step_time, 3 * st.max_stall)
            source = "warm-up"
            if st.history_warm() and by_history < auto:  # the history only ever shortens the warm-up's
                auto, source = by_history, f"history ({_source(h)})"
        # below the process-group timeout, so that a stuck collective is seen as a hang before it errors
        return min(auto, 0.9 * f.process_group_timeout_s), source

    def update(self, beats: list[Heartbeat | None]) -> tuple[int, str] | None:
        now = self._clock()
        for rank, beat in enumerate(beats):
            if beat is None:
                continue
            self.stats.beat(beat)
            prev = self._last.get(rank)
            evals = beat.eval_batches
            moved = prev is None or beat.global_step != prev[0] or evals != self._evals.get(rank)
            if moved or not beat.in_epoch:
                self._last[rank] = (beat.global_step, now)
                self._evals[rank] = evals
        limit = self.timeout()
        stalled = [(now - t, rank) for rank, (_, t) in self._last.items()]
        silent = [r for r in range(len(beats)) if r not in self._last]
        if silent and now - self._t0 > limit:
            return silent[0], f"rank {silent[0]} never answered its heartbeat within {limit:.0f}s"
        if stalled:
            age, _rank = max(stalled)
            if age > limit:
                lowest = min(self._last.items(), key=lambda kv: kv[1][0])[0]
                source = self.timeout_and_source()[1]
                return lowest, (
                    f"no progress for {age:.0f}s (hang timeout {limit:.0f}s: {source}); ranks stuck at step "
                    f"{_steps_text(self._last)}, lowest rank {lowest}"
                )
        return None


def _source(h: HangHistory | None) -> str:
    return "" if h is None else h.source


def _steps_text(last: dict[int, tuple[int, float]]) -> str:
    """Each step the ranks stand at, with the ranks there (short at any number of ranks)."""
    from cluster.core.stacks import ranges

    by: dict[int, list[int]] = {}
    for rank, (step, _) in sorted(last.items()):
        by.setdefault(step, []).append(rank)
    return ", ".join(f"{step} (ranks {ranges(ranks)})" for step, ranks in sorted(by.items()))


SLOW_ROUNDS = 3
"""Heartbeat rounds in a row a rank must be slow (or no longer slow) before it is reported (or cleared)."""
SLOW_MIN_GAP_S = 0.002
"""A slow rank's own part must also be this much longer than the others' median: below it, a ratio is
timer noise on a tiny step."""


@dataclass(frozen=True)
class SlowRank:
    rank: int
    ratio: float
    """Its own part of a step against the other ranks' median."""
    compute_s: float
    others_s: float
    """The other ranks' median of their own part."""
    step_s: float
    """Its median whole step (every rank waits for the slowest, so about everyone's step)."""
    input_s: float = 0.0
    """Of ``compute_s``, its wait for its batches: high when its input pipeline is what is slow."""
    others_input_s: float = 0.0


class SlowRankWatch:
    """Finds ranks that hold the others up: a rank whose own part of each step (``Pace.compute_s``) takes at
    least ``ratio`` times the median of the other ranks' in ``SLOW_ROUNDS`` heartbeat rounds in a row is
    slow; after as many rounds below it, it is no longer. One sort per round: O(N log N) in the ranks."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.slow: dict[int, SlowRank] = {}
        self._streak: dict[int, int] = {}  # rank -> rounds in a row on the other side of its state

    def update(self, beats: list[Heartbeat | None]) -> tuple[list[SlowRank], list[SlowRank]]:
        """One heartbeat round; returns the ranks newly slow and the ranks no longer slow."""
        paced = sorted(
            (b.pace.compute_s, rank, b.pace.step_s, b.pace.input_s)
            for rank, b in enumerate(beats)
            if b is not None and b.pace is not None
        )
        if len(paced) < 2:
            return [], []
        values = [c for c, _, _, _ in paced]
        inputs: list[float] = []  # sorted, built only when a rank turns slow
        became, cleared = [], []
        for i, (compute_s, rank, step_s, input_s) in enumerate(paced):
            others = _median_without(values, i)
            slow_now = compute_s >= self.ratio * others and compute_s - others >= SLOW_MIN_GAP_S
            if slow_now == (rank in self.slow):
                self._streak.pop(rank, None)
                continue
            streak = self._streak[rank] = self._streak.get(rank, 0) + 1
            if streak < SLOW_ROUNDS:
                continue
            del self._streak[rank]
            if slow_now:
                ratio = compute_s / others if others > 0 else float("inf")
                inputs = inputs or sorted(p[3] for p in paced)
                others_input = _median_without(inputs, bisect.bisect_left(inputs, input_s))
                self.slow[rank] = SlowRank(rank, ratio, compute_s, others, step_s, input_s, others_input)
                became.append(self.slow[rank])
            else:
                cleared.append(self.slow.pop(rank))
        return became, cleared


def _median_without(values: list[float], i: int) -> float:
    """The median of sorted ``values`` without its ``i``-th element, in O(1)."""
    m = len(values) - 1

    def at(j: int) -> float:  # the j-th element of the list without index i
        return values[j] if j < i else values[j + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2
