"""Where every rank is: the Python stacks of each rank's threads, taken from another thread of the rank's
process (``sys._current_frames``), grouped by where the training thread stands.

The driver takes them when it finds a hang, before it kills the group (the ``stacks`` event and a file
under ``<run>/diagnostics/``), and on request while a job trains (``python -m cluster stacks RUN``). A rank
hung in a collective shows the collective's Python call; a rank stuck in user code shows that line. A rank
whose process holds the GIL in native code cannot answer, and is named as silent.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

MAX_FRAMES = 60
"""Innermost frames kept per thread (a deep recursion must not make a report of megabytes)."""


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    code: str = ""

    def short(self) -> str:
        return f"{self.function} ({_short_path(self.file)}:{self.line})"


@dataclass(frozen=True)
class ThreadStack:
    name: str
    training: bool
    """The thread that runs the rank's epochs (steps, collectives, evaluation, checkpoints)."""
    frames: list[Frame] = field(default_factory=list)
    """Outermost first, as tracebacks print."""


def take(training_ident: int | None) -> list[ThreadStack]:
    """Every thread of this process but the calling one, the training thread first."""
    import linecache

    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        frames: list[Frame] = []
        f: Any = frame
        while f is not None and len(frames) < MAX_FRAMES:
            code = f.f_code
            text = linecache.getline(code.co_filename, f.f_lineno).strip()
            frames.append(Frame(code.co_filename, f.f_lineno, code.co_name, text))
            f = f.f_back
        frames.reverse()
        out.append(ThreadStack(names.get(ident, f"thread {ident}"), ident == training_ident, frames))
    out.sort(key=lambda t: (not t.training, t.name))
    return out


def where(stack: ThreadStack) -> str:
    """One line: the innermost frame, and the innermost one outside installed libraries (the product's or
    the task's code that called into them) when that is another frame."""
    if not stack.frames:
        return "no Python frame"
    inner = stack.frames[-1]
    own = next((f for f in reversed(stack.frames) if not _library(f.file)), None)
    if own is None or own is inner:
        return inner.short()
    return f"{inner.short()} from {own.short()}"


@dataclass(frozen=True)
class StackGroup:
    ranks: list[int]
    where: str
    """The training thread's position (``where``), or ``idle`` when the rank runs no epoch."""


def group(stacks: dict[int, list[ThreadStack] | None]) -> tuple[list[StackGroup], list[int]]:
    """Ranks grouped by their training thread's stack (same frames, same lines), largest group first; and
    the ranks that did not answer."""
    by_key: dict[tuple[Any, ...], tuple[list[int], str]] = {}
    silent = []
    for rank in sorted(stacks):
        threads = stacks[rank]
        if threads is None:
            silent.append(rank)
            continue
        train = next((t for t in threads if t.training), None)
        if train is None:
            key: tuple[Any, ...] = ("idle",)
            text = "idle (no epoch running)"
        else:
            key = tuple((f.file, f.line, f.function) for f in train.frames)
            text = where(train)
        by_key.setdefault(key, ([], text))[0].append(rank)
    groups = [StackGroup(ranks, text) for ranks, text in by_key.values()]
    groups.sort(key=lambda g: (-len(g.ranks), g.ranks[0]))
    return groups, silent


def render(
    reason: str, stacks: dict[int, list[ThreadStack] | None], hosts: list[str], step: int | None
) -> str:
    """The report file: a summary by group, then every rank's threads (identical training stacks once)."""
    groups, silent = group(stacks)
    lines = [
        f"# stacks of {len(stacks)} rank(s): {reason}",
        f"# taken {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
        + (f", furthest step {step}" if step is not None else ""),
        "",
    ]
    for g in groups:
        lines.append(f"ranks {ranges(g.ranks)}: {g.where}")
    if silent:
        lines.append(f"ranks {ranges(silent)}: no answer (a process holding the GIL in native code, or gone)")
    printed: set[tuple[Any, ...]] = set()
    for rank in sorted(stacks):
        threads = stacks[rank]
        host = hosts[rank] if rank < len(hosts) else ""
        lines += ["", f"=== rank {rank}" + (f" on {host}" if host else "")]
        if threads is None:
            lines.append("(no answer)")
            continue
        for t in threads:
            key = (t.training, tuple((f.file, f.line, f.function) for f in t.frames))
            lines.append(f"--- thread {t.name}" + (" (training)" if t.training else ""))
            if t.training and key in printed:
                lines.append("    (the same stack as a lower rank's training thread)")
                continue
            printed.add(key)
            for f in t.frames:
                lines.append(f'  File "{f.file}", line {f.line}, in {f.function}')
                if f.code:
                    lines.append(f"    {f.code}")
    return "\n".join(lines) + "\n"


def to_wire(threads: list[ThreadStack]) -> list[dict[str, Any]]:
    """Plain data for the trip from a worker to the driver (no classes of this module on the wire)."""
    return [
        {
            "name": t.name,
            "training": t.training,
            "frames": [[f.file, f.line, f.function, f.code] for f in t.frames],
        }
        for t in threads
    ]


def from_wire(data: list[dict[str, Any]]) -> list[ThreadStack]:
    return [
        ThreadStack(
            str(t["name"]),
            bool(t["training"]),
            [Frame(str(a), int(b), str(c), str(d)) for a, b, c, d in t["frames"]],
        )
        for t in data
    ]


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    out: list[str] = []
    start = prev = None
    for r in sorted(ranks):
        if start is None:
            start = prev = r
        elif r == prev + 1:  # type: ignore[operator]
            prev = r
        else:
            out.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(out)


def _library(path: str) -> bool:
    return (
        "site-packages" in path or "dist-packages" in path or path.startswith("<") or "/lib/python3" in path
    )


_OURS = re.compile(r"(?:^|/)(cluster/(?:[a-z_]+/)?[a-z_]+\.py)$")
"""A file of this package, wherever it was imported from: shown from ``cluster/`` on
(``cluster/rank/step.py``), as its folder says which layer it is."""


def _short_path(path: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    ours = _OURS.search(path)
    if ours is not None:
        return ours.group(1)
    parts = path.rsplit("/", 2)
    return "/".join(parts[-2:]) if len(parts) > 1 else path
