"""The orchestrator from 2 to 32 ranks, side by side with Ray Train and bare DDP, in one run.

    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.bench_scale [--ranks 2 4 8 16 32] [--json F]
        [--ray-cluster] [--arms product,raytrain,bare] [--product-set failures.hot_spare=true] [--cores 2]

``--ray-cluster``: the Ray arms connect to one ``ray start --head`` started before any clock (as a job
submitted to a running cluster does) instead of each starting an embedded Ray.

Per N, each arm (``product``, ``raytrain``, ``bare``: benchmarks/bench_ddp.py's, same model, data and
global batch 64) runs 3 epochs of the fixed char-LM workload with N ranks sharing this machine's cores
(``cpus_per_worker`` = min(1, 2/N); ``--cores C`` on a machine with C cores: min(1, C/N)), and rank 1
SIGKILLs itself before step ``2 * steps_per_epoch + 10`` (epoch 3).
Measured per N and arm, each arm in a fresh process:

  first_step_s   submit (the call) -> rank 0's first optimizer step
  epoch_s        epoch 2 (clean: before the kill), rank 0's last step of epoch 1 -> of epoch 2
  recovery_s     the kill -> rank 0's first step after it
  teardown_s     rank 0's last step -> the call returned, everything stopped
  driver_cpu_s   CPU seconds of the submitting process (the product's driver; Ray Train's driver script,
                 whose controller runs as an actor elsewhere; bare's torchrun-style supervisor)
  driver_rss_mb  its peak resident memory
  writes_per_epoch  product: storage writes it made (events, metrics, run.json, probe, checkpoint files and
                 manifests), counted from its own record, per epoch; others: files left in their storage
                 per epoch (a lower bound)
  rendezvous_s   product: the slowest rank's process-group phase at the first start (rank 0's TCPStore
                 serving every rank's connect)

Stops at the first N whose runs fail for lack of memory, and says so. Writes a PNG of the curves to
docs/scale.png and prints the table for RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

from benchmarks.bench_ddp import REPO, TASK_ARGS, RayHead, _steps_per_epoch, make_spec, read_events, run_arm

ARMS = ("product", "raytrain", "bare")
FIGURES = ("first_step_s", "epoch_s", "recovery_s", "teardown_s", "driver_cpu_s", "driver_rss_mb")


def product_writes(run: str) -> int:
    """Storage writes of a product run, from its own record: every event append, every metrics file,
    run.json and the probe, and per checkpoint its files plus its manifest (and the manifest delete)."""
    events = read_events(run)
    metrics = len([f for f in os.listdir(os.path.join(run, "metrics")) if f.endswith(".parquet")])
    ckpts = [e for e in events if e["event"] == "checkpoint"]
    return len(events) + metrics + 2 + sum(2 + 2 for _ in ckpts)  # model.pt, train_state.pt, manifest, rm


def files_under(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def one(
    arm: str,
    n: int,
    spe: int,
    scratch: str,
    epochs: int,
    timeout: float,
    product_set: list[str] | None = None,
    head: RayHead | None = None,
    cores: int = 2,
) -> dict[str, Any]:
    work = os.path.join(scratch, f"{n}{arm}")
    os.makedirs(work)
    kill = 2 * spe + 10
    spec = make_spec(
        work,
        fault=True,
        kill_step=kill,
        epochs=epochs,
        ckpt_every=10,
        steps_per_epoch=spe,
        workers=n,
        product_set=product_set,
        head=head,
        cores=cores,
    )
    res = run_arm(arm, spec, work, timeout)
    res["workers"] = n
    if "error" in res:
        return res
    res["recovery_s"] = res.get("fault", {}).get("recovery_s")
    res["lost_steps"] = res.get("fault", {}).get("lost_steps")
    e2 = res.get("epochs_2_to_n_s") or []
    res["epoch_s"] = e2[0] if e2 else None  # epoch 2, before the kill in epoch 3
    if arm == "product":
        run = os.path.join(spec["storage"], "bench")
        res["writes_per_epoch"] = product_writes(run) / epochs
        started = [e for e in read_events(run) if e["event"] == "group_started"]
        res["rendezvous_s"] = started[0].get("setup_s", {}).get("process_group") if started else None
        res["recovery_setup_s"] = started[1].get("setup_s") if len(started) > 1 else None
        res["reused_workers"] = next(
            (e.get("reused_workers") for e in read_events(run) if e["event"] == "recovered"), None
        )
    else:
        res["writes_per_epoch"] = (
            files_under(spec["storage"] if arm == "raytrain" else spec["ckpt_dir"]) / epochs
        )
    return res


def fmt(v: Any, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(rows: list[dict[str, Any]]) -> str:
    by = {(r["workers"], r["arm"]): r for r in rows}
    ns = sorted({r["workers"] for r in rows})
    out = [
        "| N | system | first step s | epoch s | recovery s | teardown s | driver CPU s | driver RSS MB | "
        "writes/epoch | first step vs bare | vs Ray Train | recovery vs N=2 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base_rec = by.get((ns[0], "product"), {}).get("recovery_s") if ns else None
    for n in ns:
        for arm in ARMS:
            r = by.get((n, arm))
            if r is None:
                continue
            if "error" in r:
                out.append(f"| {n} | {arm} | failed: {r['error'].splitlines()[0][:80]} |")
                continue
            vs_bare = vs_rt = vs_two = None
            if arm == "product":
                bare, rt = by.get((n, "bare"), {}), by.get((n, "raytrain"), {})
                if r.get("first_step_s") and bare.get("first_step_s"):
                    vs_bare = r["first_step_s"] / bare["first_step_s"]
                if r.get("first_step_s") and rt.get("first_step_s"):
                    vs_rt = r["first_step_s"] / rt["first_step_s"]
                if r.get("recovery_s") and base_rec:
                    vs_two = r["recovery_s"] / base_rec
            out.append(
                f"| {n} | {arm} | {fmt(r.get('first_step_s'))} | {fmt(r.get('epoch_s'))} | "
                f"{fmt(r.get('recovery_s'))} | {fmt(r.get('teardown_s'))} | {fmt(r.get('driver_cpu_s'))} | "
                f"{fmt(r.get('driver_rss_mb'), 0)} | {fmt(r.get('writes_per_epoch'), 1)} | "
                f"{fmt(vs_bare)} | {fmt(vs_rt)} | {fmt(vs_two)} |"
            )
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str, cores: int = 2) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, key, label in zip(
        axes,
        ("first_step_s", "epoch_s", "recovery_s", "teardown_s"),
        ("submit -> first step (s)", "steady epoch (s)", "SIGKILL -> first step after (s)", "teardown (s)"),
    ):
        for arm in ARMS:
            pts = sorted((r["workers"], r[key]) for r in rows if r["arm"] == arm and r.get(key) is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=arm)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(
        f"cluster vs Ray Train vs bare DDP, char-LM on {cores} CPU cores (benchmarks/bench_scale.py)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def save(path: str | None, rows: list[dict[str, Any]]) -> None:
    if not path:
        return
    with open(path, "w") as fh:
        json.dump(
            {
                "command": " ".join(["python", "-m", "benchmarks.bench_scale", *sys.argv[1:]]),
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                "rows": rows,
            },
            fh,
            indent=1,
            default=str,
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json")
    p.add_argument("--png", default=os.path.join(REPO, "docs", "scale.png"))
    p.add_argument(
        "--product-set",
        action="append",
        default=[],
        help="config override for the product arm (repeatable), e.g. failures.hot_spare=true",
    )
    p.add_argument(
        "--ray-cluster",
        action="store_true",
        help="start a `ray start --head` first and connect the Ray arms to it (as `ray job submit` does), "
        "so that no arm's first step includes starting Ray",
    )
    p.add_argument(
        "--cores",
        type=int,
        default=2,
        help="CPUs the ranks share (Ray's num_cpus; cpus_per_worker = min(1, cores/N)): 2 on the dev box, "
        "the machine's cores where there are more",
    )
    args = p.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    spe = _steps_per_epoch(TASK_ARGS, 64)
    scratch = tempfile.mkdtemp(prefix="bsc", dir="/tmp")
    rows: list[dict[str, Any]] = []
    head = RayHead(os.path.join(scratch, "head"), args.cores) if args.ray_cluster else None
    try:
        if head is not None:
            print(f"starting a Ray head for the Ray arms at {head.address} ...", flush=True)
            head.start()
        for n in args.ranks:
            failed = 0
            for arm in arms:
                t = time.time()
                res = one(arm, n, spe, scratch, args.epochs, args.timeout, args.product_set, head, args.cores)
                res["arm"] = arm
                rows.append(res)
                save(args.json, rows)  # after every arm: a run cut short keeps what it measured
                status = (
                    f"FAILED {res['error'].splitlines()[0][:200]}"
                    if "error" in res
                    else ", ".join(f"{k} {fmt(res.get(k))}" for k in FIGURES)
                )
                print(f"N={n} {arm}: {status} ({time.time() - t:.0f}s)", flush=True)
                failed += "error" in res
            if failed == len(arms):
                print(f"every arm failed at N={n}: stopping here (memory or time)", flush=True)
                break
    finally:
        if head is not None:
            head.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print(table(rows))
    try:
        plot(rows, args.png, args.cores)
        print(f"wrote {args.png}")
    except ImportError:
        print("matplotlib missing: no PNG (pip install -e '.[plot]')")
    save(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
