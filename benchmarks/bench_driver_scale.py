"""The driver's own CPU at N ranks, through the scripted worker group of the driver tests (no processes):
per heartbeat round, per epoch end, and for a whole 4-epoch job with a 50-rank failure storm, a shrink and
a grow back. Prints a table; figures in RESULTS.md ("Driver at scale").

    .venv/bin/python -m benchmarks.bench_driver_scale [--ranks 10 100 1000 10000]
"""

from __future__ import annotations

import argparse
import importlib
import time

from cluster.core.errors import Failure
from cluster.seam.protocol import EpochResult

# The scripted group at scale, shared with the driver's scale test (imported by name: the tests are not typed)
_scale = importlib.import_module("tests.support.scale")
BigGroup, big_driver, cpu_per_round = _scale.BigGroup, _scale.big_driver, _scale.cpu_per_round


def cpu_per_epoch_end(n: int, rounds: int = 20) -> float:
    """Driver CPU of one epoch end (metrics Parquet, events, progress line, the next dispatch)."""
    driver = big_driver({}, n)
    driver._prepare_storage()
    driver._transition(driver._initial_state())
    driver._transition(driver._step(driver.state))  # Starting -> Running (group started, epoch 0 dispatched)
    group = driver.group
    assert isinstance(group, BigGroup)
    results = [EpochResult(r, 0, 4, 4, 32, 1.0, 0.01, 1.0) for r in range(n)]
    t0 = time.process_time()
    for _ in range(rounds):
        driver._record_epoch(results[0], 1.0, None)
    return (time.process_time() - t0) / rounds


def cpu_whole_job(n: int) -> float:
    storm = Failure("worker_died", 1, "worker_died:ranks 1-50 died with their node")
    busy = ["busy"] * 25
    driver = big_driver({0: [*busy, "ok", *busy, storm], 1: [*busy, "grow", "ok"]}, n)
    t0 = time.process_time()
    result = driver.run()
    assert result.status == "finished" and result.world_size == n
    return time.process_time() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="+", default=[100, 1000, 10000])
    args = p.parse_args()
    print("| ranks | heartbeat round | per rank | epoch end | whole job (4 epochs, storm, shrink, grow) |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.ranks:
        cpu_per_round(n, 10)  # warm up
        beat = min(cpu_per_round(n, max(5, 20000 // n)) for _ in range(3))
        epoch = min(cpu_per_epoch_end(n, 5) for _ in range(3))
        job = cpu_whole_job(n)
        print(
            f"| {n} | {beat * 1e6:,.0f} us | {beat / n * 1e6:.2f} us | {epoch * 1e3:.1f} ms | {job:.2f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
