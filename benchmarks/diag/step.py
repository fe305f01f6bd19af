"""Where does the product's per-step time go? The product's own ``cluster.rank.worker.Worker`` without Ray.

    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.diag.step [--epochs 2] [--repeats 2]

Runs the same 2-worker CPU workload as ``bench_ddp`` (no Ray anywhere) three ways, interleaved:

  bare            the hand-written loop of the bare-DDP arm (benchmarks/_loop.py), main thread
  worker-main     the product's Worker (setup, run_epoch per epoch, finish), called from the main thread
  worker-thread   the same, but run_epoch called from a second thread, as the product's Ray actor calls it
                  (its methods run on a thread pool, so heartbeats are answered mid-epoch)

and prints the median interval between rank 0's optimizer steps. If worker-main is close to bare, the
product's worker code is not the cost and the difference seen in bench_ddp comes from where it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch.multiprocessing as mp

from benchmarks.bench_ddp import REPO, TASK_ARGS, _read_steplog


def _worker_entry(rank: int, world: int, work: str, epochs: int, threaded: bool) -> None:
    from cluster import load_config
    from cluster.rank.process import worker_env
    from cluster.rank.worker import Worker

    cfg = load_config(
        os.path.join(REPO, "jobs/configs/tiny_cpu.yaml"),
        [
            "name=diag",
            f"storage={work}/runs",
            f"training.epochs={epochs}",
            "training.log_every_steps=1",
            "checkpoint.every_steps=25",
            "checkpoint.every_epochs=1",
        ],
        data={"task": "jobs.tasks.charlm:CharLMTask", "task_args": TASK_ARGS},
    )
    os.environ["OMP_NUM_THREADS"] = "1"
    with worker_env(cfg):
        w = Worker(cfg, rank, world, os.path.join(work, "runs", "diag"), 0)
    port_file = os.path.join(work, "port")
    if rank == 0:
        port = w.bind_store()
        with open(port_file + ".tmp", "w") as fh:
            fh.write(str(port))
        os.replace(port_file + ".tmp", port_file)
    else:
        while not os.path.exists(port_file):
            time.sleep(0.01)
        with open(port_file) as fh:
            port = int(fh.read())
    w.setup("127.0.0.1", port)
    rows: list[dict[str, Any]] = []

    def run() -> None:
        for e in range(epochs):
            rows.extend(w.run_epoch(e, 0).step_rows)

    if threaded:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    else:
        run()
    w.finish()
    w.shutdown()
    if rank == 0:
        with open(os.path.join(work, "rows.json"), "w") as fh:
            json.dump([(r["global_step"], r["time"]) for r in rows], fh)


def _median_interval(pairs: list[tuple[int, float]], spe: int) -> float:
    times = dict(pairs)
    iv = [t - times[s - 1] for s, t in times.items() if s - 1 in times and (s - 1) % spe]
    return statistics.median(iv)


def run_one(mode: str, epochs: int) -> float:
    from benchmarks._loop import bare_worker
    from benchmarks.bench_ddp import _steps_per_epoch

    spe = _steps_per_epoch(TASK_ARGS, 64)
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="hbdiag", dir="/tmp") as work:
        if mode == "bare":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            spec: dict[str, Any] = {
                "task": "jobs.tasks.charlm:CharLMTask",
                "task_args": TASK_ARGS,
                "seed": 0,
                "global_batch": 64,
                "epochs": epochs,
                "ckpt_every_steps": 25,
                "ckpt_dir": work,
                "steplog": f"{work}/steps.log",
            }
            mp.start_processes(bare_worker, args=(2, port, spec), nprocs=2, start_method="spawn")
            _, steps = _read_steplog(spec["steplog"])
            return _median_interval([(s, t) for _, t, s in steps], spe)
        mp.start_processes(
            _worker_entry, args=(2, work, epochs, mode == "worker-thread"), nprocs=2, start_method="spawn"
        )
        with open(os.path.join(work, "rows.json")) as fh:
            return _median_interval([tuple(p) for p in json.load(fh)], spe)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.diag.step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    res: dict[str, list[float]] = {m: [] for m in ("bare", "worker-main", "worker-thread")}
    for _ in range(args.repeats):
        for mode in res:
            res[mode].append(run_one(mode, args.epochs))
            print(f"{mode:14} step {1000 * res[mode][-1]:.1f} ms", flush=True)
    base = statistics.median(res["bare"])
    print("\nmedian step interval (rank 0):")
    for mode, v in res.items():
        m = statistics.median(v)
        print(f"  {mode:14} {1000 * m:7.1f} ms  {m / base:5.2f}x bare")
    return 0


if __name__ == "__main__":
    sys.exit(main())
