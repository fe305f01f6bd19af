"""``show``'s read model: a run's report, its failures with their recoveries, its drain notices and slow
ranks, each read from the event log."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cluster.core.events import SHOWN
from cluster.inspect.runs import (
    CheckpointRow,
    RunSummary,
    checkpoint_rows,
    eval_rows,
    read_events,
    read_run_json,
    summarize,
)
from cluster.run.goodput import goodput_of
from cluster.run.logs import read_metrics
from cluster.run.quarantine import show_lines
from cluster.run.requests import driver_seen
from cluster.run.storage import Storage
from cluster.spec.config import JobConfig


@dataclass(frozen=True)
class FailureRecord:
    """A ``failure`` event, with the driver's decision and, when it recovered, the recovery's cost."""

    attempt: int | None
    kind: str
    rank: int | None
    step: int | None
    message: str
    decision: str | None
    recovery_s: float | None
    lost_steps: int | None
    source: str | None = None
    """Where the state came from: ``peers`` (a survivor's memory) or ``checkpoint`` (storage)."""
    resume_step: int | None = None
    moved_bytes: int | None = None
    """Bytes of state moved to the ranks (from the peer, or read from storage)."""
    transfer_s: float | None = None
    fallback: str | None = None
    """Why the survivors' state was not used, when it was not."""
    spare: str | None = None
    """The hot spare took the dead rank's place: ``prepared``, or ``preparing`` (not yet ready)."""


@dataclass
class RunReport:
    """Everything ``show`` prints."""

    summary: RunSummary
    config: dict[str, Any]
    versions: dict[str, Any]
    created: float | None
    config_changes: list[tuple[str, Any, Any]]
    failures: list[FailureRecord]
    other_events: list[dict[str, Any]]
    checkpoints: list[CheckpointRow]
    epochs: list[dict[str, Any]] = field(default_factory=list)
    latest_step: dict[str, Any] | None = None
    preemptions: list[PreemptionRecord] = field(default_factory=list)
    slow_ranks: list[SlowRankRecord] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    """The ``eval`` metric rows, one per evaluated step, in step order."""
    driver: dict[str, Any] | None = None
    """What the run's driver last wrote to ``driver.json`` (host, pid, state, step, ``age_s``)."""
    goodput: dict[str, Any] | None = None
    """The run's goodput account (``cluster.run.goodput.Goodput.to_dict``); None for runs from before it."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """The default of every config key (flattened), to list only the settings a run changed."""
    quarantine: list[str] = field(default_factory=list)
    """``show``'s lines on the nodes with incidents (``cluster.run.quarantine.show_lines``)."""


@dataclass(frozen=True)
class SlowRankRecord:
    """A ``slow_rank`` event (a rank that held the others up) and the step it kept pace again, if it did."""

    attempt: int | None
    rank: int
    host: str
    from_step: int | None
    to_step: int | None
    """The step of its ``slow_rank_cleared``; None when it stayed slow until its group ended."""
    ratio: float | None
    compute_ms: float | None
    others_ms: float | None


@dataclass
class PreemptionRecord:
    """A drain notice (``preemption_notice``) and what the driver did about it."""

    time: float | None
    node: str
    ranks: list[int]
    notice_s: float | None
    """Seconds from the notice to the node's deadline; None without a deadline."""
    action: str
    """``moved`` (replacements took the ranks), ``shrunk``, ``checkpointed`` (then the same ranks went on),
    or ``pending`` (nothing recorded yet)."""
    source: str | None = None
    stop_step: int | None = None
    lost_steps: int | None = None
    stall_s: float | None = None
    before_deadline_s: float | None = None
    reason: str = ""


def failure_records(events: list[dict[str, Any]]) -> list[FailureRecord]:
    """Each failure with the decision that followed it and the ``recovered`` event before the next one."""
    out = []
    indices = [i for i, e in enumerate(events) if e.get("event") == "failure"]
    for n, i in enumerate(indices):
        end = indices[n + 1] if n + 1 < len(indices) else len(events)
        after = events[i + 1 : end]
        decision = next((e for e in after if e.get("event") == "decision"), None)
        recovered = next((e for e in after if e.get("event") == "recovered"), None)
        e = events[i]
        out.append(
            FailureRecord(
                attempt=e.get("attempt"),
                kind=str(e.get("kind", "?")),
                rank=e.get("rank"),
                step=e.get("step"),
                message=str(e.get("message", "")).strip().splitlines()[0][:200] if e.get("message") else "",
                decision=None
                if decision is None
                else (
                    "restart"
                    if decision.get("restart")
                    else "gave up: " + str(decision.get("reason", ""))[:120]
                ),
                recovery_s=None if recovered is None else recovered.get("detect_to_first_step_s"),
                lost_steps=None if recovered is None else recovered.get("lost_steps"),
                source=None if recovered is None else recovered.get("source"),
                resume_step=None if recovered is None else recovered.get("resume_step"),
                moved_bytes=None if recovered is None else recovered.get("bytes"),
                transfer_s=None if recovered is None else recovered.get("transfer_s"),
                fallback=(recovered or decision or {}).get("fallback"),
                spare=None if recovered is None else recovered.get("spare"),
            )
        )
    return out


def preemption_records(events: list[dict[str, Any]]) -> list[PreemptionRecord]:
    """Each drain notice with the move, shrink or checkpoint that followed it (before the next notice)."""
    out = []
    notices = [i for i, e in enumerate(events) if e.get("event") == "preemption_notice"]
    for n, i in enumerate(notices):
        e = events[i]
        after = events[i + 1 : notices[n + 1] if n + 1 < len(notices) else len(events)]
        rec = PreemptionRecord(
            e.get("time"),
            str(e.get("node", "")),
            list(e.get("ranks") or []),
            e.get("seconds_left"),
            "pending",
        )
        move = next((a for a in after if a.get("event") == "preemption_move"), None)
        ckpt = next((a for a in after if a.get("event") == "preemption_checkpoint"), None)
        shrink = next(
            (a for a in after if a.get("event") == "resize" and "preemption" in str(a.get("reason"))), None
        )
        done = move or shrink
        if move is not None:
            rec.action = "moved"
        elif shrink is not None:
            rec.action = "shrunk"
        elif ckpt is not None:
            rec.action = "checkpointed"
        if done is not None:
            rec.source, rec.stop_step = done.get("source"), done.get("stop_step")
            rec.lost_steps, rec.stall_s = done.get("lost_steps"), done.get("stall_s")
            rec.before_deadline_s = done.get("seconds_before_deadline")
        elif ckpt is not None:
            rec.stop_step, rec.lost_steps = ckpt.get("step"), 0
            rec.before_deadline_s = ckpt.get("seconds_before_deadline")
        rec.reason = str((ckpt or {}).get("reason") or (move or {}).get("note") or "")
        out.append(rec)
    return out


def slow_rank_records(events: list[dict[str, Any]]) -> list[SlowRankRecord]:
    """Each ``slow_rank`` event with the ``slow_rank_cleared`` of the same rank and attempt after it."""
    out = []
    for i, e in enumerate(events):
        if e.get("event") != "slow_rank":
            continue
        key = (e.get("rank"), e.get("attempt"))
        cleared = next(
            (
                c
                for c in events[i + 1 :]
                if c.get("event") == "slow_rank_cleared" and (c.get("rank"), c.get("attempt")) == key
            ),
            None,
        )
        out.append(
            SlowRankRecord(
                e.get("attempt"),
                int(e.get("rank", -1)),
                str(e.get("host", "")),
                e.get("step"),
                None if cleared is None else cleared.get("step"),
                e.get("ratio"),
                e.get("compute_ms"),
                e.get("others_ms"),
            )
        )
    return out


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"training": {"epochs": 3}}`` -> ``{"training.epochs": 3}`` (the keys ``--set`` takes)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if (
            isinstance(value, dict)
            and value
            and key not in ("task_args", "options", "env", "resources_per_worker")
        ):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def report(storage: Storage, verify_all: bool = False) -> RunReport:
    info = read_run_json(storage)
    config = info.get("config", {}) if isinstance(info.get("config"), dict) else {}
    events = read_events(storage)
    mode = "all" if verify_all else "latest"
    rows = checkpoint_rows(storage, mode)
    name = str(info.get("name") or storage.root.rsplit("/", 1)[-1])
    summary = summarize(name, storage, events, rows, mode, config)
    starts = [
        e["config"] for e in events if e.get("event") == "run_start" and isinstance(e.get("config"), dict)
    ]
    changes: list[tuple[str, Any, Any]] = []
    if starts:
        first, last = flatten(config), flatten(starts[-1])
        changes = [
            (k, first.get(k), last.get(k))
            for k in sorted(set(first) | set(last))
            if first.get(k) != last.get(k)
        ]
    table = read_metrics(storage)
    metric_rows = table.to_pylist()
    epochs = [r for r in metric_rows if r["kind"] == "epoch"]
    steps = [r for r in metric_rows if r["kind"] == "step"]
    evaluations = eval_rows(metric_rows)
    driver = driver_seen(storage)
    g = goodput_of(events, driver)
    return RunReport(
        summary=summary,
        config=config,
        versions=info.get("versions", {}) or {},
        created=info.get("created"),
        config_changes=changes,
        failures=failure_records(events),
        other_events=[e for e in events if e.get("event") in SHOWN],
        checkpoints=rows,
        epochs=epochs,
        driver=driver,
        goodput=g.to_dict() if g is not None else None,
        quarantine=show_lines(storage),
        defaults=flatten(json.loads(json.dumps(JobConfig().to_dict(), default=str))),
        latest_step=steps[-1] if steps else None,
        preemptions=preemption_records(events),
        slow_ranks=slow_rank_records(events),
        evaluations=evaluations,
    )
