"""bf16 step time on one GPU: the product's worker against a bare DDP loop with the same input pipeline.

    python -m benchmarks.bench_gpu_step [--epochs 4] [--repeats 2] [--loader-workers 2] [--json out.json]

No Ray (the GPU machines have none): the product arm runs ``cluster.rank.worker.Worker`` in a plain process,
as the multiprocess tests do (rendezvous store, NCCL process group of 1, DDP, the product's input pipeline
with ``training.loader_workers`` processes and pinned memory, bf16 autocast, its bookkeeping, no
checkpoints). The bare arm is what a user writes by hand: ``init_process_group("nccl")``, DDP,
``DataLoader(num_workers=k, pin_memory=True, persistent_workers=True)`` over ``DistributedSampler(seed=0)``,
``non_blocking`` copies, the same autocast, the loss read at log steps only (every 10 steps, as the
product is set to). Same model (CharLMTask at GPU size: context 512, d_model 1024, 12 layers, 16 heads,
about 150M parameters), data, seed, global batch (64), AdamW + warmup. Each arm runs in a fresh process,
arms alternate ``--repeats`` times. Reported: mean step time over the epochs between the first (warm-up:
cuBLAS heuristics, the allocator, loader start) and the last (the product writes the run's final
checkpoint there, the bare loop nothing), and product/bare; and the last epoch's extra seconds.
Target: product/bare <= 1.02, with a step of at least 50 ms (else the model is too small to say anything).
Needs a CUDA GPU; exits 2 without one.
"""

from __future__ import annotations

import argparse
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
    "context": 512,
    "d_model": 1024,
    "n_layers": 12,
    "n_heads": 16,
    "dropout": 0.0,
    "max_chars": 900_000,
    "lr": 3e-4,
    "warmup_steps": 20,
}
BATCH = 64
LOG_EVERY = 10
TARGET = 1.02
MIN_STEP_MS = 50.0


def child_bare(epochs: int, loader_workers: int, prefetch: int) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from jobs.tasks.charlm import CharLMTask

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
    task = CharLMTask(**TASK_ARGS)
    torch.manual_seed(0)
    model = DDP(task.build_model().to(dev), device_ids=[0], gradient_as_bucket_view=True)
    x, y = task.build_train_dataset().tensors
    ds = TensorDataset(x, y)
    sampler: DistributedSampler[Any] = DistributedSampler(
        ds, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True
    )
    loader = DataLoader(
        ds,
        batch_size=BATCH,
        sampler=sampler,
        drop_last=True,
        num_workers=loader_workers,
        pin_memory=True,
        persistent_workers=loader_workers > 0,
        prefetch_factor=prefetch if loader_workers > 0 else None,
        multiprocessing_context="forkserver" if loader_workers > 0 else None,
    )
    steps_per_epoch = len(loader)
    opt = task.build_optimizer(model.module)
    sched = task.build_scheduler(opt, steps_per_epoch * epochs)
    epoch_s: list[float] = []
    losses: list[float] = []
    for epoch in range(epochs):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for i, (xb, yb) in enumerate(loader, 1):
            batch = (xb.to(dev, non_blocking=True), yb.to(dev, non_blocking=True))
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss, _ = task.compute_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            total += loss.detach()
            if i % LOG_EVERY == 0:
                losses.append(float(total) / i)  # the log step's read, as the product's
        losses.append(float(total) / steps_per_epoch)
        epoch_s.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {
        "epoch_s": epoch_s,
        "steps_per_epoch": steps_per_epoch,
        "loss": losses[-1],
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }


def child_product(epochs: int, loader_workers: int, prefetch: int, storage: str) -> dict[str, Any]:
    import torch

    from cluster.rank.worker import Worker
    from cluster.spec.load import load_config

    cfg = load_config(
        os.path.join(REPO, "jobs/configs/tiny_cpu.yaml"),
        [
            "name=gpu-step",
            f"storage={storage}",
            f"training.epochs={epochs}",
            f"training.global_batch_size={BATCH}",
            "training.seed=0",
            "training.amp=bf16",
            f"training.log_every_steps={LOG_EVERY}",
            f"training.loader_workers={loader_workers}",
            f"training.prefetch={prefetch}",
            "scaling.num_workers=1",
            "scaling.use_gpu=true",
            "scaling.cpus_per_worker=4",
            "checkpoint.every_steps=0",
            "checkpoint.every_epochs=0",
        ],
        data={"task": "jobs.tasks.charlm:CharLMTask", "task_args": TASK_ARGS},
    )
    worker = Worker(cfg, 0, 1, f"{storage}/gpu-step", 0)
    port = worker.bind_store()
    session = worker.setup("127.0.0.1", port)
    epoch_s: list[float] = []
    loss = float("nan")
    for epoch in range(epochs):
        t0 = time.perf_counter()
        res = worker.run_epoch(epoch, 0)
        epoch_s.append(time.perf_counter() - t0)
        loss = res.loss
    worker.finish()
    worker.shutdown()
    return {
        "epoch_s": epoch_s,
        "steps_per_epoch": session.info.steps_per_epoch,
        "loss": loss,
        "backend": session.info.backend,
        "device": torch.cuda.get_device_name(0),
    }


def _step_ms(res: dict[str, Any]) -> float:
    """Mean step time over the steady epochs: not the first (warm-up), not the last (the product writes
    the run's final checkpoint in it, which the bare loop does not)."""
    steady = res["epoch_s"][1:-1]
    return 1000 * sum(steady) / (len(steady) * res["steps_per_epoch"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_gpu_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--epochs", type=int, default=3, help="epochs per run (the first and the last are not timed)"
    )
    p.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternating")
    p.add_argument("--loader-workers", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120, help="seconds per run")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--child", choices=("bare", "product"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--storage", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.epochs < 3:
        p.error("--epochs must be at least 3 (the first and the last are not timed)")
    if args.child:
        if args.child == "bare":
            res = child_bare(args.epochs, args.loader_workers, args.prefetch)
        else:
            res = child_product(args.epochs, args.loader_workers, args.prefetch, args.storage)
        with open(args.out, "w") as fh:
            json.dump(res, fh)
        return 0

    import torch

    if not torch.cuda.is_available():
        print("bench_gpu_step: no CUDA GPU visible to torch; nothing measured", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, Any]]] = {"bare": [], "product": []}
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bgpu", dir="/tmp") as work:
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(q for q in [REPO, os.environ.get("PYTHONPATH", "")] if q)
        )
        for rep in range(args.repeats):
            for arm in ("bare", "product") if rep % 2 == 0 else ("product", "bare"):
                out = os.path.join(work, f"{arm}{rep}.json")
                cmd = [sys.executable, "-m", "benchmarks.bench_gpu_step", "--child", arm, "--out", out]
                cmd += ["--epochs", str(args.epochs), "--loader-workers", str(args.loader_workers)]
                cmd += ["--prefetch", str(args.prefetch), "--storage", os.path.join(work, f"runs{rep}")]
                t0 = time.perf_counter()
                try:
                    rc = subprocess.run(cmd, cwd=REPO, env=env, timeout=args.timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = 124
                if rc != 0 or not os.path.exists(out):
                    print(f"{arm} run {rep + 1}: failed (exit {rc})", file=sys.stderr, flush=True)
                    failed.append(f"{arm}{rep}")
                    continue
                with open(out) as fh:
                    res = json.load(fh)
                res["step_ms"] = _step_ms(res)
                runs[arm].append(res)
                print(
                    f"{arm} run {rep + 1}: {res['step_ms']:.1f} ms/step, epochs "
                    + " ".join(f"{s:.2f}s" for s in res["epoch_s"])
                    + f", loss {res['loss']:.4f}, process {time.perf_counter() - t0:.1f}s",
                    flush=True,
                )
    results: dict[str, Any] = {"runs": runs, "failed": failed, "target": TARGET, "min_step_ms": MIN_STEP_MS}
    ok = bool(runs["bare"] and runs["product"])
    if ok:
        bare = statistics.median(r["step_ms"] for r in runs["bare"])
        prod = statistics.median(r["step_ms"] for r in runs["product"])
        results.update(bare_step_ms=bare, product_step_ms=prod, ratio_product_over_bare=prod / bare)
        results["product_last_epoch_extra_s"] = statistics.median(
            r["epoch_s"][-1] - r["epoch_s"][-2] for r in runs["product"]
        )
        print(
            f"bf16 step, product/bare: {prod / bare:.3f}x (product {prod:.1f} ms, bare {bare:.1f} ms, "
            f"{args.loader_workers} loader processes, on {runs['bare'][0]['device']}, "
            f"torch {runs['bare'][0]['torch']}); target <= {TARGET}x"
            + ("" if bare >= MIN_STEP_MS else f"; the step is under {MIN_STEP_MS:.0f} ms: model too small")
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
