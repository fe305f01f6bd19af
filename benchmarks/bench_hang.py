"""A hang, before and after hangs were recovered from peers: one of 4 ranks SIGSTOPped 0.1 s after the
step-10 checkpoint commits (the test job of ``tests/support/faults.py``: 30 steps, checkpoints every 5).
Prints, per arm, the seconds from the SIGSTOP to the ``failure`` event (detection, the stacks included),
the steps lost, the seconds from detection to the first step after, and how many ranks kept their process.

    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.bench_hang

Arms: ``after`` (the defaults, but a 5-step warm-up: the job is 30 steps long) and ``before`` (the old
behaviour: a 60 s timeout, every rank a fresh process from the checkpoint: ``failures.hang_timeout_min_s=60``
and ``failures.warm_restart=false``). Starts its own local Ray (4 CPUs, a temporary folder) and stops it.
"""

from __future__ import annotations

import io
import json
import os
import signal
import tempfile
import threading
import time

import ray

from cluster import load_config, train
from tests.support.faults import events, overrides

ARMS = {
    "after": ["failures.hang_warmup_steps=5"],
    "before": ["failures.hang_timeout_min_s=60", "failures.warm_restart=false"],
}


def stop_rank(run_url: str, rank: int, info: dict[str, float]) -> None:
    """SIGSTOP ``rank`` 0.1 s after checkpoint 10 commits; its pid and the time go into ``info``."""
    while True:
        try:
            started = events(run_url, "group_started")
        except (FileNotFoundError, json.JSONDecodeError):
            started = []
        if started and os.path.exists(f"{run_url}/checkpoints/step_{10:09d}/manifest.json"):
            time.sleep(0.1)
            pid = started[0]["pids"][rank]
            os.kill(pid, signal.SIGSTOP)
            info["pid"] = pid
            info["t"] = time.time()
            return
        time.sleep(0.02)


def arm(name: str, extra: list[str]) -> dict[str, object]:
    root = tempfile.mkdtemp(prefix="bench-hang-")
    run_url, info = f"{root}/{name}", dict[str, float]()
    threading.Thread(target=stop_rank, args=(run_url, 2, info), daemon=True).start()
    cfg = load_config("jobs/configs/tiny_cpu.yaml", overrides(root, name, "scaling.num_workers=4", *extra))
    result = train(cfg, out=io.StringIO())
    try:
        os.kill(int(info["pid"]), signal.SIGKILL)  # never leave it stopped
    except ProcessLookupError:
        pass
    failure, recovered = events(run_url, "failure")[0], events(run_url, "recovered")[0]
    first, second = events(run_url, "group_started")[:2]
    return {
        "arm": name,
        "status": result.status,
        "detect_s": round(failure["time"] - info["t"], 1),
        "suspect": failure.get("suspect"),
        "source": recovered["source"],
        "lost_steps": recovered["lost_steps"],
        "detect_to_first_step_s": recovered["detect_to_first_step_s"],
        "pids_kept": sum(a == b for a, b in zip(first["pids"], second["pids"])),
    }


def main() -> None:
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ray-"))
    try:
        for name, extra in ARMS.items():
            print(json.dumps(arm(name, extra)), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
