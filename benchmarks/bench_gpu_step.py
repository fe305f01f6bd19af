"""bf16 step time on one GPU: this product (cluster.train, 1 worker, nccl, DDP of 1) vs a bare loop.

    RAY_AUTH_MODE=disabled python -m benchmarks.bench_gpu_step [--epochs 3] [--json out.json]

Same model (CharLMTask at GPU size: context 256, d_model 512, 8 layers, 8 heads, dropout 0), same data,
seed, global batch (64), AdamW + warmup, torch.autocast(bfloat16). The bare loop is what a user writes by
hand on one GPU: no process group, no DDP, a random permutation per epoch, the batch gathered on the CPU
and copied to the GPU, one host sync per step (``float(loss)``, as the product's loss bookkeeping does).
Each arm runs in its own fresh process. Reported: median interval between consecutive optimizer steps
within an epoch (epoch 1's first 10 steps skipped as warm-up), samples/s, and product/bare ratios.
Needs a CUDA GPU; exits 2 without one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_ARGS = {
    "context": 256,
    "d_model": 512,
    "n_layers": 8,
    "n_heads": 8,
    "dropout": 0.0,
    "max_chars": 900_000,
    "lr": 6e-4,
    "warmup_steps": 20,
}
BATCH = 64
WARMUP = 10


def _intervals(rows: list[tuple[int, int, float]]) -> list[float]:
    """rows: (epoch, global_step, time) of consecutive steps; within-epoch intervals after warm-up."""
    out = []
    for (e0, s0, t0), (e1, s1, t1) in itertools.pairwise(rows):
        if e0 == e1 and s1 == s0 + 1 and s1 > WARMUP:
            out.append(t1 - t0)
    return out


def child_bare(epochs: int) -> dict[str, Any]:
    import torch

    from jobs.tasks.charlm import CharLMTask

    dev = torch.device("cuda", 0)
    task = CharLMTask(**TASK_ARGS)
    torch.manual_seed(0)
    model = task.build_model().to(dev)
    ds = task.build_train_dataset()
    x, y = ds.tensors
    steps_per_epoch = len(x) // BATCH
    opt = task.build_optimizer(model)
    sched = task.build_scheduler(opt, steps_per_epoch * epochs)
    rows: list[tuple[int, int, float]] = []
    step = 0
    t0 = time.time()
    for epoch in range(epochs):
        g = torch.Generator()
        g.manual_seed(epoch)
        perm = torch.randperm(len(x), generator=g)
        model.train()
        for i in range(steps_per_epoch):
            idx = perm[i * BATCH : (i + 1) * BATCH]
            batch = (x[idx].to(dev, non_blocking=True), y[idx].to(dev, non_blocking=True))
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss, _ = task.compute_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            float(loss.detach())  # one host sync per step, like the product's loss bookkeeping
            step += 1
            rows.append((epoch, step, time.time()))
    return {
        "rows": rows,
        "wall_s": time.time() - t0,
        "steps_per_epoch": steps_per_epoch,
        "device": torch.cuda.get_device_name(0),
    }


def child_product(epochs: int, storage: str) -> dict[str, Any]:
    import pyarrow.parquet as pq

    from cluster import load_config, train

    overrides = [
        "name=gpu-step",
        f"storage={storage}",
        f"training.epochs={epochs}",
        f"training.global_batch_size={BATCH}",
        "training.seed=0",
        "training.amp=bf16",
        "training.log_every_steps=1",
        "scaling.num_workers=1",
        "scaling.use_gpu=true",
        "scaling.cpus_per_worker=4",
        "checkpoint.every_steps=0",
        "checkpoint.every_epochs=0",
    ]
    cfg = load_config(
        os.path.join(REPO, "jobs/configs/tiny_cpu.yaml"),
        overrides,
        data={"task": "jobs.tasks.charlm:CharLMTask", "task_args": TASK_ARGS},
    )
    t0 = time.time()
    train(cfg)
    wall = time.time() - t0
    table = pq.read_table(os.path.join(storage, "gpu-step", "metrics")).to_pylist()
    steps = sorted((r for r in table if r["kind"] == "step"), key=lambda r: r["global_step"])
    rows = [(int(r["epoch"]), int(r["global_step"]), float(r["time"])) for r in steps]
    return {
        "rows": rows,
        "wall_s": wall,
        "steps_per_epoch": None,
        "step_time_s_median": statistics.median(float(r["step_time_s"]) for r in steps[WARMUP:]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_gpu_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=150, help="seconds per arm")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--child", choices=("bare", "product"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--storage", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        res = child_bare(args.epochs) if args.child == "bare" else child_product(args.epochs, args.storage)
        with open(args.out, "w") as fh:
            json.dump(res, fh)
        return 0

    import torch

    if not torch.cuda.is_available():
        print("bench_gpu_step: no CUDA GPU visible to torch; nothing measured", file=sys.stderr)
        return 2
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bgpu", dir="/tmp") as work:
        env = dict(
            os.environ,
            RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"),
            RAY_TMPDIR=os.path.join(work, "r"),
            RAY_USAGE_STATS_ENABLED="0",
            PYTHONPATH=os.pathsep.join(q for q in [REPO, os.environ.get("PYTHONPATH", "")] if q),
        )
        env.pop("RAY_ADDRESS", None)
        for arm in ("bare", "product"):
            out = os.path.join(work, f"{arm}.json")
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.bench_gpu_step",
                "--child",
                arm,
                "--out",
                out,
                "--epochs",
                str(args.epochs),
                "--storage",
                os.path.join(work, "runs"),
            ]
            print(f"{arm} ...", flush=True)
            try:
                rc = subprocess.run(cmd, cwd=REPO, env=env, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
            if rc != 0 or not os.path.exists(out):
                print(f"  {arm} failed (exit {rc})", file=sys.stderr)
                results[arm] = {"error": f"exit {rc}"}
                continue
            with open(out) as fh:
                res = json.load(fh)
            iv = _intervals([tuple(r) for r in res.pop("rows")])
            res["step_interval_ms_median"] = 1000 * statistics.median(iv) if iv else None
            res["samples_per_s"] = BATCH / statistics.median(iv) if iv else None
            res["intervals_used"] = len(iv)
            results[arm] = res
            print(
                f"  median step interval {res['step_interval_ms_median']:.2f} ms "
                f"({res['samples_per_s']:.0f} samples/s), wall {res['wall_s']:.1f}s",
                flush=True,
            )
    b, pr = results.get("bare", {}), results.get("product", {})
    ok = bool(b.get("step_interval_ms_median") and pr.get("step_interval_ms_median"))
    if ok:
        ratio = pr["step_interval_ms_median"] / b["step_interval_ms_median"]
        results["ratio_product_over_bare_step"] = ratio
        print(
            f"\nbf16 step time product/bare: {ratio:.3f}x  (product {pr['step_interval_ms_median']:.2f} ms, "
            f"bare {b['step_interval_ms_median']:.2f} ms on {b.get('device')})"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
