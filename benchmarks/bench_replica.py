"""The replica guard's cost against a training step: what ``failures.replica_check_steps`` must be for the
check to take at most 0.5% of the step time; and the same for the rollback copies in memory
(``failures.nan_snapshot_steps``, ``cluster.rank.rollback_points``).

    .venv/bin/python -m benchmarks.bench_replica                    # CPU: 2 gloo ranks, tiny_cpu's char-LM
    .venv/bin/python -m benchmarks.bench_replica --steps 10 --checks 10   # smoke
    python -m benchmarks.bench_replica --device cuda                # one GPU: bench_gpu_step's 150M model

Each rank builds the task's model (``jobs/configs/tiny_cpu.yaml``'s task_args on CPU, one thread per rank as
``cpus_per_worker: 1`` gives; ``bench_gpu_step``'s model in bf16 autocast on a GPU, a group of one), wraps it
in DDP and trains ``--steps`` steps of its global batch (64), timed one by one (the GPU synchronized after
each). Then it runs ``--checks`` replica checks exactly as a worker does at a check step
(``ReplicaGuard``: the digest on the device, the all_gather, the compare), each timed alone. Reported:
median step and check, the check's share at the default interval, and the smallest interval at which it is
at most 0.5%. Then as many copies of the train state to host memory, as a worker takes them at a copy step
(``MemorySnapshots.after_step``, the buffers reused from two copies before), reported the same way. Rounds
alternate training, checks and copies (``--rounds``), so a change of the VM's speed hits all.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP

from cluster.rank.replica import ReplicaGuard
from cluster.rank.rollback_points import MemorySnapshots
from cluster.rank.train_state import RunPosition
from cluster.spec.config import FailureConfig
from cluster.spec.load import load_config
from cluster.spec.task import build_task

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET = 0.005


def task_args(device: str) -> dict[str, Any]:
    if device == "cuda":
        from benchmarks.bench_gpu_step import TASK_ARGS

        return dict(TASK_ARGS)
    with open(os.path.join(REPO, "jobs/configs/tiny_cpu.yaml")) as f:
        return dict(yaml.safe_load(f)["task_args"])


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world)
    task = build_task("jobs.tasks.charlm:CharLMTask", task_args(args.device))
    data = task.build_train_dataset()
    torch.manual_seed(0)
    raw = task.build_model().to(dev)
    model = DDP(raw, device_ids=[0] if cuda else None)
    opt = task.build_optimizer(raw)
    per_rank = 64 // world
    g = torch.Generator().manual_seed(rank)
    guard = ReplicaGuard(1)
    guard.begin(raw, world, 0)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step() -> float:
        x, y = data.get_batch(torch.randint(0, len(data), (per_rank,), generator=g))
        t0 = time.perf_counter()
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss, _ = task.compute_loss(model, (x, y))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    def check(k: int) -> float:
        sync()
        t0 = time.perf_counter()
        guard.verify(k)  # digest, all_gather, compare: what a check step adds
        return time.perf_counter() - t0

    cfg = load_config(
        os.path.join(REPO, "jobs/configs/tiny_cpu.yaml"),
        ["failures.nan_skip_steps=2", "failures.nan_snapshot_steps=1"],
    )
    memory = MemorySnapshots(cfg)
    session = SimpleNamespace(
        raw_model=raw, optimizer=opt, scheduler=None, sampler=SimpleNamespace(steps_per_epoch=10**9)
    )
    pos = RunPosition.start(cfg)

    def copy(k: int) -> float:
        sync()
        pos.global_step = pos.step_in_epoch = k
        t0 = time.perf_counter()
        memory.after_step(session, pos, world)  # capture, device-to-host copy into reused buffers
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up: allocator, DDP's first buckets, the digest's weights, the copies' buffers
        step()
    check(10**9)
    copy(1)
    copy(2)
    steps: list[float] = []
    checks: list[float] = []
    copies: list[float] = []
    k = 0
    for _ in range(args.rounds):
        steps += [step() for _ in range(args.steps // args.rounds)]
        for _ in range(args.checks // args.rounds):
            k += 1
            checks.append(check(k))
            copies.append(copy(k + 2))
    params = sum(p.numel() for p in raw.parameters())
    out.put(
        {
            "rank": rank,
            "steps": steps,
            "checks": checks,
            "copies": copies,
            "params": params,
            "tensors": len(list(raw.parameters())),
        }
    )
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--checks", type=int, default=200)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", help="write the figures there too")
    args = p.parse_args(argv)
    args.rounds = max(1, min(args.rounds, args.steps, args.checks))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    world = 1 if args.device == "cuda" else 2
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, q)) for r in range(world)]
    for proc in procs:
        proc.start()
    got = [q.get(timeout=1800) for _ in procs]
    for proc in procs:
        proc.join()
    step_ms = statistics.median(s for g in got for s in g["steps"]) * 1e3
    check_ms = max(statistics.median(g["checks"]) for g in got) * 1e3  # the slowest rank's
    default = FailureConfig().replica_check_steps
    copy_ms = max(statistics.median(g["copies"]) for g in got) * 1e3
    every = FailureConfig().nan_snapshot_steps
    result = {
        "device": args.device,
        "ranks": world,
        "params": got[0]["params"],
        "tensors": got[0]["tensors"],
        "step_ms": round(step_ms, 3),
        "check_ms": round(check_ms, 3),
        "check_share_every_step": round(check_ms / step_ms, 5),
        "default_interval": default,
        "share_at_default": round(check_ms / (default * step_ms), 6),
        "min_interval_for_0.5%": math.ceil(check_ms / (BUDGET * step_ms)),
        "snapshot_ms": round(copy_ms, 3),
        "snapshot_default_interval": every,
        "snapshot_share_at_default": round(copy_ms / (every * step_ms), 6),
        "snapshot_min_interval_for_0.5%": math.ceil(copy_ms / (BUDGET * step_ms)),
        "steps": args.steps,
        "checks": args.checks,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
