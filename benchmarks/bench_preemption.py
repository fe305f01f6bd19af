"""A spot preemption, side by side: steps lost and seconds of training stalled.

    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.bench_preemption [--json out.json]

Each arm runs in a fresh Python process with its own multi-node Ray (``ray.cluster_utils.Cluster``: a head
with 1 CPU for controllers, three nodes of 1 CPU and one ``trainer`` slot each). Two ranks train; when rank 0
has done ``--drain-at`` steps, the node of rank 1 gets a drain notice (reason PREEMPTION, ``--notice`` s
deadline, through the GCS drain API, as the autoscaler and ``ray drain-node`` do) and is removed at the
deadline (Ray does not kill a drained node itself; the provider does). The third node is free.

Workload (same in every arm): a 2-layer MLP on random data, global batch 32, SGD, plus a ``--step-sleep``
sleep per step standing for a GPU step (so that the figures are orchestration, not this 2-core machine's
CPU), ``--steps`` steps, a checkpoint every ``--ckpt-every`` steps.

  product          cluster.train, failures.preemption on (the default): ranks move off the node
  product_ignore   cluster.train with failures.preemption=false: the node's loss is a failure (recovered
                   from the surviving rank's memory)
  raytrain_jit     Ray Train V2 TorchTrainer, the loop Ray documents: each step calls
                   ray.train.get_preemption_info() (a barrier across workers) and, on the first notice,
                   reports a just-in-time checkpoint and keeps training; Ray Train restarts the group
                   from the latest checkpoint at the deadline
  raytrain_ignore  the same loop without the preemption check (periodic checkpoints only)

Measured from rank 0's own per-step timestamps (the product's metric rows with log_every_steps=1; a step
log in the Ray Train loop): ``lost_steps`` (steps trained twice: done before the restart and redone
after), ``stall_s`` (the longest gap between two steps, less the median step: training time the
preemption cost), ``total_s`` (the arm's training call).
"""

from __future__ import annotations

import argparse
import glob
import io
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("product", "product_ignore", "raytrain_jit", "raytrain_ignore")
BATCH = 32


# ====================================================================== child: one arm on its own Ray
def start_cluster(tmp: str) -> Any:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "temp_dir": tempfile.mkdtemp(prefix="bp", dir="/tmp"),
            "_system_config": {
                "health_check_period_ms": 1000,
                "health_check_timeout_ms": 1000,
                "health_check_failure_threshold": 3,
            },
        },
    )
    for _ in range(3):
        cluster.add_node(num_cpus=1, resources={"trainer": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": REPO}}, log_to_driver=False)
    return cluster


def drain_then_kill(cluster: Any, node_id: str, notice_s: float) -> float:
    """Drain ``node_id`` (PREEMPTION, deadline in ``notice_s``) and remove it at the deadline; returns the
    deadline (seconds since the epoch)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    deadline = time.time() + notice_s
    gcs = ray._raylet.GcsClient(address=cluster.address)  # type: ignore[attr-defined]
    ok, why = gcs.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),  # type: ignore[attr-defined]
        "benchmark",
        int(deadline * 1000),
    )
    if not ok:
        raise RuntimeError(f"drain refused: {why}")

    def kill() -> None:
        time.sleep(max(0.0, deadline - time.time()))
        (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
        cluster.remove_node(node, allow_graceful=False)

    threading.Thread(target=kill, daemon=True).start()
    return deadline


def watch_and_drain(
    cluster: Any, spec: dict[str, Any], progress: Any, rank1_node: Any, done: threading.Event
) -> dict[str, Any]:
    """In the background: once rank 0 did ``drain_at`` steps, drain rank 1's node."""
    out: dict[str, Any] = {}

    def go() -> None:
        while not done.is_set():
            try:
                if progress() >= spec["drain_at"]:
                    node = rank1_node()
                    out["drained_at"] = time.time()
                    out["deadline"] = drain_then_kill(cluster, node, spec["notice_s"])
                    return
            except (FileNotFoundError, IndexError, ValueError):
                pass
            time.sleep(0.05)

    threading.Thread(target=go, daemon=True).start()
    return out


def child_product(spec: dict[str, Any], work: str, ignore: bool) -> dict[str, Any]:
    import ray

    from cluster import load_config, train
    from cluster.inspect import read_events
    from cluster.run.logs import read_metrics
    from cluster.run.storage import Storage

    cluster = start_cluster(work)
    steps_per_epoch = spec["steps"] // spec["epochs"]
    audit = f"{work}/audit"
    os.makedirs(audit)
    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        [
            f"storage={work}/runs",
            "name=spot",
            "task=tests.support.tasks:AuditTask",
            f"task_args={{audit_dir: {audit}, samples: {steps_per_epoch * BATCH}, "
            f"step_sleep_s: {spec['step_sleep']}}}",
            "scaling.num_workers=2",
            "scaling.cpus_per_worker=1",
            "scaling.resources_per_worker={trainer: 1}",
            f"training.global_batch_size={BATCH}",
            f"training.epochs={spec['epochs']}",
            "training.log_every_steps=1",
            f"checkpoint.every_steps={spec['ckpt_every']}",
            "failures.hang_timeout_floor_s=60",
            f"failures.preemption={'false' if ignore else 'true'}",
        ],
    )
    run = f"{work}/runs/spot"

    def progress() -> int:
        (path,) = glob.glob(f"{audit}/rank0-*.jsonl")[:1]
        with open(path) as fh:
            return sum(1 for _ in fh)

    def rank1_node() -> str:
        return str([e for e in read_events(Storage(run)) if e["event"] == "group_started"][-1]["nodes"][1])

    done = threading.Event()
    drained = watch_and_drain(cluster, spec, progress, rank1_node, done)
    t0 = time.time()
    result = train(cfg, out=io.StringIO())
    total = time.time() - t0
    done.set()
    rows = [r for r in read_metrics(Storage(run)).to_pylist() if r["kind"] == "step"]
    steps = [(float(r["time"]), int(r["global_step"])) for r in rows]
    events = read_events(Storage(run))
    extra = {
        "status": result.status,
        "events": [
            {k: v for k, v in e.items() if k not in ("config",)}
            for e in events
            if e["event"]
            in (
                "preemption_notice",
                "preemption_move",
                "preemption_checkpoint",
                "failure",
                "recovered",
                "resize",
            )
        ],
    }
    ray.shutdown()
    cluster.shutdown()
    return {**measure(steps, total, drained), **extra}


def raytrain_loop(config: dict[str, Any]) -> None:
    """``train_loop_per_worker``: the loop a Ray Train user writes, with Ray's recommended reaction to a
    preemption notice (``jit``): a just-in-time checkpoint, then keep training."""
    import shutil

    import ray
    import ray.train
    import ray.train.torch
    import torch
    from torch import nn

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    with open(f"{config['work']}/node-rank{rank}", "w") as fh:
        fh.write(ray.get_runtime_context().get_node_id())
    torch.manual_seed(0)
    torch.set_num_threads(1)
    raw = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model = ray.train.torch.prepare_model(raw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        raw.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])

    def save() -> None:
        if rank != 0:
            ray.train.report({"step": step})
            return
        d = tempfile.mkdtemp()
        try:
            torch.save({"model": raw.state_dict(), "opt": opt.state_dict(), "step": step}, f"{d}/state.pt")
            ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d))
        finally:
            shutil.rmtree(d, ignore_errors=True)

    log = open(config["steplog"], "a", buffering=1) if rank == 0 else None
    saved_on_notice = False
    per_rank = BATCH // world
    while step < config["steps"]:
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(per_rank, 8, generator=g)
        y = (x[:, 0] > 0).long()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        time.sleep(config["step_sleep"])
        step += 1
        if log:
            log.write(f"{time.time():.6f} {step}\n")
        if step % config["ckpt_every"] == 0:
            save()
        if config["jit"] and not saved_on_notice and ray.train.get_preemption_info() is not None:
            save()  # Ray's documented reaction: a just-in-time checkpoint, then keep training
            saved_on_notice = True
    if log:
        log.close()


def child_raytrain(spec: dict[str, Any], work: str, jit: bool) -> dict[str, Any]:
    import ray
    import ray.train
    import ray.train.torch

    cluster = start_cluster(work)
    steplog = f"{work}/steps.log"
    config = {**spec, "work": work, "steplog": steplog, "jit": jit}

    def progress() -> int:
        with open(steplog) as fh:
            return sum(1 for _ in fh)

    def rank1_node() -> str:
        with open(f"{work}/node-rank1") as fh:
            return fh.read().strip()

    done = threading.Event()
    drained = watch_and_drain(cluster, spec, progress, rank1_node, done)
    trainer = ray.train.torch.TorchTrainer(
        raytrain_loop,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(
            num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1, "trainer": 1}
        ),
        run_config=ray.train.RunConfig(
            name="spot",
            storage_path=f"{work}/ray_results",
            failure_config=ray.train.FailureConfig(max_failures=3),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=3),
        ),
    )
    t0 = time.time()
    result = trainer.fit()
    total = time.time() - t0
    done.set()
    with open(steplog) as fh:
        steps = [(float(a), int(b)) for a, b in (line.split() for line in fh if line.strip())]
    ray.shutdown()
    cluster.shutdown()
    return {**measure(steps, total, drained), "status": "error" if result.error else "finished"}


def measure(steps: list[tuple[float, int]], total: float, drained: dict[str, Any]) -> dict[str, Any]:
    """From rank 0's (time, global step) records: steps done twice, the longest stall, and when."""
    steps.sort()
    unique = {s for _, s in steps}
    times = [t for t, _ in steps]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    median = statistics.median(gaps) if gaps else 0.0
    worst = max(range(len(gaps)), key=lambda i: gaps[i]) if gaps else None
    return {
        "total_s": round(total, 2),
        "steps_recorded": len(steps),
        "steps_unique": len(unique),
        "lost_steps": len(steps) - len(unique),
        "median_step_s": round(median, 4),
        "stall_s": round(gaps[worst] - median, 2) if worst is not None else None,
        "stall_starts_after_notice_s": (
            round(times[worst] - drained["drained_at"], 2)
            if worst is not None and "drained_at" in drained
            else None
        ),
        "notice_s": round(drained["deadline"] - drained["drained_at"], 1) if "deadline" in drained else None,
        "drained": "drained_at" in drained,
    }


def child_main(arm: str, spec_path: str, out_path: str) -> int:
    with open(spec_path) as fh:
        spec = json.load(fh)
    work = tempfile.mkdtemp(prefix=f"bp-{arm}-")
    if arm.startswith("product"):
        out = child_product(spec, work, ignore=arm == "product_ignore")
    else:
        out = child_raytrain(spec, work, jit=arm == "raytrain_jit")
    with open(out_path, "w") as fh:
        json.dump(out, fh)
    return 0


# ====================================================================== parent
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--ckpt-every", type=int, default=40)
    p.add_argument("--drain-at", type=int, default=50)
    p.add_argument("--notice", type=float, default=20.0)
    p.add_argument("--json", default=None)
    p.add_argument("--child", nargs=3, metavar=("ARM", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(*args.child)
    spec = {
        "steps": args.steps,
        "epochs": args.epochs,
        "step_sleep": args.step_sleep,
        "ckpt_every": args.ckpt_every,
        "drain_at": args.drain_at,
        "notice_s": args.notice,
    }
    results: dict[str, Any] = {"spec": spec, "arms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as fh:
            json.dump(spec, fh)
        for arm in args.arms.split(","):
            out_path = os.path.join(tmp, f"{arm}.json")
            env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TRAIN_V2_ENABLED": "1", "PYTHONPATH": REPO}
            t0 = time.time()
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_preemption", "--child", arm, spec_path, out_path],
                cwd=REPO,
                env=env,
                capture_output=True,
                timeout=600,
            )
            if proc.returncode != 0 or not os.path.exists(out_path):
                tail = proc.stderr.decode(errors="replace")[-3000:]
                results["arms"][arm] = {"error": f"rc {proc.returncode}: {tail}"}
                print(f"{arm}: FAILED (rc {proc.returncode})\n{tail}", file=sys.stderr)
                continue
            with open(out_path) as fh:
                results["arms"][arm] = json.load(fh)
            results["arms"][arm]["wall_s"] = round(time.time() - t0, 1)
            print(f"{arm}: {json.dumps({k: v for k, v in results['arms'][arm].items() if k != 'events'})}")
    print()
    print(f"{'arm':<16} {'lost_steps':>10} {'stall_s':>8} {'total_s':>8} {'median_step_s':>13}")
    for arm, r in results["arms"].items():
        if "error" in r:
            print(f"{arm:<16} FAILED")
            continue
        print(f"{arm:<16} {r['lost_steps']:>10} {r['stall_s']:>8} {r['total_s']:>8} {r['median_step_s']:>13}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
