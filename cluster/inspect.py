"""Read runs back from storage: what ``python -m cluster list|show|plot`` prints. No Ray, no workers.

Everything here reads the public contract of a run folder (``run.json``, ``events/``, ``metrics/``,
``checkpoints/``) through :class:`~cluster.storage.Storage`, so it works on any fsspec URL, while the run
is going or long after. A run is any folder directly under the storage URL that holds a ``run.json``.
"""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import dataclass, field
from typing import Any

from cluster.checkpoint import CheckpointInfo, CheckpointStore, best_of, score_of
from cluster.control import DRIVER_GONE_S, driver_seen
from cluster.errors import CheckpointError, ClusterError, StorageError
from cluster.metrics import read_event_log, read_metrics
from cluster.storage import Storage, join, normalize_url

FINISHED, FAILED, UNFINISHED = "finished", "failed", "running/interrupted"
RUNNING, INTERRUPTED = "running", "interrupted"
"""Unfinished, told apart by the driver's ``driver.json`` (``cluster.control.DriverBeat``): written within
``DRIVER_GONE_S``, or not. Runs from before it stay ``running/interrupted``."""
STOPPED = "stopped"
"""Stopped on request (Ctrl-C, ``ray job stop``, ``python -m cluster stop``) with a checkpoint: resumable."""


class InspectError(ClusterError):
    """A URL holds no runs, or no run of the given name. The message lists what is there."""


@dataclass(frozen=True)
class RunSummary:
    """One line of ``list``: the run's state as its events and checkpoints record it."""

    name: str
    url: str
    status: str
    epochs_done: int
    epochs_total: int | None
    global_step: int
    latest_checkpoint: int | None
    """Highest verified checkpoint step (or highest committed one when not verifying)."""
    last_loss: float | None
    attempts: int
    """Worker groups started or tried, over every submission of the run."""
    failures: int
    submissions: int


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


@dataclass(frozen=True)
class CheckpointRow:
    step: int
    epoch: int | None
    """The manifest's epoch: the (0-based) epoch a resume from it starts in."""
    step_in_epoch: int | None
    bytes: int
    files: int
    verified: bool | None
    """True/False once checked; None when not checked (only the latest is checked unless ``--verify``)."""
    problem: str | None = None
    score: str | None = None
    """``metric=value`` of the evaluation it was scored by (``checkpoint.best_metric``), if any."""
    best: bool = False
    """The best-scored checkpoint: kept whatever ``keep_last`` says, loaded by ``step="best"``."""


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


# ---------------------------------------------------------------------- finding runs
def run_names(root: Storage) -> list[str]:
    """Names of the runs directly under ``root``: folders that hold a ``run.json``."""
    return [name for name in root.listdir() if root.exists(f"{name}/run.json")]


def open_run(url: str, name: str | None = None, options: dict[str, Any] | None = None) -> Storage:
    """The storage of one run, from ``URL NAME`` or ``URL/NAME``; InspectError naming the runs there if
    none."""
    if name is not None:
        root_url, run = normalize_url(url), name
    else:
        direct = Storage(url, options)
        if direct.exists("run.json"):
            return direct
        names = run_names(direct)
        if names:
            raise InspectError(
                f"{direct.root} is a storage URL with {len(names)} run(s) ({', '.join(names)}), not a run; "
                f"name one: show {direct.root} NAME"
            )
        root_url, _, run = direct.root.rpartition("/")
        if not root_url or root_url.endswith(":/") or not run:
            raise InspectError(f"no run at {direct.root} (no run.json there)")
    root = Storage(root_url, options)
    storage = Storage(join(root.root, run), options)
    if storage.exists("run.json"):
        return storage
    names = run_names(root)
    if not names:
        raise InspectError(f"no run named {run!r}: no runs at all under {root.root}")
    raise InspectError(f"no run named {run!r} under {root.root}; runs there: {', '.join(names)}")


# ---------------------------------------------------------------------- reading one run
def read_events(storage: Storage) -> list[dict[str, Any]]:
    """The run's events as dicts, oldest first (segments ``events/*.jsonl`` after a legacy ``events.jsonl``);
    a torn line (a writer died mid-write) is ignored."""
    return read_event_log(storage)


def final_path(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metric rows of the path the run took, in step order: a row is left out when the run later went
    back past its step (a group started from an earlier step: a recovery that replayed it, a NaN rollback
    that abandoned it; or a ``rewound`` run), so that each step's row of each kind appears once, as the
    weights that were kept saw it."""
    backs = sorted(
        (float(e["time"]), int(e["resume_step"] if e.get("event") == "group_started" else e["to_step"]))
        for e in events
        if (e.get("event") == "group_started" and isinstance(e.get("resume_step"), int))
        or (e.get("event") == "rewound" and isinstance(e.get("to_step"), int))
    )
    # the lowest step the run went back to after each time: one pass from the newest
    later_min: list[float] = [float("inf")] * (len(backs) + 1)
    for i in range(len(backs) - 1, -1, -1):
        later_min[i] = min(later_min[i + 1], backs[i][1])
    times = [t for t, _ in backs]
    kept = [r for r in rows if r["global_step"] <= later_min[bisect.bisect_right(times, float(r["time"]))]]
    return sorted(kept, key=lambda r: (r["global_step"], r["time"]))


def run_metrics(run_url: str, storage_options: dict[str, Any] | None = None, final: bool = True) -> Any:
    """The run's metrics as a ``pyarrow.Table`` (columns: docs/runs.md): with ``final``, only the rows of
    the path the run took (:func:`final_path`: no replayed, rolled-back or rewound rows), in step order;
    else every row written."""
    storage = Storage(run_url, storage_options)
    table = read_metrics(storage)
    if not final:
        return table
    import pyarrow as pa

    rows = final_path(table.to_pylist(), read_events(storage))
    return pa.Table.from_pylist(rows, schema=table.schema)


def read_run_json(storage: Storage) -> dict[str, Any]:
    try:
        data = json.loads(storage.read_bytes("run.json"))
    except (ValueError, UnicodeDecodeError):
        raise InspectError(f"{storage.url('run.json')} is not valid JSON") from None
    return data if isinstance(data, dict) else {}


def run_status(events: list[dict[str, Any]]) -> str:
    """finished / failed / stopped from the terminal event after the last ``run_start``; otherwise the run is
    still going or its driver died (storage cannot tell those apart)."""
    starts = [i for i, e in enumerate(events) if e.get("event") == "run_start"]
    tail = events[starts[-1] :] if starts else events
    for e in reversed(tail):
        kind = e.get("event")
        if kind in ("finished", "already_complete"):
            return FINISHED
        if kind in ("run_failed", "failed"):
            return FAILED
        if kind == "stopped":
            return STOPPED
    return UNFINISHED


def live_status(storage: Storage, events: list[dict[str, Any]]) -> str:
    """``run_status``, with an unfinished run told ``running`` or ``interrupted`` by its driver's beat."""
    status = run_status(events)
    if status != UNFINISHED:
        return status
    seen = driver_seen(storage)
    if seen is None:
        return UNFINISHED
    return RUNNING if not seen.get("ended") and seen["age_s"] < DRIVER_GONE_S else INTERRUPTED


def count_attempts(events: list[dict[str, Any]]) -> int:
    """Worker groups started or tried: per submission (``run_start``), the highest ``attempt`` seen + 1."""
    total, highest = 0, -1
    for e in events:
        if e.get("event") == "run_start":
            total += highest + 1
            highest = -1
        if isinstance(e.get("attempt"), int):
            highest = max(highest, e["attempt"])
    return total + highest + 1


def _checkpoint_problem(store: CheckpointStore, info: CheckpointInfo) -> str | None:
    try:
        store.read_verified(info)
    except (CheckpointError, StorageError) as exc:
        return str(exc)
    return None


def checkpoint_rows(storage: Storage, verify: str = "latest") -> list[CheckpointRow]:
    """Committed checkpoints ascending, plus step folders without a manifest (torn writes).

    ``verify``: ``"all"`` checks every checkpoint's checksums, ``"latest"`` checks from the newest down
    until one verifies (the one a resume would load), ``"none"`` reads manifests only.
    """
    store = CheckpointStore(storage)
    infos = store.list()
    committed = {i.step for i in infos}
    best = best_of(infos)
    verdict: dict[int, str | None] = {}
    for info in reversed(infos):
        if verify == "none":
            break
        verdict[info.step] = _checkpoint_problem(store, info)
        if verify == "latest" and verdict[info.step] is None:
            break
    rows = [
        CheckpointRow(
            step=i.step,
            epoch=i.manifest.get("epoch"),
            step_in_epoch=i.manifest.get("step_in_epoch"),
            bytes=i.total_bytes,
            files=len(i.manifest["files"]),
            verified=(verdict[i.step] is None) if i.step in verdict else None,
            problem=verdict.get(i.step),
            score=_score_text(i),
            best=best is not None and best.step == i.step,
        )
        for i in infos
    ]
    for step in store.steps_on_storage():
        if step not in committed:
            rows.append(
                CheckpointRow(step, None, None, 0, 0, False, "no manifest: torn or in progress, never loaded")
            )
    return sorted(rows, key=lambda r: r.step)


def _score_text(info: CheckpointInfo) -> str | None:
    sc = score_of(info)
    return None if sc is None else f"{sc[0]}={sc[2]:.4g}"


def _latest(rows: list[CheckpointRow], verify: str) -> int | None:
    ok = [r.step for r in rows if r.verified or (verify == "none" and r.problem is None)]
    return max(ok) if ok else None


def summarize(
    name: str,
    storage: Storage,
    events: list[dict[str, Any]],
    rows: list[CheckpointRow],
    verify: str,
    config: dict[str, Any],
) -> RunSummary:
    epochs_done, step, loss = 0, 0, None
    for e in events:
        kind = e.get("event")
        if kind == "epoch_end":
            epochs_done = max(epochs_done, int(e.get("epoch", -1)) + 1)
        if kind in ("epoch_end", "finished", "already_complete") and isinstance(e.get("global_step"), int):
            step = max(step, e["global_step"])
        if kind == "checkpoint" and isinstance(e.get("step"), int):
            step = max(step, e["step"])
        if kind in ("epoch_end", "finished") and isinstance(e.get("loss"), (int, float)):
            loss = float(e["loss"])
    latest = _latest(rows, verify)
    starts = [e for e in events if e.get("event") == "run_start" and isinstance(e.get("config"), dict)]
    current = starts[-1]["config"] if starts else config
    total = current.get("training", {}).get("epochs")
    return RunSummary(
        name=name,
        url=storage.root,
        status=live_status(storage, events),
        epochs_done=epochs_done,
        epochs_total=total if isinstance(total, int) else None,
        global_step=max(step, latest or 0),
        latest_checkpoint=latest,
        last_loss=loss,
        attempts=count_attempts(events),
        failures=sum(e.get("event") == "failure" for e in events),
        submissions=sum(e.get("event") == "run_start" for e in events),
    )


def list_runs(url: str, options: dict[str, Any] | None = None, verify: bool = True) -> list[RunSummary]:
    root = Storage(url, options)
    names = run_names(root)
    if not names:
        raise InspectError(f"no runs under {root.root} (no folder there holds a run.json)")
    mode = "latest" if verify else "none"
    out = []
    for name in names:
        storage = Storage(join(root.root, name), options)
        rows = checkpoint_rows(storage, mode)
        out.append(
            summarize(
                name, storage, read_events(storage), rows, mode, read_run_json(storage).get("config", {})
            )
        )
    return out


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
    notable = (
        "resize",
        "checkpoint_skipped",
        "checkpoint_failed",
        "run_failed",
        "failed",
        "early_stopped",
        "stopped",
        "stacks",
        "profile_requested",
        "slow_rank_moved",
        "slow_rank_move_failed",
        "rollback",
        "rewound",
    )
    table = read_metrics(storage)
    metric_rows = table.to_pylist()
    epochs = [r for r in metric_rows if r["kind"] == "epoch"]
    steps = [r for r in metric_rows if r["kind"] == "step"]
    evaluations = eval_rows(metric_rows)
    return RunReport(
        summary=summary,
        config=config,
        versions=info.get("versions", {}) or {},
        created=info.get("created"),
        config_changes=changes,
        failures=failure_records(events),
        other_events=[e for e in events if e.get("event") in notable],
        checkpoints=rows,
        epochs=epochs,
        driver=driver_seen(storage),
        latest_step=steps[-1] if steps else None,
        preemptions=preemption_records(events),
        slow_ranks=slow_rank_records(events),
        evaluations=evaluations,
    )


def eval_rows(metric_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ``eval`` row per evaluated step (the first, should a step appear twice), in step order."""
    seen: dict[int, dict[str, Any]] = {}
    for row in metric_rows:
        if row.get("kind") == "eval":
            seen.setdefault(int(row["global_step"]), row)
    return [seen[k] for k in sorted(seen)]


# ---------------------------------------------------------------------- formatting
def _input_share(row: dict[str, Any]) -> str:
    """ " (N% waiting for input)" for a step row that measured it."""
    wait, step = row.get("input_wait_s"), row.get("step_time_s")
    if not isinstance(wait, float) or not isinstance(step, float) or step <= 0:
        return ""
    return f" ({100 * wait / step:.0f}% waiting for input)"


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover


def table(header: list[str], rows: list[list[str]], indent: str = "") -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = [header, *rows]
    return "\n".join(
        indent + "  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines
    )


def position(c: CheckpointRow) -> str:
    """Where in training a checkpoint sits, 1-based like the progress line: ``epoch 2 done``,
    ``epoch 3 step 4``."""
    if c.epoch is None:
        return "-"
    if not c.step_in_epoch and c.epoch > 0:
        return f"epoch {c.epoch} done"
    return f"epoch {c.epoch + 1} step {c.step_in_epoch or 0}"


def format_list(summaries: list[RunSummary]) -> str:
    header = ["NAME", "STATUS", "EPOCHS", "STEP", "CHECKPOINT", "LOSS", "ATTEMPTS", "FAILURES"]
    rows = [
        [
            s.name,
            s.status,
            f"{s.epochs_done}/{_fmt(s.epochs_total)}",
            str(s.global_step),
            _fmt(s.latest_checkpoint),
            _fmt(s.last_loss),
            str(s.attempts),
            str(s.failures),
        ]
        for s in summaries
    ]
    return table(header, rows)


def _driver_text(d: dict[str, Any] | None) -> str:
    if d is None:
        return ""
    what = "ended" if d.get("ended") else f"{d.get('state')} at step {d.get('global_step')}"
    return f" (driver on {d.get('host')}, pid {d.get('pid')}: {what}, last heard from {_when(d.get('time'))})"


def _when(t: Any) -> str:
    if not isinstance(t, (int, float)):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def format_show(r: RunReport) -> str:
    s = r.summary
    out = [
        f"run        {s.name}",
        f"url        {s.url}",
        f"status     {s.status}" + _driver_text(r.driver),
        f"created    {_when(r.created)}",
        f"versions   {', '.join(f'{k} {v}' for k, v in r.versions.items()) or '-'}",
        f"progress   epoch {s.epochs_done}/{_fmt(s.epochs_total)}, global step {s.global_step}, "
        f"last loss {_fmt(s.last_loss)}",
        f"attempts   {s.attempts} over {s.submissions} submission(s), {s.failures} failure(s)",
        f"checkpoint latest verified step {_fmt(s.latest_checkpoint)}",
        "",
        "config (run.json; credentials were redacted when it was written)",
    ]
    out += [f"  {k}: {json.dumps(v)}" for k, v in flatten(r.config).items()]
    if r.config_changes:
        out.append("  changed by later submissions:")
        out += [f"    {k}: {json.dumps(old)} -> {json.dumps(new)}" for k, old, new in r.config_changes]
    out += ["", f"failures ({len(r.failures)})"]
    if r.failures:
        out.append(
            table(
                [
                    "ATTEMPT",
                    "KIND",
                    "RANK",
                    "STEP",
                    "DECISION",
                    "SOURCE",
                    "SPARE",
                    "RESUMED_AT",
                    "RECOVERY_S",
                    "LOST_STEPS",
                    "MOVED",
                    "MESSAGE",
                ],
                [
                    [
                        _fmt(f.attempt),
                        f.kind,
                        _fmt(f.rank),
                        _fmt(f.step),
                        _fmt(f.decision),
                        _fmt(f.source),
                        _fmt(f.spare),
                        _fmt(f.resume_step),
                        _fmt(f.recovery_s, 1),
                        _fmt(f.lost_steps),
                        human_bytes(f.moved_bytes) if f.moved_bytes is not None else "-",
                        f.message[:60],
                    ]
                    for f in r.failures
                ],
                indent="  ",
            )
        )
        out += [f"  attempt {f.attempt}: not from peers: {f.fallback}" for f in r.failures if f.fallback]
    if r.preemptions:
        out += ["", f"preemption notices ({len(r.preemptions)})"]
        out.append(
            table(
                [
                    "TIME",
                    "NODE",
                    "RANKS",
                    "NOTICE_S",
                    "ACTION",
                    "SOURCE",
                    "AT_STEP",
                    "LOST",
                    "STALL_S",
                    "SPARE_S",
                ],
                [
                    [
                        _when(p.time),
                        p.node[:12],
                        ",".join(map(str, p.ranks)),
                        _fmt(p.notice_s, 1),
                        p.action,
                        _fmt(p.source),
                        _fmt(p.stop_step),
                        _fmt(p.lost_steps),
                        _fmt(p.stall_s, 2),
                        _fmt(p.before_deadline_s, 1),
                    ]
                    for p in r.preemptions
                ],
                indent="  ",
            )
        )
        out += [f"  {_when(p.time)}: {p.reason}" for p in r.preemptions if p.reason]
        out.append("  (SPARE_S: seconds left before the node's deadline when the ranks were off it)")
    for e in r.other_events:
        if e.get("event") in ("rollback", "rewound"):
            out.append(f"  {_when(e.get('time'))} {event_line(e)}")
            continue
        if e.get("event") == "stacks":  # where the ranks stood (a hang, or asked for): the file, the groups
            out.append(
                f"  {_when(e.get('time'))} stacks ({e.get('kind')}, step {e.get('step')}): {e.get('path')}"
            )
            out += [f"    ranks {g.get('ranks')}: {g.get('where')}" for g in e.get("groups") or []]
            if e.get("silent"):
                out.append(f"    ranks {e['silent']}: no answer")
            continue
        detail = {k: v for k, v in e.items() if k not in ("time", "event")}
        out.append(f"  {_when(e.get('time'))} {e.get('event')}: {json.dumps(detail, default=str)[:200]}")
    if r.slow_ranks:
        out += ["", f"slow ranks ({len(r.slow_ranks)}: every rank waited for them at each step)"]
        out.append(
            table(
                ["ATTEMPT", "RANK", "HOST", "FROM_STEP", "TO_STEP", "RATIO", "OWN_MS", "OTHERS_MS"],
                [
                    [
                        _fmt(w.attempt),
                        str(w.rank),
                        w.host[:24],
                        _fmt(w.from_step),
                        _fmt(w.to_step) if w.to_step is not None else "group end",
                        _fmt(w.ratio, 2),
                        _fmt(w.compute_ms, 1),
                        _fmt(w.others_ms, 1),
                    ]
                    for w in r.slow_ranks
                ],
                indent="  ",
            )
        )
        out.append("  (OWN_MS: its own part of a step, before it waits for the others; OTHERS_MS: theirs)")
    committed = [c for c in r.checkpoints if c.files]
    out += ["", f"checkpoints ({len(committed)} committed)"]
    if r.checkpoints:
        verified = {True: "yes", False: "NO", None: "unchecked"}
        scored = any(c.score for c in r.checkpoints)
        out.append(
            table(
                ["STEP", "EPOCH", "SIZE", "FILES", "VERIFIED", *(["SCORE"] if scored else []), "PROBLEM"],
                [
                    [
                        str(c.step),
                        position(c),
                        human_bytes(c.bytes) if c.files else "-",
                        str(c.files),
                        verified[c.verified],
                        *([(c.score or "-") + (" (best)" if c.best else "")] if scored else []),
                        c.problem or "",
                    ]
                    for c in r.checkpoints
                ],
                indent="  ",
            )
        )
    out += ["", "metrics"]
    if r.latest_step is not None:
        m = r.latest_step
        out.append(
            f"  latest step: global_step {m['global_step']}, loss {_fmt(m['loss'])}, lr {_fmt(m['lr'], 6)}, "
            f"grad norm {_fmt(m.get('grad_norm'))}, peak memory {_fmt(m.get('peak_mem_gib'), 2)} GiB, "
            f"{_fmt(m['samples_per_s'], 1)} samples/s, {_fmt(m['step_time_s'])} s/step"
            f"{_input_share(m)}, "
            f"world size {m['world_size']}, attempt {m['attempt']}"
        )
    if r.epochs:
        shown = r.epochs[-10:]
        if len(r.epochs) > len(shown):
            out.append(f"  ({len(r.epochs) - len(shown)} earlier epochs not shown)")
        out.append(
            table(
                ["EPOCH", "STEP", "LOSS", "SAMPLES/S", "S/STEP", "CKPT_STALL_S", "WORLD", "ATTEMPT"],
                [
                    [
                        str(e["epoch"] + 1),
                        str(e["global_step"]),
                        _fmt(e["loss"]),
                        _fmt(e["samples_per_s"], 1),
                        _fmt(e["step_time_s"]),
                        _fmt(e["checkpoint_stall_s"]),
                        str(e["world_size"]),
                        str(e["attempt"]),
                    ]
                    for e in shown
                ],
                indent="  ",
            )
        )
    if r.latest_step is None and not r.epochs:
        out.append("  none yet")
    if r.evaluations:
        out += ["", *format_evaluations(r.evaluations)]
    return "\n".join(out)


def format_evaluations(rows: list[dict[str, Any]], last: int = 10) -> list[str]:
    """The ``evaluations`` section of ``show``: the latest ``last`` and the one with the lowest loss."""
    names = sorted({k for row in rows for k, v in row.items() if k.startswith("m_") and v is not None})
    out = [f"evaluations ({len(rows)})"]
    shown = rows[-last:]
    if len(rows) > len(shown):
        out.append(f"  ({len(rows) - len(shown)} earlier evaluations not shown)")
    out.append(
        table(
            ["STEP", "EPOCH", "LOSS", *(n[2:].upper() for n in names), "SAMPLES", "SECONDS", "WORLD"],
            [
                [
                    str(e["global_step"]),
                    str(e["epoch"] + 1),
                    _fmt(e["loss"]),
                    *(_fmt(e.get(n)) for n in names),
                    _fmt(e.get("eval_samples")),
                    _fmt(e["step_time_s"], 2),
                    str(e["world_size"]),
                ]
                for e in shown
            ],
            indent="  ",
        )
    )
    best = min(rows, key=lambda e: (e["loss"], e["global_step"]))
    out.append(f"  lowest eval loss: {_fmt(best['loss'])} at step {best['global_step']}")
    return out


# ------------------------------------------------------------------------------------------------ watch
WATCHED = (
    "run_start",
    "group_started",
    "epoch_end",
    "evaluation",
    "checkpoint",
    "checkpoint_failed",
    "failure",
    "decision",
    "rollback",
    "rewound",
    "recovered",
    "resize",
    "preemption_notice",
    "preemption_move",
    "slow_rank",
    "slow_rank_cleared",
    "slow_rank_move",
    "slow_rank_moved",
    "slow_rank_move_failed",
    "stacks",
    "profile_requested",
    "stop_requested",
    "stopped",
    "early_stopped",
    "finished",
    "already_complete",
    "run_failed",
)
"""The events ``watch`` prints by default (``--all``: every one)."""


def event_line(e: dict[str, Any]) -> str:
    """One short line for an event, as ``watch`` prints it."""
    from cluster.tracking import notification_text

    kind = e.get("event")
    if kind == "group_started":
        return (
            f"group started (attempt {e.get('attempt')}): {e.get('world_size')} workers, from step "
            f"{e.get('resume_step')} ({e.get('resume_source')}) in {e.get('seconds')}s"
        )
    if kind == "epoch_end":
        epoch = int(e.get("epoch", -1)) + 1
        return (
            f"epoch {epoch} done: step {e.get('global_step')}, loss {_fmt(e.get('loss'))}, "
            f"{_fmt(e.get('samples_per_s'), 1)} samples/s"
        )
    if kind == "evaluation":
        shown = "".join(f", {k} {_fmt(v)}" for k, v in (e.get("metrics") or {}).items())
        return f"eval at step {e.get('global_step')}: loss {_fmt(e.get('loss'))}{shown}"
    if kind == "checkpoint":
        return f"checkpoint at step {e.get('step')} ({human_bytes(int(e.get('bytes') or 0))})"
    if kind == "decision":
        return f"decision: {'restart' if e.get('restart') else 'give up'} ({e.get('reason')})"
    if kind == "rollback":
        return rollback_text(e)
    if kind == "rewound":
        return f"rewound to step {e.get('to_step')} by {e.get('by')}: deleted checkpoints {e.get('deleted')}"
    if kind == "stacks":
        where = "; ".join(
            f"ranks {ranges_text(g.get('ranks'))}: {g.get('where')}" for g in e.get("groups") or []
        )
        return f"stacks ({e.get('kind')}): {where} -> {e.get('path')}"
    text = notification_text(e)
    return text if len(text) <= 240 else text[:237] + "..."


def rollback_text(e: dict[str, Any]) -> str:
    """A NaN rollback (``failures.nan_skip_steps``) in one line."""
    first, last = (e.get("skipped") or [None, None])[:2]
    back = e.get("checkpoint_step")
    where = f"checkpoint step {back}" if back is not None else "the run's start"
    gone = f", deleted checkpoints {e['discarded']}" if e.get("discarded") else ""
    return f"rollback after a loss that was not finite: to {where}, steps {first}-{last} skipped{gone}"


def ranges_text(ranks: Any) -> str:
    from cluster.stacks import ranges

    return ranges(list(ranks or []))


def watch(
    storage: Storage, out: Any, every_s: float = 5.0, everything: bool = False, backlog: int = 10
) -> str:
    """Print the run's events as they land (the last ``backlog`` first) until it ends; return its status
    (``finished``, ``failed``, ``stopped``, or ``interrupted`` when its driver is gone)."""
    events = read_events(storage)
    shown = [e for e in events if everything or e.get("event") in WATCHED]
    for e in shown[-backlog:] if backlog else []:
        out.write(f"{_when(e.get('time'))} {event_line(e)}\n")
    seen = len(events)
    while True:
        status = live_status(storage, events)
        if status not in (RUNNING, UNFINISHED):
            out.write(f"the run is {status}\n")
            out.flush()
            return status
        out.flush()
        time.sleep(every_s)
        events = read_events(storage)
        for e in events[seen:]:
            if everything or e.get("event") in WATCHED:
                out.write(f"{_when(e.get('time'))} {event_line(e)}\n")
        seen = len(events)
