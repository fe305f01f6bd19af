"""What ``python -m cluster list|show|watch`` print: the read model of :mod:`cluster.inspect.runs` and
:mod:`cluster.inspect.records` as text (one function per section of ``show``), and ``watch``'s loop.
Events read as :mod:`cluster.core.events` renders them."""

from __future__ import annotations

import json
import time
from typing import Any

from cluster.core import events
from cluster.core.events import WATCHED, human_bytes
from cluster.core.events import fmt as _fmt
from cluster.core.redact import redact_config
from cluster.inspect.records import FailureRecord, PreemptionRecord, RunReport, SlowRankRecord, flatten
from cluster.inspect.runs import (
    RUNNING,
    UNFINISHED,
    CheckpointRow,
    RunSummary,
    live_status,
    read_events,
)
from cluster.run.goodput import Goodput
from cluster.run.storage import Storage

WATCH_WIDTH = 240
"""``watch`` cuts a line longer than this (a long error message)."""


def _input_share(row: dict[str, Any]) -> str:
    """ " (N% waiting for input)" for a step row that measured it."""
    wait, step = row.get("input_wait_s"), row.get("step_time_s")
    if not isinstance(wait, float) or not isinstance(step, float) or step <= 0:
        return ""
    return f" ({100 * wait / step:.0f}% waiting for input)"


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


# ---------------------------------------------------------------------------------------------- show
def format_show(r: RunReport, all_config: bool = False) -> str:
    """What ``show`` prints: status first, then where the time went, what failed, what is kept; the
    settings last, only those that differ from the defaults unless ``all_config``."""
    out = _summary_section(r)
    out += _goodput_section(r.goodput)
    out += _failures_section(r.failures)
    out += r.quarantine
    out += _checkpoints_section(r.checkpoints)
    out += _preemptions_section(r.preemptions)
    out += _slow_ranks_section(r.slow_ranks)
    out += _events_section(r.other_events)
    out += _metrics_section(r)
    if r.evaluations:
        out += ["", *format_evaluations(r.evaluations)]
    out += _config_section(r, all_config)
    return "\n".join(out)


def _goodput_section(g: dict[str, Any] | None) -> list[str]:
    """The goodput account: each class's seconds, share and bar, and ETTR (docs/goodput.md)."""
    if not g:
        return []
    account = Goodput.from_dict(g)
    return [
        "",
        "goodput (every second of the run's wall clock, in one class: docs/goodput.md)",
        *account.lines(),
    ]


def _summary_section(r: RunReport) -> list[str]:
    s = r.summary
    return [
        f"run        {s.name}",
        f"url        {s.url}",
        f"status     {s.status}" + _driver_text(r.driver),
        f"created    {_when(r.created)}",
        f"versions   {', '.join(f'{k} {v}' for k, v in r.versions.items()) or '-'}",
        f"progress   epoch {s.epochs_done}/{_fmt(s.epochs_total)}, global step {s.global_step}, "
        f"last loss {_fmt(s.last_loss)}",
        f"attempts   {s.attempts} over {s.submissions} submission(s), {s.failures} failure(s)",
        f"checkpoint latest verified step {_fmt(s.latest_checkpoint)}",
    ]


def _config_section(r: RunReport, all_config: bool = False) -> list[str]:
    """The run's settings (run.json): those that differ from the defaults, or every one."""
    settings = flatten(redact_config(r.config))
    if not all_config and r.defaults:
        settings = {k: v for k, v in settings.items() if k not in r.defaults or r.defaults[k] != v}
        title = "config: the settings that differ from the defaults (all of them: show --config)"
    else:
        title = "config (run.json)"
    out = ["", f"{title}; secrets redacted: docs/cluster.md, Security"]
    out += [f"  {k}: {json.dumps(v)}" for k, v in settings.items()]
    if r.config_changes:
        out.append("  changed by later submissions:")
        out += [
            f"    {k}: {json.dumps(_redacted(k, old))} -> {json.dumps(_redacted(k, new))}"
            for k, old, new in r.config_changes
        ]
    return out


def _redacted(key: str, value: Any) -> Any:
    """``value`` of the config key ``key`` (dotted) as the one redaction shows it: a run written by an earlier
    version may hold secrets in run.json or submissions/."""
    *parents, last = key.split(".")
    tree: dict[str, Any] = {last: value}
    for name in reversed(parents):
        tree = {name: tree}
    shown: Any = redact_config(tree)
    for name in key.split("."):
        shown = shown[name]
    return shown


def _failures_section(failures: list[FailureRecord]) -> list[str]:
    out = ["", f"failures ({len(failures)})"]
    if not failures:
        return out
    header = "ATTEMPT KIND RANK STEP DECISION SOURCE SPARE RESUMED_AT RECOVERY_S LOST_STEPS MOVED MESSAGE"
    rows = [
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
        for f in failures
    ]
    out.append(table(header.split(), rows, indent="  "))
    out += [f"  attempt {f.attempt}: not from peers: {f.fallback}" for f in failures if f.fallback]
    return out


def _preemptions_section(preemptions: list[PreemptionRecord]) -> list[str]:
    if not preemptions:
        return []
    out = ["", f"preemption notices ({len(preemptions)})"]
    header = "TIME NODE RANKS NOTICE_S ACTION SOURCE AT_STEP LOST STALL_S SPARE_S"
    rows = [
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
        for p in preemptions
    ]
    out.append(table(header.split(), rows, indent="  "))
    out += [f"  {_when(p.time)}: {p.reason}" for p in preemptions if p.reason]
    out.append("  (SPARE_S: seconds left before the node's deadline when the ranks were off it)")
    return out


def _events_section(other_events: list[dict[str, Any]]) -> list[str]:
    """The events of :data:`cluster.core.events.SHOWN`, one line each (where the ranks stood: a line a
    group)."""
    out = []
    for e in other_events:
        if e.get("event") in ("rollback", "rewound", "adopted", "adoption_refused"):
            out.append(f"  {_when(e.get('time'))} {events.line(e.get('event'), e)}")
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
    return out


def _slow_ranks_section(slow_ranks: list[SlowRankRecord]) -> list[str]:
    if not slow_ranks:
        return []
    out = ["", f"slow ranks ({len(slow_ranks)}: every rank waited for them at each step)"]
    rows = [
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
        for w in slow_ranks
    ]
    header = "ATTEMPT RANK HOST FROM_STEP TO_STEP RATIO OWN_MS OTHERS_MS"
    out.append(table(header.split(), rows, indent="  "))
    out.append("  (OWN_MS: its own part of a step, before it waits for the others; OTHERS_MS: theirs)")
    return out


def _checkpoints_section(checkpoints: list[CheckpointRow]) -> list[str]:
    committed = [c for c in checkpoints if c.files]
    out = ["", f"checkpoints ({len(committed)} committed)"]
    if not checkpoints:
        return out
    verified = {True: "yes", False: "NO", None: "unchecked"}
    scored = any(c.score for c in checkpoints)
    rows = [
        [
            str(c.step),
            position(c),
            human_bytes(c.bytes) if c.files else "-",
            str(c.files),
            verified[c.verified],
            *([(c.score or "-") + (" (best)" if c.best else "")] if scored else []),
            c.problem or "",
        ]
        for c in checkpoints
    ]
    header = ["STEP", "EPOCH", "SIZE", "FILES", "VERIFIED", *(["SCORE"] if scored else []), "PROBLEM"]
    out.append(table(header, rows, indent="  "))
    return out


def _metrics_section(r: RunReport) -> list[str]:
    out = ["", "metrics"]
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
        rows = [
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
        ]
        header = "EPOCH STEP LOSS SAMPLES/S S/STEP CKPT_STALL_S WORLD ATTEMPT"
        out.append(table(header.split(), rows, indent="  "))
    if r.latest_step is None and not r.epochs:
        out.append("  none yet")
    return out


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


# --------------------------------------------------------------------------------------------- watch
def event_line(e: dict[str, Any]) -> str:
    """One short line for an event, as ``watch`` prints it: its :func:`cluster.core.events.line`, cut at
    ``WATCH_WIDTH``."""
    text = events.line(e.get("event"), e)
    return text if len(text) <= WATCH_WIDTH else text[: WATCH_WIDTH - 3] + "..."


def watch(
    storage: Storage, out: Any, every_s: float = 5.0, everything: bool = False, backlog: int = 10
) -> str:
    """Print the run's events as they land (the last ``backlog`` first) until it ends; return its status
    (``finished``, ``failed``, ``stopped``, or ``interrupted`` when its driver is gone)."""
    events_now = read_events(storage)
    shown = [e for e in events_now if everything or e.get("event") in WATCHED]
    for e in shown[-backlog:] if backlog else []:
        out.write(f"{_when(e.get('time'))} {event_line(e)}\n")
    seen = len(events_now)
    while True:
        status = live_status(storage, events_now)
        if status not in (RUNNING, UNFINISHED):
            out.write(f"the run is {status}\n")
            out.flush()
            return status
        out.flush()
        time.sleep(every_s)
        events_now = read_events(storage)
        for e in events_now[seen:]:
            if everything or e.get("event") in WATCHED:
                out.write(f"{_when(e.get('time'))} {event_line(e)}\n")
        seen = len(events_now)
