"""Steady-state epoch time, product vs bare DDP, measured time-sliced so that the machine's drift cancels.

    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.bench_interleaved [--repeats 5]
        [--arms product,bare] [--epochs 12] [--slice 0.1] [--slow-ms 1.2] [--json out.json]

Why: ``bench_ddp`` runs the arms one after another, each in its own window of time. On a shared VM whose
speed drifts over minutes, the ratio of two such windows is noisier than the 2% the steady-epoch target is
about. Here the arms run *at the same time*, time-sliced: each arm's child process (and everything it
starts: for the product, the embedded Ray's GCS, raylet, agents, log monitor and the worker actors) sits
in its own cgroup, and the coordinator thaws one arm for ``--slice`` seconds while the
others are frozen (cgroup freezer: every process of the arm stops and resumes at once), round robin until
every arm has finished. Each arm therefore runs alone on the machine, exactly as in ``bench_ddp`` (its own
background daemons included, nobody else's), but a slow patch of the VM hits all arms alike.

Each epoch's time is its *active* time: the wall time between the last steps of two consecutive epochs
(rank 0's clock, as in ``bench_ddp``) minus the time its arm spent frozen in between. Only the epochs that
every arm ran while all were being sliced count (after the first arm finishes, the others run on alone). The
ratio of a repeat is mean(arm's epochs) / mean(bare's epochs) over those epochs; over repeats the run
reports the mean of the ratios with its standard error, and judges the product on mean + 1.96 s.e.

With fine slices the arms' epoch times rise and fall together (the machine's slow and fast patches are
shared), which is what makes the ratio precise. Wall-clock periodic work (Ray's daemons' timers, the
product driver's heartbeat, bare's 0.1 s supervisor poll) is squeezed into its arm's active time, so it
weighs N times as much as in a solo run (N arms): the product, which has more of it, is judged
conservatively.

Arms: ``product`` (cluster.train on an embedded Ray), ``bare`` (torch.multiprocessing DDP), ``raytrain``
(TorchTrainer), and ``bare_slow``: the bare arm with every step ``--slow-ms`` longer (a sleep before the
forward pass). An arm may be named twice (``bare,bare``: an A/A check whose ratio must come out 1.00), and
``bare,bare_slow`` checks that the method resolves a slowdown of known size. Like-for-like variants:
``bare_tuned`` (the bare loop with the product's allocator tuning, ``cluster.rank.process.tune_allocator``),
``product_system`` (the product with ``scaling.tune_allocator=false``), ``product_nice15`` (the ranks at
Ray's default niceness 15: ``scaling.worker_niceness=null``, ``RAY_worker_niceness=15``) and ``bare_thread``
(the bare loop on a second thread, as the product's actor runs it). Every variant is a config setting, an
environment variable or a change to the bare loop; the product's code is never altered. The workload is
bench_ddp's (charlm, 2 CPU workers, global batch 64, 48 steps per epoch, checkpoint every 25 steps and every
epoch).

Needs write access to a cgroup freezer: cgroup v1 ``/sys/fs/cgroup/freezer`` or cgroup v2
``cgroup.freeze`` (root, or a delegated cgroup). Nothing else on the machine is frozen.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.bench_ddp import TASK_ARGS, _steps_per_epoch, collect_arm, launch_arm, make_spec

ARMS = (
    "product",
    "bare",
    "raytrain",
    "bare_slow",
    "bare_thread",
    "bare_tuned",
    "product_system",
    "product_nice15",
)
TARGET_EPOCH = 1.02

Interval = tuple[float, float]


# ====================================================================== the freezer
class Freezer:
    """A cgroup for one arm: ``join`` (in the child, before exec) puts a process in it, and everything that
    process starts stays in it; ``freeze`` returns once every process in it is frozen."""

    V1_ROOT = "/sys/fs/cgroup/freezer"
    V2_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")

    def __init__(self, name: str) -> None:
        self.v1 = os.path.isdir(self.V1_ROOT)
        if self.v1:
            self.path = os.path.join(self.V1_ROOT, name)
        else:
            roots = [r for r in self.V2_ROOTS if os.path.isfile(os.path.join(r, "cgroup.controllers"))]
            if not roots:
                raise RuntimeError("no cgroup freezer here (neither /sys/fs/cgroup/freezer nor cgroup v2)")
            self.path = os.path.join(roots[0], name)
        try:
            os.mkdir(self.path)
        except OSError as e:
            raise RuntimeError(
                f"cannot create the cgroup {self.path} ({e}); bench_interleaved needs write access "
                "to a cgroup freezer: run it as root or in a delegated cgroup"
            ) from e
        self.frozen = False

    def join(self) -> None:
        with open(os.path.join(self.path, "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))

    def _write(self, file: str, value: str) -> None:
        with open(os.path.join(self.path, file), "w") as fh:
            fh.write(value)

    def _is_frozen(self) -> bool:
        if self.v1:
            with open(os.path.join(self.path, "freezer.state")) as fh:
                return fh.read().strip() == "FROZEN"
        with open(os.path.join(self.path, "cgroup.events")) as fh:
            return "frozen 1" in fh.read()

    def freeze(self, timeout: float = 10.0) -> None:
        self._write("freezer.state" if self.v1 else "cgroup.freeze", "FROZEN" if self.v1 else "1")
        deadline = time.monotonic() + timeout
        while not self._is_frozen():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.path} did not freeze within {timeout}s")
            if self.v1:  # v1 moves FREEZING -> FROZEN when read after every task stopped; re-request
                self._write("freezer.state", "FROZEN")
            time.sleep(0.0005)
        self.frozen = True

    def thaw(self) -> None:
        self._write("freezer.state" if self.v1 else "cgroup.freeze", "THAWED" if self.v1 else "0")
        self.frozen = False

    def pids(self) -> list[int]:
        with open(os.path.join(self.path, "cgroup.procs")) as fh:
            return [int(x) for x in fh.read().split()]

    def remove(self) -> None:
        """Thaw, SIGKILL whatever is still inside, remove the cgroup."""
        with contextlib.suppress(OSError):
            self.thaw()
        for _ in range(100):
            try:
                left = self.pids()
            except OSError:
                return
            if not left:
                break
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        with contextlib.suppress(OSError):
            os.rmdir(self.path)


# ====================================================================== the arithmetic
def active_between(intervals: list[Interval], a: float, b: float) -> float:
    """Seconds of [a, b] that fall inside the (disjoint) active intervals."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in intervals)


def epoch_active_times(ends: list[float | None], intervals: list[Interval], until: float) -> list[float]:
    """Active seconds of epochs 2..N (between the last steps of consecutive epochs), for the epochs that
    ended by ``until`` (while every arm was still being sliced)."""
    out = []
    for a, b in itertools.pairwise(ends):
        if a is not None and b is not None and b <= until:
            out.append(active_between(intervals, a, b))
    return out


def cpu_ticks(pids: list[int]) -> dict[int, tuple[str, int]]:
    """pid -> (name, user + system clock ticks) for each process still there."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                raw = fh.read()
        except OSError:
            continue
        fields = raw.rsplit(") ", 1)[1].split()
        out[pid] = (raw[raw.index("(") + 1 : raw.rindex(")")], int(fields[11]) + int(fields[12]))
    return out


def cpu_between(
    samples: list[tuple[float, dict[int, tuple[str, int]]]], a: float, b: float
) -> dict[str, float]:
    """CPU seconds each process used between the samples last taken before ``a`` and before ``b``, as
    ``workers`` (the two busiest processes: the ranks) and ``rest`` (everything else of the arm)."""
    before_a = [s for t, s in samples if t <= a]
    before_b = [s for t, s in samples if t <= b]
    if not before_a or not before_b:
        return {}
    sa, sb = before_a[-1], before_b[-1]
    hz = os.sysconf("SC_CLK_TCK")
    used = sorted(((tb - sa.get(pid, (name, 0))[1]) / hz for pid, (name, tb) in sb.items()), reverse=True)
    return {"workers": sum(used[:2]), "rest": sum(used[2:])}


def mean_se(values: list[float]) -> tuple[float, float]:
    m = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return m, se


# ====================================================================== the arms
def arm_spec(
    arm: str, work: str, *, epochs: int, ckpt_every: int, steps_per_epoch: int, slow_ms: float
) -> dict[str, Any]:
    """The ``bench_ddp`` child spec of one arm: its base arm (``_child_arm``: product, bare or raytrain) and
    the variant's settings."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {ARMS}")
    slow = arm == "bare_slow"
    spec = make_spec(
        work,
        epochs=epochs,
        ckpt_every=ckpt_every,
        steps_per_epoch=steps_per_epoch,
        task="benchmarks.faults:SlowCharLM" if slow else "jobs.tasks.charlm:CharLMTask",
        task_args={"step_delay_ms": slow_ms} if slow else None,
    )
    spec["_child_arm"] = arm.split("_")[0]
    spec["loop_thread"] = arm == "bare_thread"
    spec["tune_allocator"] = arm == "bare_tuned"
    if arm == "product_system":
        spec["product_set"].append("scaling.tune_allocator=false")
    if arm == "product_nice15":  # the ranks where Ray puts them by default
        spec["product_set"].append("scaling.worker_niceness=null")
        spec["env"] = {"RAY_worker_niceness": "15"}
    return spec


# ====================================================================== one repeat
def run_repeat(
    labels: list[str],
    specs: dict[str, dict[str, Any]],
    works: dict[str, str],
    slice_s: float,
    timeout_s: float,
    tag: str,
) -> dict[str, Any]:
    freezers = {lab: Freezer(f"{tag}_{lab}") for lab in labels}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    intervals: dict[str, list[Interval]] = {lab: [] for lab in labels}
    started: dict[str, float] = {}
    exited: dict[str, float] = {}
    rcs: dict[str, int] = {}
    cpu: dict[str, list[tuple[float, dict[int, tuple[str, int]]]]] = {lab: [] for lab in labels}
    t_start = time.time()
    try:
        for (
            lab
        ) in labels:  # start each arm, then freeze it at once: nothing of it has run yet but Python start
            t = time.time()
            procs[lab] = launch_arm(
                specs[lab]["_child_arm"], specs[lab], works[lab], preexec_fn=freezers[lab].join
            )
            started[lab] = t
            freezers[lab].freeze()
            intervals[lab].append((t, time.time()))
        deadline = time.monotonic() + timeout_s
        while len(exited) < len(labels):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"arms still running after {timeout_s:.0f}s: "
                    f"{[lab for lab in labels if lab not in exited]}"
                )
            for lab in labels:
                if lab in exited:
                    continue
                fz, proc = freezers[lab], procs[lab]
                t_on = time.time()
                fz.thaw()
                try:
                    rcs[lab] = proc.wait(timeout=slice_s)
                    exited[lab] = time.time()
                except subprocess.TimeoutExpired:
                    pass
                fz.freeze()
                intervals[lab].append((t_on, time.time()))
                cpu[lab].append((time.time(), cpu_ticks(fz.pids())))  # frozen: the counts hold still
                if lab in exited:
                    print(
                        f"  {lab} finished: {exited[lab] - t_start:.0f}s wall, "
                        f"{active_between(intervals[lab], t_start, exited[lab]):.1f}s active",
                        flush=True,
                    )
    finally:
        for lab, proc in procs.items():
            if lab not in rcs:
                freezers[lab].thaw()
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rcs[lab] = -9
        results = {
            lab: collect_arm(
                specs[lab]["_child_arm"],
                specs[lab],
                works[lab],
                rcs.get(lab, -9),
                time.time() - started.get(lab, t_start),
            )
            for lab in procs
        }
        for fz in freezers.values():
            fz.remove()
    until = min(exited.values()) if exited else t_start  # after this, the others ran without slicing
    out: dict[str, Any] = {"slices": {lab: len(iv) for lab, iv in intervals.items()}, "arms": {}}
    epochs_of: dict[str, list[float]] = {}
    for lab in labels:
        res = results[lab]
        if "error" not in res:
            epochs_of[lab] = epoch_active_times(res.get("epoch_end_times", []), intervals[lab], until)
    common = min(
        (len(e) for e in epochs_of.values()), default=0
    )  # epochs 2..common+1 ran sliced in every arm
    out["common_epochs"] = common
    for lab in labels:
        res = results[lab]
        res["label"] = lab
        if lab in epochs_of:
            iv, epochs = intervals[lab], epochs_of[lab]
            t0, t_end = float(res["t0"]), float(res["t_end"])
            ends = res.get("epoch_end_times", [])
            window = (ends[0], ends[common]) if common and ends[0] and ends[common] else None
            steps = common * int(res.get("steps_per_epoch") or 0)
            cpu_s = cpu_between(cpu[lab], *window) if window else {}
            res["interleaved"] = {
                "epoch_active_s": epochs,
                "cpu_ms_per_step": {k: 1000 * v / steps for k, v in cpu_s.items()} if steps else {},
                "epoch_mean_s": statistics.fmean(epochs[:common]) if common else None,
                "epoch_median_s": statistics.median(epochs[:common]) if common else None,
                "first_step_active_s": active_between(iv, t0, t0 + res["first_step_s"])
                if res["first_step_s"]
                else None,
                "total_active_s": active_between(iv, t0, t_end),
                "wall_s": t_end - t0,
            }
        out["arms"][lab] = res
    return out


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _label_arms(arms: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    labels = []
    for a in arms:
        seen[a] = seen.get(a, 0) + 1
        labels.append(a if arms.count(a) == 1 else f"{a}#{seen[a]}")
    return labels


def _ratios(repeats: list[dict[str, Any]], lab: str, base: str, key: str) -> list[float]:
    rs = []
    for rep in repeats:
        a = rep["arms"].get(lab, {}).get("interleaved", {}).get(key)
        b = rep["arms"].get(base, {}).get("interleaved", {}).get(key)
        if a and b:
            rs.append(a / b)
    return rs


def summarize(repeats: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Per repeat, each arm's mean active epoch over the epochs every arm ran sliced, as a ratio to bare's;
    over repeats, the mean of those ratios with its standard error (and the median-epoch ratio beside it)."""
    base = "bare" if "bare" in labels else next((lab for lab in labels if lab.startswith("bare")), labels[0])
    per_arm: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    for lab in labels:
        ils = [rep["arms"].get(lab, {}).get("interleaved", {}) for rep in repeats]
        cpus = [il["cpu_ms_per_step"] for il in ils if il.get("cpu_ms_per_step")]
        per_arm[lab] = {
            "epoch_mean_s": [il.get("epoch_mean_s") for il in ils],
            "cpu_ms_per_step": {k: statistics.median(c[k] for c in cpus) for k in ("workers", "rest")}
            if cpus
            else {},
        }
        if lab == base:
            continue
        rs = _ratios(repeats, lab, base, "epoch_mean_s")
        if rs:
            m, se = mean_se(rs)
            med = _ratios(repeats, lab, base, "epoch_median_s")
            ratios[f"{lab}/{base}"] = {
                "per_repeat": rs,
                "mean": m,
                "se": se,
                "upper95": None if math.isnan(se) else m + 1.96 * se,
                "median_epoch_ratio_per_repeat": med,
            }
    return {"base": base, "per_arm": per_arm, "epoch_ratios": ratios}


def print_summary(summary: dict[str, Any]) -> None:
    print("\nsteady-state epoch: mean active seconds over the epochs all arms ran sliced, per repeat:")
    for lab, a in summary["per_arm"].items():
        print(f"  {lab:12} " + " ".join("-" if v is None else f"{v:.3f}" for v in a["epoch_mean_s"]))
    print(
        "CPU per step over those epochs, median over repeats (ranks = the two busiest processes; rest = the "
        "arm's other processes):"
    )
    for lab, a in summary["per_arm"].items():
        if a.get("cpu_ms_per_step"):
            print(
                f"  {lab:12} ranks {a['cpu_ms_per_step']['workers']:.1f} ms, "
                f"rest {a['cpu_ms_per_step']['rest']:.2f} ms"
            )
    for name, r in summary["epoch_ratios"].items():
        print(
            f"\n{name}: per repeat "
            + " ".join(f"{v:.4f}" for v in r["per_repeat"])
            + "   (median-epoch ratio: "
            + " ".join(f"{v:.4f}" for v in r["median_epoch_ratio_per_repeat"])
            + ")"
        )
        se = "-" if math.isnan(r["se"]) else f"{r['se']:.4f}"
        up = "-" if r["upper95"] is None else f"{r['upper95']:.4f}"
        print(f"  mean {r['mean']:.4f}x +- {se} (s.e.), mean + 1.96 s.e. = {up}")
        if name.startswith("product/"):
            ok = r["upper95"] is not None and r["upper95"] <= TARGET_EPOCH
            print(
                f"  steady-epoch target <= {TARGET_EPOCH}x: {'met' if ok else 'NOT shown'} "
                f"(judged on mean + 1.96 s.e.)"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_interleaved",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--arms", default="product,bare", help=f"comma list from {ARMS}; an arm may repeat")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--slice", type=float, default=0.1, help="seconds each arm runs before the next is thawed")
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=25,
        help="checkpoint every N steps in every arm (and at every epoch end); "
        "a large N leaves epoch ends only",
    )
    p.add_argument(
        "--slow-ms", type=float, default=1.2, help="extra milliseconds per step of the bare_slow arm"
    )
    p.add_argument(
        "--timeout", type=float, default=900, help="seconds per repeat before everything is killed"
    )
    p.add_argument("--json", help="write every repeat and the summary to this file")
    p.add_argument("--summarize", metavar="JSON", help="print the summary of an earlier --json file and exit")
    args = p.parse_args(argv)
    if args.summarize:
        with open(args.summarize) as fh:
            doc = json.load(fh)
        print(f"{doc['command']}  ({doc['date']})")
        print_summary(summarize(doc["repeats"], doc["labels"]))
        return 0
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or len(arms) < 2:
        p.error(f"--arms needs two or more of {ARMS} (got {args.arms!r})")
    if args.slice <= 0 or args.epochs < 3:
        p.error("--slice must be > 0 and --epochs >= 3")
    labels = _label_arms(arms)
    spe = _steps_per_epoch(TASK_ARGS, 64)
    # `kill`/`timeout` send SIGTERM: unwind through the finally blocks, which thaw and kill every arm (a
    # frozen process cannot act on a signal, so without this they would stay frozen forever).
    signal.signal(signal.SIGTERM, _terminated)
    scratch = tempfile.mkdtemp(prefix="bint", dir="/tmp")  # short: Ray's socket paths live under it
    tag = os.path.basename(scratch)
    repeats: list[dict[str, Any]] = []
    t_all = time.time()
    failed = False
    try:
        for rep in range(args.repeats):
            order = labels[rep % len(labels) :] + labels[: rep % len(labels)]  # who runs first rotates
            specs, works = {}, {}
            for i, lab in enumerate(order):
                work = os.path.join(scratch, f"{rep}_{i}")
                os.makedirs(work)
                specs[lab] = arm_spec(
                    lab.split("#")[0],
                    work,
                    epochs=args.epochs,
                    ckpt_every=args.ckpt_every,
                    steps_per_epoch=spe,
                    slow_ms=args.slow_ms,
                )
                works[lab] = work
            print(
                f"[repeat {rep + 1}/{args.repeats}] {', '.join(order)} time-sliced ({args.slice}s) ...",
                flush=True,
            )
            res = run_repeat(order, specs, works, args.slice, args.timeout, f"{tag}_{rep}")
            res["repeat"] = rep
            repeats.append(res)
            for lab in order:
                a = res["arms"][lab]
                if "error" in a:
                    failed = True
                    print(f"  {lab} FAILED: {a['error']}", flush=True)
                else:
                    il = a["interleaved"]
                    mean = "-" if il["epoch_mean_s"] is None else f"{il['epoch_mean_s']:.3f}s"
                    cpu = il["cpu_ms_per_step"]
                    cpu_txt = (
                        f", CPU/step: ranks {cpu['workers']:.1f} ms, rest {cpu['rest']:.2f} ms" if cpu else ""
                    )
                    print(
                        f"  {lab:12} epoch {mean} active (mean of {res['common_epochs']} epochs){cpu_txt}, "
                        "first step "
                        f"{il['first_step_active_s']:.2f}s, "
                        f"total {il['total_active_s']:.2f}s active / {il['wall_s']:.1f}s wall",
                        flush=True,
                    )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(repeats, labels)
    print_summary(summary)
    if args.json:
        doc = {
            "benchmark": "bench_interleaved",
            "command": " ".join(
                [
                    os.path.basename(sys.executable),
                    "-m",
                    "benchmarks.bench_interleaved",
                    *(sys.argv[1:] if argv is None else argv),
                ]
            ),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "workload": {
                "task_args": TASK_ARGS,
                "workers": 2,
                "global_batch": 64,
                "epochs": args.epochs,
                "steps_per_epoch": spe,
                "ckpt_every_steps": args.ckpt_every,
                "slice_s": args.slice,
                "slow_ms": args.slow_ms,
            },
            "labels": labels,
            "wall_s": time.time() - t_all,
            "repeats": repeats,
            **summary,
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
