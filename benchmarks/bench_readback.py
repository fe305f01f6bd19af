"""The read-back's cost: what a commit pays to read its checkpoint back from storage (issue 42, item 4), and
what retention pays to read back the checkpoints it keeps, on a local folder.

    .venv/bin/python -m benchmarks.bench_readback                          # 10, 100, 400 MiB
    .venv/bin/python -m benchmarks.bench_readback --sizes 10 --commits 3   # quick

For each state size it commits the same serialised state ``--commits`` times through ``CheckpointStore``
(as the background writer does) and reports medians of: the commit (files written and fsynced, manifest
published, checkpoint read back), the read-back alone (``read_verified`` of the just-committed checkpoint:
every file read and its sha256 checked, what the commit's read-back does besides reading the manifest), and
retention after it at ``keep_last`` 1 and 3 (the writer's path: the just-committed one counted from its
read-back, every other kept one read back now). The page cache holds what was just written (as it does
for the writer in a run); a cold read from the disk costs more. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.bench_checkpoint import make_state
from cluster.checkpoint import CheckpointStore, serialize
from cluster.storage import Storage


def measure(folder: str, blob: bytes, commits: int, keep_last: int) -> dict[str, float]:
    """Median seconds of a commit, its read-back alone and retention after it, over ``commits`` commits."""
    store = CheckpointStore(Storage(folder))
    rows: dict[str, list[float]] = {"commit": [], "readback": [], "retain": []}
    for step in range(1, commits + keep_last + 1):
        t0 = time.perf_counter()
        info = store.commit(step, {"model.pt": blob, "train_state.pt": serialize({"step": step})}, {})
        t1 = time.perf_counter()
        store.read_verified(info)
        t2 = time.perf_counter()
        store.retain(keep_last, read_back=info)
        t3 = time.perf_counter()
        if step > keep_last:  # the steady state: keep_last kept, one deleted per commit
            rows["commit"].append(t1 - t0)
            rows["readback"].append(t2 - t1)
            rows["retain"].append(t3 - t2)
    return {k: statistics.median(v) for k, v in rows.items()}


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_readback",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", default="10,100,400", help="state sizes in MiB, comma-separated")
    p.add_argument("--commits", type=int, default=4, help="steady-state commits measured per size")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-readback-")
    out = []
    try:
        for mb in (int(s) for s in args.sizes.split(",")):
            blob = serialize(make_state(mb))
            one = measure(f"{tmp}/k1-{mb}", blob, args.commits, keep_last=1)
            three = measure(f"{tmp}/k3-{mb}", blob, args.commits, keep_last=3)
            shutil.rmtree(f"{tmp}/k1-{mb}", ignore_errors=True)
            shutil.rmtree(f"{tmp}/k3-{mb}", ignore_errors=True)
            out.append((mb, one, three))
            print(f"{mb} MiB: keep_last=1 {one}; keep_last=3 {three}", file=sys.stderr, flush=True)
            del blob
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    host = f"{platform.node()}: {os.cpu_count()} CPUs, torch {torch.__version__}"
    print(f"\n{host}, {args.commits} commits each\n")
    print("| state | commit (s) | of it read-back (s) | read-back MB/s | retain keep_last=1 / 3 (s) |")
    print("|---|---|---|---|---|")
    for mb, one, three in out:
        mbps = mb * 1.048576 / one["readback"] if one["readback"] else float("nan")
        share = one["readback"] / one["commit"]
        print(
            f"| {mb} MiB | {one['commit']:.3f} | {one['readback']:.3f} ({share:.0%}) | {mbps:,.0f} "
            f"| {one['retain']:.3f} / {three['retain']:.3f} |"
        )


if __name__ == "__main__":
    main()
