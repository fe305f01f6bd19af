"""When the training loop evaluates, checkpoints, logs, skips and stops: asked once per step boundary.

Every answer is a pure function of the config, the epoch's length and the global step, so every rank of a
group answers alike without a collective, and a resumed run answers as the uninterrupted one did. Steps are
counted from 1 (global step ``s`` is the ``s``-th optimizer step); the question is always asked *after*
step ``s`` (``s = 0``: before the first).

The planned stop (:class:`StopRequest`) is the one answer that comes from outside: the driver names the
step at which every rank stops, while the epoch runs.

Pure Python (no torch), so the driver and config validation use the same answers as the workers.
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING

from cluster.core.errors import ConfigError

if TYPE_CHECKING:  # cluster.spec.config imports this module for its validation
    from cluster.spec.config import EvaluationConfig, JobConfig

Window = tuple[int, int]
"""Steps ``first``..``last`` (inclusive, 1-based optimizer steps) whose batches are skipped."""

HOLD_STEPS = 2
"""A rank asked to stop (``Worker.hold_stop``) trains at most this many more steps before it learns where."""


def skip_windows(entries: list[int | str], key: str = "training.skip_steps") -> list[Window]:
    """``training.skip_steps`` as sorted, merged windows; ConfigError naming a malformed entry."""
    windows: list[Window] = []
    for i, entry in enumerate(entries):
        text = str(entry).strip()
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", text)
        first = int(m.group(1)) if m else 0
        last = int(m.group(2)) if m and m.group(2) else first
        if m is None or not 1 <= first <= last:
            raise ConfigError(
                f'{key}[{i}]={entry!r} is not a step or a range of steps; write 1450 or "1201-1300" '
                "(inclusive, steps counted from 1, first <= last)"
            )
        windows.append((first, last))
    return merge_windows(windows)


def merge_windows(windows: list[Window]) -> list[Window]:
    """Sorted, with overlapping or adjacent windows joined."""
    out: list[Window] = []
    for first, last in sorted(windows):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


def steps_to_skip(
    windows: list[Window], before: int, start_step: int, steps_per_epoch: int
) -> frozenset[int]:
    """The steps of an epoch (0-based within it, from ``start_step`` on) that ``windows`` (global steps,
    1-based) name, ``before`` global steps having been done before the epoch's first."""
    out: set[int] = set()
    for first, last in windows:
        out.update(range(max(start_step, first - before - 1), min(steps_per_epoch, last - before)))
    return frozenset(out)


def eval_due(step: int, steps_per_epoch: int, epochs: int, e: EvaluationConfig) -> bool:
    """Whether an evaluation belongs after global step ``step`` (the end of each ``every_steps``-th step,
    of each ``every_epochs``-th epoch, and of the last epoch; step 0, before any, with ``at_start``)."""
    if step == 0:
        return e.at_start
    if step < 0 or steps_per_epoch <= 0:
        return False
    if e.every_steps and step % e.every_steps == 0:
        return True
    if step % steps_per_epoch:
        return False
    done = step // steps_per_epoch  # epochs finished
    return done == epochs or bool(e.every_epochs and done % e.every_epochs == 0)


class Schedule:
    """The configured cadence of one run at its epoch length: what is due after global step ``step``.

    A best evaluation's checkpoint and early stopping depend on the evaluations' results, not on the
    cadence: the worker adds them (``cluster.rank.evaluate.BestEval``)."""

    def __init__(self, cfg: JobConfig, steps_per_epoch: int) -> None:
        self.cfg = cfg
        self.steps_per_epoch = steps_per_epoch

    def evaluate(self, step: int) -> bool:
        """An evaluation after ``step`` (:func:`eval_due`)."""
        return eval_due(step, self.steps_per_epoch, self.cfg.training.epochs, self.cfg.evaluation)

    def checkpoint(self, step: int, epoch_end: int | None = None) -> bool:
        """A checkpoint after ``step``: each ``checkpoint.every_steps``-th step; at the end of epoch
        ``epoch_end`` (0-based; None mid-epoch) also each ``every_epochs``-th epoch and the last."""
        c = self.cfg.checkpoint
        by_steps = bool(c.every_steps) and step % c.every_steps == 0
        if epoch_end is None:
            return by_steps
        last = epoch_end + 1 == self.cfg.training.epochs
        return last or by_steps or (bool(c.every_epochs) and (epoch_end + 1) % c.every_epochs == 0)

    def log(self, step: int) -> bool:
        """A step row after ``step`` (rank 0; also at any step that checkpointed)."""
        return step % self.cfg.training.log_every_steps == 0

    def skips(self, windows: list[Window], global_step: int, start_step: int) -> frozenset[int]:
        """The steps of an epoch starting at ``start_step`` with the run at ``global_step`` that
        ``windows`` skip (:func:`steps_to_skip`)."""
        return steps_to_skip(windows, global_step - start_step, start_step, self.steps_per_epoch)


class StopRequest:
    """A planned stop of every rank at the same step boundary, agreed while the epoch runs, in two calls
    from the driver (served by another thread of the process):

    1. ``Worker.hold_stop``: the rank reports its step ``g`` and will not start a step past
       ``g + HOLD_STEPS`` before it knows the stop step (it waits there if it gets that far first).
    2. ``Worker.stop_at``: the stop step ``S``, the same for every rank; the driver takes the largest
       ``g + HOLD_STEPS``, so no rank is past it (ranks of one DDP group are at most a step apart).

    ``dispatch`` names the ``run_epoch`` call it is for: a request for another call is ignored, one that
    arrives before its call started waits for it. Nothing is read per step but two attributes."""

    def __init__(self, dispatch: int | None = None, limit: int = 0) -> None:
        self.dispatch = dispatch
        self.limit = limit
        self.at: int | None = None
        self.checkpoint = False
        self.known = threading.Event()

    def tell(self, dispatch: int, step: int, checkpoint: bool) -> None:
        """Phase 2 (``Worker.stop_at``): stop after ``step``; rank 0 checkpoints there when
        ``checkpoint``."""
        if self.dispatch != dispatch:
            return
        self.at, self.checkpoint = step, checkpoint
        self.known.set()

    def due(self, dispatch: int, step: int, timeout: float) -> bool:
        """At a step boundary, ``step`` steps done: whether the stop ends the epoch here (waits for the
        stop step when this rank reached its hold limit first)."""
        if self.dispatch != dispatch:
            return False
        if self.at is None and step >= self.limit and not self.known.wait(timeout):
            raise RuntimeError(f"asked to stop, but not told at which step within {timeout:g}s")
        return self.at is not None and step >= self.at

    def settle(self, dispatch: int, timeout: float) -> bool:
        """At the epoch's end: whether the stop asks for a checkpoint (waits for the stop step when the
        epoch ended before it was told)."""
        if self.dispatch != dispatch:
            return False
        if not self.known.wait(timeout):
            raise RuntimeError("asked to stop, but not told at which step")  # the epoch ended first
        return self.checkpoint
