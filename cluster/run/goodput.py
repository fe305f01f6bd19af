"""The goodput ledger: every second of a run's wall clock, from its first submission to its end (across
attempts and resubmissions), in exactly one class; ETTR = productive / wall (docs/goodput.md).

The driver keeps the account as it goes (:class:`Ledger`, fed by ``cluster.driver.record`` and a few hooks of
the driver's state machine). At any moment one *phase* is open and the seconds since it opened belong to it; a
phase closes when the next opens, so the classes add up to the wall clock by construction. Training time is
the one class split after the fact: a stretch of steps is charged to its checkpoint stalls, evaluations and
input waits (what the workers measured), and its remaining seconds to its steps, which are *productive* if
the final model keeps them and *recomputed* if the run later went back past them (a recovery from a
checkpoint, a rollback, a rewind). That is decided when the account is read, so a step counted productive
today is recomputed tomorrow if a later failure throws it away.

The account is written into each ``epoch_end`` event (``goodput``: the totals and the state a resubmission
continues from) and, at the run's end, as a ``goodput`` event; :func:`run_goodput` reads it back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

CLASSES: dict[str, str] = {
    "waiting": "waiting for resources: Ray had no room for the group (a first start or a grow)",
    "starting": "starting: Ray and the driver, actors, rendezvous, set-up, the first step (its compile)",
    "productive": "productive: steps whose result the final model keeps",
    "recomputed": "recomputed: steps trained again after a failure, or thrown away by a rollback or rewind",
    "checkpoint_stall": "checkpoint stall: training blocked on a save (and the final checkpoint's flush)",
    "input_stall": "input stall: rank 0 waiting for its batches",
    "evaluation": "evaluation: the evaluation set, between steps",
    "detection": "failure detection: from the last progress before a failure to the driver noticing it",
    "recovery": "recovery: from noticing a failure to the first step of the group that replaces it",
    "moves": "moves: preemption drains and slow-rank moves, from the stop to the moved group's first step",
    "driver_down": "driver down: between a driver's last sign of life and the next submission's start",
    "other": "other: the driver's own work between epochs and what no class above names",
}
"""Each class and what it holds, in the order shown."""

STEP_CLASSES = ("productive", "recomputed")


@dataclass
class Goodput:
    """Seconds per class for the whole run (``seconds``) and per attempt (``attempts``: label
    ``"<submission>.<attempt>"`` to its classes); ``wall_s`` is their sum."""

    wall_s: float
    seconds: dict[str, float]
    attempts: dict[str, dict[str, float]] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    """Steps counted ``productive`` and ``recomputed``."""

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive seconds over the wall clock."""
        return self.seconds.get("productive", 0.0) / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 3),
            "ettr": round(self.ettr, 4),
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "steps": dict(self.steps),
            "attempts": {a: {k: round(v, 3) for k, v in c.items() if v} for a, c in self.attempts.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Goodput:
        seconds = {k: float(d.get("seconds", {}).get(k, 0.0)) for k in CLASSES}
        return cls(
            float(d.get("wall_s", sum(seconds.values()))), seconds, d.get("attempts", {}), d.get("steps", {})
        )

    def lines(self, width: int = 30) -> list[str]:
        """The account as text: one line per class with seconds, share and a bar, then ETTR."""
        out = []
        for k in CLASSES:
            s = self.seconds.get(k, 0.0)
            if s <= 0 and k not in ("productive",):
                continue
            share = s / self.wall_s if self.wall_s > 0 else 0.0
            bar = "#" * round(share * width)
            out.append(f"  {k:<17} {_fmt_s(s):>9} {share:6.1%}  {bar}")
        out.append(f"  {'ETTR':<17} {self.ettr:.3f}  (productive / wall, {_fmt_s(self.wall_s)})")
        return out


def _fmt_s(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


class Ledger:
    """The account of one submission, continuing the previous submissions' (``prior``: the state written
    into the last event that carried one; ``alive_until``: the previous driver's last sign of life).

    Phases: ``enter(cls)`` closes the open phase at ``t`` and opens ``cls``. The running phase is special:
    its seconds are kept open until :meth:`ran` charges a stretch of steps (the epoch's or the stretch's
    wall, split into stalls, evaluations, input waits and steps); a failure closes it with
    :meth:`failed`."""

    def __init__(
        self,
        t0: float,
        submission: int = 1,
        prior: dict[str, Any] | None = None,
        alive_until: float | None = None,
        alive_step: int | None = None,
    ) -> None:
        self.submission = submission
        self.attempt = 0
        self.seconds: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
        self.attempts: dict[str, dict[str, float]] = {}
        self.entries: list[list[Any]] = []
        self.skips: list[tuple[int, int]] = []  # the run's skip windows: their steps train no batch
        """In order: ``["s", label, first, last, seconds]`` (steps first+1..last trained, their seconds) and
        ``["b", step]`` (a later start went back to ``step``)."""
        self.phase, self.since = "starting", t0
        self.step = 0  # the furthest step accounted for
        self.run_from = 0  # the step the open running phase's stretch starts after
        self.ended_at: float | None = None  # when the account was closed (the run's end)
        self.progress = (0, t0)  # (step, time) of the last progress the heartbeats reported
        self.pending = {"checkpoint_stall": 0.0, "evaluation": 0.0, "input_stall": 0.0}
        if prior is not None:
            self._continue(prior, t0, alive_until, alive_step)

    @property
    def label(self) -> str:
        return f"{self.submission}.{self.attempt}"

    def _continue(
        self, prior: dict[str, Any], t0: float, alive_until: float | None, step: int | None
    ) -> None:
        """A resubmission: the earlier submissions' account, the tail the previous driver did not account
        for (it was killed while its group trained: the steps trained then are a stretch like any other),
        and the gap until this driver started (``driver_down``)."""
        for k, v in prior.get("charged", {}).items():
            if k in self.seconds:
                self.seconds[k] += float(v)
        self.attempts = {a: dict(c) for a, c in prior.get("attempts", {}).items()}
        self.entries = [list(e) for e in prior.get("entries", [])]
        self.step = int(prior.get("step", 0))
        as_of = float(prior.get("as_of", t0))
        end = max(as_of, min(alive_until or as_of, t0))
        if end > as_of and not prior.get("ended"):
            tail_step = max(self.step, int(step or self.step))
            label = str(prior.get("label", "0.0"))
            if tail_step > self.step:
                self.entries.append(["s", label, self.step, tail_step, end - as_of])
                self.step = tail_step
            else:
                self._charge("other", end - as_of, label)
        self._charge("driver_down", max(0.0, t0 - end), self.label)

    # ------------------------------------------------------------------ feeding it
    def _charge(self, cls: str, seconds: float, label: str | None = None) -> None:
        if seconds <= 0:
            return
        self.seconds[cls] += seconds
        per = self.attempts.setdefault(label or self.label, {})
        per[cls] = per.get(cls, 0.0) + seconds

    def enter(self, cls: str, t: float | None = None) -> None:
        """Close the open phase at ``t`` (now) and open ``cls``."""
        t = time.time() if t is None else t
        if self.phase != "running":
            self._charge(self.phase, t - self.since)
        self.phase, self.since = cls, max(t, self.since)

    def reserving(self, t: float | None = None) -> None:
        """The group asks Ray for room: a first start (or a grow) waits for resources; a recovery or a move
        stays what it is."""
        if self.phase == "starting":
            self.enter("waiting", t)

    def reserved(self, t: float | None = None) -> None:
        if self.phase == "waiting":
            self.enter("starting", t)

    def progressed(self, step: int, at: float, first_at: float | None = None) -> None:
        """The heartbeats' furthest step, the time of the newest step any rank finished and when the group
        finished its first step. A new group's first step ends its start (or recovery, or move): training
        runs from there."""
        if step > self.progress[0] or at > self.progress[1]:
            self.progress = (max(step, self.progress[0]), max(at, self.progress[1]))
        if self.phase in ("starting", "recovery", "moves") and step > self.step and at >= self.since:
            if first_at is not None and self.since <= first_at <= at:
                self.enter("running", first_at)
                self.run_from = self.step + 1
            else:
                self.enter("running", at)
                self.run_from = step

    def stall(self, cls: str, seconds: float) -> None:
        """Seconds of a checkpoint stall, an evaluation or an input wait inside the running stretch."""
        self.pending[cls] += max(0.0, seconds)

    def went_back(self, step: int) -> None:
        """A group started from ``step`` (or a rewind went back to it): steps after it trained earlier
        are recomputed."""
        if step < self.step:
            self.entries.append(["b", step])
        self.step = step

    def started(self, attempt: int, resume_step: int) -> None:
        self.attempt = attempt
        self.went_back(resume_step)

    def adopted(self, step: int, t: float | None = None) -> None:
        """The ranks a previous driver left running were adopted at ``step`` (docs/failures.md, "driver
        dies"): the steps they trained while no driver was there are kept like any other, counted among the
        steps (their seconds are the gap's ``driver_down``: no driver accounted for them), never recomputed
        nor lost; and they train on from there, so the time from now on is a running stretch."""
        t = time.time() if t is None else t
        if step > self.step:
            self.entries.append(["s", self.label, self.step, step, 0.0])
            self.step = step
        self.enter("running", t)
        self.run_from = self.step

    def ran(
        self, first_step_at: float | None, start_step: int, end_step: int, t: float | None = None
    ) -> None:
        """A stretch of training from ``start_step`` ended at ``t`` (now) at ``end_step``. If the group had
        not trained yet (a start, a recovery, a move), its first step (done at ``first_step_at``) belongs to
        that phase."""
        t = time.time() if t is None else t
        if self.phase != "running":
            at = first_step_at if first_step_at is not None and self.since <= first_step_at <= t else t
            self.enter("running", at)
            self.run_from = min(start_step + 1, end_step)
        self._stretch(self.run_from, end_step, t - self.since)
        self.run_from, self.since = end_step, t

    def _stretch(self, first: int, last: int, seconds: float, merge: bool = True) -> None:
        """Charge ``seconds`` of training: the stalls first, the rest to steps ``first+1..last`` (``merge``:
        into the previous entry when it ends where this begins: one entry per unbroken run of epochs)."""
        parts = dict(self.pending)
        self.pending = dict.fromkeys(self.pending, 0.0)
        side = sum(parts.values())
        scale = min(1.0, seconds / side) if side > 0 else 0.0  # workers' times never exceed the wall
        for k, v in parts.items():
            self._charge(k, v * scale)
        rest = max(0.0, seconds - side * scale)
        if last > first:
            prev = self.entries[-1] if self.entries else None
            skips = [[a, b] for a, b in self.skips if a <= last and b > first]  # their batches untrained
            if merge and prev is not None and prev[0] == "s" and prev[1] == self.label and prev[3] == first:
                prev[3], prev[4] = last, prev[4] + rest
                prev[5:] = [[*(prev[5] if len(prev) > 5 else []), *skips]] if skips or len(prev) > 5 else []
            else:
                self.entries.append(["s", self.label, first, last, rest, *([skips] if skips else [])])
            self.step = max(self.step, last)
        else:
            self._charge("other", rest)

    def failed(self, now: float | None = None) -> None:
        """A failure was noticed now: the open stretch up to the last progress is training (its steps are
        classified later), from there to now is detection, and recovery begins."""
        now = time.time() if now is None else now
        if self.phase == "running":
            step, at = self.progress
            at = min(max(at, self.since), now)
            self._stretch(self.run_from, max(step, self.run_from), at - self.since, merge=False)
            self._charge("detection", now - at)
            self.phase, self.since = "recovery", now
        else:
            self.enter("recovery", now)

    def close(self, now: float | None = None) -> None:
        """The run ends now: an open stretch of training is charged up to its last progress."""
        now = time.time() if now is None else now
        if self.phase == "running":
            step, at = self.progress
            at = min(max(at, self.since), now)
            self._stretch(self.run_from, max(step, self.run_from), at - self.since, merge=False)
            self.phase, self.since = "other", at
        self.enter("other", now)

    # ------------------------------------------------------------------ reading it
    def goodput(self, now: float | None = None) -> Goodput:
        """The account at ``now``: the open phase charged up to it, the stretches classified."""
        now = time.time() if now is None else now
        seconds = dict(self.seconds)
        attempts = {a: dict(c) for a, c in self.attempts.items()}
        open_cls = self.phase if self.phase != "running" else "other"
        open_s = max(0.0, now - self.since)
        seconds[open_cls] += open_s
        if open_s:
            per = attempts.setdefault(self.label, {})
            per[open_cls] = per.get(open_cls, 0.0) + open_s
        steps = dict.fromkeys(STEP_CLASSES, 0)
        for label, kept, lost, kept_s, lost_s in classify(self.entries):
            steps["productive"] += kept
            steps["recomputed"] += lost
            per = attempts.setdefault(label, {})
            for cls, s in (("productive", kept_s), ("recomputed", lost_s)):
                seconds[cls] += s
                per[cls] = per.get(cls, 0.0) + s
        return Goodput(sum(seconds.values()), seconds, attempts, steps)

    def state(self, now: float | None = None, ended: bool = False) -> dict[str, Any]:
        """What a resubmission continues from (written into events)."""
        now = time.time() if now is None else now
        charged = dict(self.seconds)
        if self.phase != "running":
            charged[self.phase] += max(0.0, now - self.since)
        return {
            "as_of": now,
            "step": self.step,
            "label": self.label,
            "ended": ended,
            "charged": {k: round(v, 3) for k, v in charged.items() if v},
            "attempts": self.attempts,
            "entries": self.entries,
        }

    def snapshot(self, now: float | None = None, ended: bool = False) -> dict[str, Any]:
        """The totals and the state, for an event's ``goodput`` field (``ended``: the account closes now)."""
        now = time.time() if now is None else now
        if ended:
            self.ended_at = now
        return {**self.goodput(now).to_dict(), "state": self.state(now, ended)}


def classify(entries: list[list[Any]]) -> list[tuple[str, int, int, float, float]]:
    """Each stretch as (label, steps kept, steps recomputed, their seconds): a step is recomputed when a
    later entry went back below it."""
    out = []
    later_min = float("inf")
    for e in reversed(entries):
        if e[0] == "b":
            later_min = min(later_min, int(e[1]))
            continue
        _, label, first, last, seconds = e[:5]
        skips = e[5] if len(e) > 5 else []
        upto = int(min(last, max(first, later_min)))  # steps first+1..upto kept, upto+1..last recomputed
        kept = _trained(first, upto, skips)
        n = kept + _trained(upto, last, skips)
        share = kept / n if n else 1.0
        out.append((str(label), kept, n - kept, seconds * share, seconds * (1 - share)))
    out.reverse()
    return out


def _trained(first: int, last: int, skips: list[list[int]]) -> int:
    """Steps ``first+1..last`` less those in the skip windows (inclusive ``[a, b]``)."""
    n = max(0, last - first)
    for a, b in skips:
        n -= max(0, min(b, last) - max(a - 1, first))
    return max(0, n)


# ---------------------------------------------------------------------- reading a run's account
def last_state(events: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, float | None, int | None]:
    """The newest ledger state in a run's events, with the newest event's time and step after it (the
    previous driver's last signs of life)."""
    state, last_t, last_step = None, None, None
    for e in events:
        g = e if e.get("event") == "goodput" else e.get("goodput")
        if isinstance(g, dict) and isinstance(g.get("state"), dict):
            state = g["state"]
        if isinstance(e.get("time"), int | float):
            last_t = float(e["time"])
        for key in ("global_step", "step", "resume_step"):
            if isinstance(e.get(key), int):
                last_step = max(last_step or 0, int(e[key]))
    return state, last_t, last_step


def ledger_for(
    t0: float, submission: int, events: list[dict[str, Any]], driver: dict[str, Any] | None
) -> Ledger:
    """This submission's ledger, continuing the account of the run's earlier submissions: from the newest
    state in their events, the previous driver's last sign of life (its last event or ``driver.json``
    beat), and the starts and rewinds after that state that went back (a killed driver's recovery, a
    ``rewind``)."""
    state, last_t, last_step = last_state(events)
    if state is None:
        state = _first_state(events, submission - 1)
    if state is None:
        return Ledger(t0, submission)
    if driver is not None and isinstance(driver.get("time"), int | float):
        last_t = max(last_t or 0.0, float(driver["time"]))
        if isinstance(driver.get("global_step"), int):
            last_step = max(last_step or 0, int(driver["global_step"]))
    ledger = Ledger(t0, submission, state, last_t, last_step)
    as_of = float(state["as_of"])
    for e in events:
        if not (isinstance(e.get("time"), int | float) and e["time"] > as_of):
            continue
        back = {"rewound": e.get("to_step"), "group_started": e.get("resume_step")}.get(str(e.get("event")))
        if isinstance(back, int):
            ledger.went_back(back)
    return ledger


def _first_state(events: list[dict[str, Any]], submission: int) -> dict[str, Any] | None:
    """The account of a driver killed before it wrote one (before its first epoch ended): starting from its
    ``run_start`` to its group's start, training from there (the caller adds the tail up to its last sign
    of life)."""
    start = next((float(e["time"]) for e in events if e.get("event") == "run_start"), None)
    if start is None:
        return None
    group = next((e for e in events if e.get("event") == "group_started" and float(e["time"]) >= start), None)
    if group is None:
        return {"as_of": start, "step": 0, "label": f"{submission}.0", "charged": {}}
    began = float(group["time"])
    return {
        "as_of": began,
        "step": int(group.get("resume_step") or 0),
        "label": f"{submission}.{int(group.get('attempt') or 0)}",
        "charged": {"starting": began - start},
        "attempts": {f"{submission}.0": {"starting": began - start}},
    }


def goodput_of(events: list[dict[str, Any]], driver: dict[str, Any] | None = None) -> Goodput | None:
    """A run's account from its events (``driver``: its ``driver.json``, a later sign of life): the final
    one if the run ended, else as of the last sign of life of its driver."""
    state, last_t, last_step = last_state(events)
    if state is None:
        return None
    if driver is not None and isinstance(driver.get("time"), int | float):
        last_t = max(last_t or 0.0, float(driver["time"]))
        if isinstance(driver.get("global_step"), int):
            last_step = max(last_step or 0, int(driver["global_step"]))
    if state.get("ended"):
        return Ledger(float(state["as_of"]), prior=state, alive_until=None).goodput(float(state["as_of"]))
    end = max(float(state["as_of"]), last_t or 0.0)
    ledger = Ledger(end, prior=state, alive_until=end, alive_step=last_step)
    return ledger.goodput(end)


def run_goodput(run_url: str, storage_options: dict[str, Any] | None = None) -> Goodput | None:
    """The goodput account of the run at ``run_url`` (None for a run written before the ledger existed)."""
    from cluster.run.folder import RunFolder
    from cluster.run.logs import read_event_log
    from cluster.run.requests import read_driver_file

    storage = RunFolder.at(run_url, storage_options).storage
    return goodput_of(read_event_log(storage), read_driver_file(storage))
