"""``bench_chaos``'s figures from what an arm left behind: rank 0's step log (``chaos_task``), the rank pid
files seen over time, and the faults the harness fired; then the markdown table and the PNG.

Step log rules (the same for every arm, none needs the arm's own step counter):

- an *occurrence* is one line (a step rank 0 started); it *completed* when the same process logged a line
  with another batch after it (or it is the run's last line): a line followed by the same batch in the same
  process was a step cut short by a failure and retried (``interrupted``);
- *kept*: the last completed occurrence of each batch with a finite loss (the final model holds its update);
- *recomputed*: completed occurrences that are not kept (trained again after a restart, or thrown away by a
  rollback);
- a step's time: to the next line of the same process, capped at 3x the median (a checkpoint save or a
  stall after it is not training); the run's last line: the median;
- harness ETTR = time of kept steps / wall (first submission until the last driver returned).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any


@dataclass
class Line:
    t: float
    pid: int
    fp: int
    loss: float


def read_steps(path: str) -> list[Line]:
    out: list[Line] = []
    try:
        with open(path) as fh:
            for raw in fh:
                parts = raw.split()
                if len(parts) == 4:  # a torn last line (a killed writer) has fewer
                    out.append(Line(float(parts[0]), int(parts[1]), int(parts[2]), float(parts[3])))
    except FileNotFoundError:
        pass
    return out


def classify(lines: list[Line]) -> list[dict[str, Any]]:
    """Each line with ``completed``, ``kept`` and ``dt`` (its step time)."""
    rows: list[dict[str, Any]] = [
        {"t": ln.t, "pid": ln.pid, "fp": ln.fp, "loss": ln.loss, "completed": True} for ln in lines
    ]
    next_of: dict[int, int] = {}
    for i in range(len(rows) - 1, -1, -1):
        j = next_of.get(rows[i]["pid"])
        rows[i]["next"] = j
        if j is not None and rows[j]["fp"] == rows[i]["fp"]:
            rows[i]["completed"] = False
        elif j is None and i != len(rows) - 1:
            rows[i]["completed"] = False  # the process's last step, and the run went on: cut short
        next_of[rows[i]["pid"]] = i
    gaps = [rows[r["next"]]["t"] - r["t"] for r in rows if r["next"] is not None and r["completed"]]
    median = statistics.median(gaps) if gaps else 0.0
    for r in rows:
        gap = rows[r["next"]]["t"] - r["t"] if r["next"] is not None else median
        r["dt"] = min(gap, 3 * median)
    kept: set[int] = set()
    seen: set[int] = set()
    for i in range(len(rows) - 1, -1, -1):
        r = rows[i]
        if r["completed"] and math.isfinite(r["loss"]) and r["fp"] not in seen:
            kept.add(i)
            seen.add(r["fp"])
        if r["completed"]:
            seen.add(r["fp"])  # an earlier finite occurrence of a batch whose last one was NaN is not kept
    for i, r in enumerate(rows):
        r["kept"] = i in kept
    return rows


def summarize(lines: list[Line], wall_s: float, faults: list[dict[str, Any]]) -> dict[str, Any]:
    """The arm's step-log figures and, per fault, its recovery time and the steps it cost."""
    rows = classify(lines)
    productive = sum(r["dt"] for r in rows if r["kept"])
    recomputed = [r for r in rows if r["completed"] and not r["kept"]]
    out: dict[str, Any] = {
        "steps_logged": len(rows),
        "steps_kept": sum(1 for r in rows if r["kept"]),
        "steps_recomputed": len(recomputed),
        "steps_interrupted": sum(1 for r in rows if not r["completed"]),
        "median_step_s": round(statistics.median([r["dt"] for r in rows]), 4) if rows else None,
        "productive_s": round(productive, 2),
        "ettr_harness": round(productive / wall_s, 4) if wall_s > 0 else None,
    }
    fired = sorted((f for f in faults if f.get("fired_at")), key=lambda f: f["fired_at"])
    for f in fired:
        before = {r["fp"] for r in rows if r["t"] < f["fired_at"]}
        new = [r["t"] for r in rows if r["t"] >= f["fired_at"] and r["fp"] not in before]
        f["recover_s"] = round(new[0] - f["fired_at"], 2) if new else None
        f["steps_recomputed"] = 0
    for i, r in enumerate(rows):
        if not r["completed"] or r["kept"]:
            continue
        # The fault that cost it: the last one fired before the batch was trained again (a rollback's
        # discard, never trained again: before the discarded occurrence itself).
        redo = next((q["t"] for q in rows[i + 1 :] if q["fp"] == r["fp"]), r["t"])
        hit = [f for f in fired if f["fired_at"] <= redo]
        if hit:
            hit[-1]["steps_recomputed"] += 1
    return out


def timeline(lines: list[Line], t0: float) -> list[tuple[float, int]]:
    """(seconds since submission, distinct batches trained so far) per logged step: the progress curve."""
    seen: set[int] = set()
    out = []
    for ln in lines:
        seen.add(ln.fp)
        out.append((ln.t - t0, len(seen)))
    return out


def table(results: dict[str, Any]) -> str:
    """The markdown table: one row per arm, then one per fault kind and arm."""
    head = (
        "| arm | status | wall s | ETTR (ledger) | ETTR (harness) | steps kept | recomputed | interrupted "
        "| full-group restarts | resubmissions | final weights vs product fault-free |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    rows = []
    for arm, r in results["arms"].items():
        ledger = r.get("goodput", {}).get("ettr")
        ledger_s = "-" if ledger is None else round(ledger, 3)
        rows.append(
            f"| {arm} | {r.get('status')} | {r.get('wall_s')} | {ledger_s} "
            f"| {r.get('ettr_harness')} | {r.get('steps_kept')} | {r.get('steps_recomputed')} "
            f"| {r.get('steps_interrupted')} | {r.get('full_group_restarts')} | {r.get('resubmissions')} "
            f"| {r.get('weights_vs_baseline', '-')} |"
        )
    per_kind = (
        "\n\n| arm | fault | at s | rank | how the arm faced it | recover s | recomputed |\n"
        "|---|---|---:|---:|---|---:|---:|\n"
    )
    for arm, r in results["arms"].items():
        for f in r.get("faults", []):
            at = round(f["fired_at"] - r["submitted_at"], 1) if f.get("fired_at") else "-"
            per_kind += (
                f"| {arm} | {f['kind']} | {at} | {f.get('rank', '-')} | {f.get('faced', '-')} "
                f"| {f.get('recover_s', '-')} | {f.get('steps_recomputed', '-')} |\n"
            )
    return head + "\n".join(rows) + per_kind


def plot(results: dict[str, Any], path: str, timeline_arm: str) -> None:
    """ETTR and recomputed steps per arm; the progress of ``timeline_arm`` over time with its faults."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a, r in results["arms"].items() if "ettr_harness" in r]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [1, 1, 2.4]})
    ettr = [
        results["arms"][a].get("goodput", {}).get("ettr") or results["arms"][a]["ettr_harness"] for a in arms
    ]
    ax1.bar(arms, ettr, color="tab:blue")
    base = results.get("baseline", {}).get("ettr")
    if base:
        ax1.axhline(base, color="gray", linestyle="--", label="product, no faults")
        ax1.legend(loc="lower right")
    ax1.set_ylim(0, 1)
    ax1.set_title("ETTR (productive / wall)")
    ax2.bar(arms, [results["arms"][a]["steps_recomputed"] for a in arms], color="tab:orange")
    ax2.set_title("steps recomputed")
    r = results["arms"].get(timeline_arm, {})
    pts = r.get("timeline", [])
    if pts:
        ax3.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:green", linewidth=1)
    for f in r.get("faults", []):
        if f.get("fired_at"):
            x = f["fired_at"] - r["submitted_at"]
            ax3.axvline(x, color="tab:red", alpha=0.5)
            ax3.text(x, ax3.get_ylim()[1] * 0.95, f["kind"], rotation=90, va="top", fontsize=8)
    ax3.set_xlabel("seconds since submission")
    ax3.set_ylabel("distinct steps trained")
    ax3.set_title(f"{timeline_arm}: progress with the faults marked")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
