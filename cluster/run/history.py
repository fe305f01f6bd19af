"""What a run's earlier worker groups showed: the step rows and checkpoint stalls a new group's automatic
hang timeout may start from (``cluster.driver.policy.HangHistory``, docs/failures.md), read back from what
the run folder already holds.

- the event log (already in the driver's memory, read whole when it opened the run): each submission's
  ``run_start`` (its config), each group's ``group_started`` (its attempt, world size and resume step), and
  each ``checkpoint``'s ``stall_s`` and ``epoch_end``'s step, attributed to the group started last before
  them in the same submission;
- the newest metric files only (``metrics/steps-*.parquet``, at most ``MAX_FILES``, six columns of each):
  rank 0's step and eval rows, each file placed in its submission by the event count in its name (``-s``)
  and in its group by its ``attempt`` column. Files of versions that wrote no event count are left out.

Nothing here decides anything: the hang policy judges which groups were warm.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from cluster.run.logs import read_parquet_bytes
from cluster.run.storage import Storage

MAX_FILES = 16
"""Metric files read, newest first: one per epoch end and one per ``metrics.flush_s`` (30 s) between, so
about the last eight minutes of rows at least. Bounded whatever the run's length."""

COLUMNS = ("kind", "global_step", "step_time_s", "checkpoint_stall_s", "attempt", "world_size")

SHAPING = ("task", "task_args", "scaling", "training", "checkpoint", "evaluation")
"""The config sections that shape a step's time and a checkpoint's stall: a group's history counts for a
new one only when they are equal (but for ``UNSHAPING``)."""
UNSHAPING = {"training": ("epochs", "time_limit_s", "skip_steps")}
"""Keys of those sections that change how long a run trains, not how long one of its steps takes."""

_NAME = re.compile(r"^steps-e\d+-a\d+-s(\d{9})-.*?(\d+)\.parquet$")


@dataclass
class PastGroup:
    """One earlier worker group of the run, as the run folder recorded it."""

    submission: int
    """1 for the run's first submission (the order of ``run_start`` events)."""
    attempt: int
    start_step: int
    """The global step it resumed after (``group_started.resume_step``)."""
    world_size: int | None
    config: dict[str, Any] | None
    """Its submission's config (``run_start.config``, redacted)."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """Its step and eval rows in the files read (``COLUMNS``), oldest first."""
    stalls: list[float] = field(default_factory=list)
    """Each of its checkpoints' ``stall_s`` (``checkpoint`` events)."""
    max_step: int = 0
    """The furthest step its events show (checkpoints, epoch ends)."""


def same_shape(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether two configs (``JobConfig.to_dict``) give the same steps and stalls (``SHAPING``)."""
    if not isinstance(old, dict):
        return False
    for section in SHAPING:
        a, b = old.get(section), new.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            skip = UNSHAPING.get(section, ())
            a = {k: v for k, v in a.items() if k not in skip}
            b = {k: v for k, v in b.items() if k not in skip}
        if a != b:
            return False
    return True


def groups_in(events: list[dict[str, Any]]) -> tuple[dict[tuple[int, int], PastGroup], list[int]]:
    """Each group the events started, by (submission, attempt), with its checkpoints' stalls and the
    furthest step its events show; and the index of each submission's ``run_start`` in ``events``."""
    groups: dict[tuple[int, int], PastGroup] = {}
    starts: list[int] = []
    config: dict[str, Any] | None = None
    current: PastGroup | None = None
    for i, e in enumerate(events):
        kind = e.get("event")
        if kind == "run_start":
            starts.append(i)
            config, current = e.get("config"), None
        elif kind == "group_started" and starts:
            key = (len(starts), int(e.get("attempt") or 0))
            current = groups[key] = PastGroup(
                key[0], key[1], int(e.get("resume_step") or 0), e.get("world_size"), config
            )
            current.max_step = current.start_step
        elif current is not None and kind in ("checkpoint", "epoch_end"):
            step = e.get("step") if kind == "checkpoint" else e.get("global_step")
            current.max_step = max(current.max_step, int(step or 0))
            if kind == "checkpoint":
                current.stalls.append(float(e.get("stall_s") or 0.0))
    return groups, starts


def newest_files(names: list[str], limit: int) -> list[tuple[int, str]]:
    """(event count, name) of the ``limit`` newest metric files that carry an event count, newest first."""
    dated = []
    for name in names:
        m = _NAME.match(name)
        if m:
            dated.append((int(m.group(1)), int(m.group(2)), name))
    dated.sort(reverse=True)
    return [(seq, name) for seq, _, name in dated[:limit]]


def read_past_groups(
    storage: Storage,
    events: Callable[[], list[dict[str, Any]]],
    shape: dict[str, Any] | None = None,
    limit: int = MAX_FILES,
    folder: str = "metrics",
) -> list[PastGroup]:
    """The run's groups in its ``events()`` (``groups_in``), those of a config of the same ``shape`` only
    (``same_shape``; None: all), with their rows from the ``limit`` newest metric files. A file that does
    not read is left out (the rest still count); a storage error propagates."""
    groups, starts = groups_in(events())
    if shape is not None:
        groups = {k: g for k, g in groups.items() if same_shape(g.config, shape)}
    for seq, name in newest_files(storage.listdir(folder), limit):
        submission = bisect.bisect_left(starts, seq)  # run_starts among the first ``seq`` events
        try:
            table = read_parquet_bytes(storage.read_bytes(f"{folder}/{name}"), list(COLUMNS))
        except (pa.ArrowException, OSError, KeyError, ValueError):
            continue
        for row in table.to_pylist():
            if row.get("kind") == "epoch":
                continue  # the driver's mean per epoch: the hang watch never sees it
            g = groups.get((submission, int(row.get("attempt") or 0)))
            if g is not None:
                g.rows.append(row)
    for g in groups.values():
        g.rows.sort(key=lambda r: int(r.get("global_step") or 0))
    return list(groups.values())
