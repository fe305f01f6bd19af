"""The read-back's cost: what a commit pays to read its checkpoint back from storage (issue 42, item 4), and
what retention pays to know the checkpoint it keeps verifies, on a local folder.

    .venv/bin/python -m benchmarks.bench_readback --sizes 10,400,1800 --commits 3   # as in RESULTS.md
    .venv/bin/python -m benchmarks.bench_readback --sizes 10 --commits 2            # quick

For each state size it commits the same serialised state through ``CheckpointStore`` (as the background
writer does) and reports medians over ``--commits`` steady-state commits (``keep_last`` kept, one deleted
per commit, after ``keep_last`` commits of warm-up) of:

- the commit without its read-back (files written and fsynced, manifest published) and with it (then the
  manifest and every file read back and their sha256s checked);
- retention after it at ``--keep-last`` (3), in the writer's path, by the rule in force (the newest kept
  checkpoint is the one the commit read back: nothing more is read) and by the previous rule (every other
  kept checkpoint read back at every retention: timed here as those reads, then the same retention);
- retention called from a fresh process (a new ``CheckpointStore``: it reads back the newest, once);
- the bytes each rule reads per commit (commit and retention), in checkpoints, and how fast a read-back
  goes (the previous rule's extra reads: bytes over seconds, reading and sha256 together).

The page cache holds what was just written (as it does for the writer in a run); a cold read from the disk,
or an object store's download, costs more. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.bench_checkpoint import make_state
from cluster.run.checkpoint import CheckpointInfo, CheckpointStore, serialize
from cluster.run.storage import Storage


class NoReadBack(CheckpointStore):
    """The commit as it was before issue 42's item 4: published, not read back."""

    def _read_back(self, info: CheckpointInfo, body: bytes) -> None:
        return None


def files(blob: bytes, step: int) -> dict[str, bytes]:
    return {"model.pt": blob, "train_state.pt": serialize({"step": step})}


def bare_commits(folder: str, blob: bytes, commits: int, keep_last: int) -> float:
    """Median seconds of a commit without its read-back."""
    store = NoReadBack(Storage(folder))
    times = []
    for step in range(1, commits + keep_last + 1):
        t0 = time.perf_counter()
        info = store.commit(step, files(blob, step), {})
        times.append(time.perf_counter() - t0)
        store.retain(keep_last, read_back=info)  # (reads nothing: bounds the disk used)
    return statistics.median(times[keep_last:])


def old_rule_reads(store: CheckpointStore, keep_last: int, info: CheckpointInfo) -> None:
    """What the previous rule read at each retention besides the new rule: every kept checkpoint but the
    one its commit had just read back (all verify here, so the newest ``keep_last``)."""
    for other in store.list()[-keep_last:]:
        if other.step != info.step and store.verifies(other) is not None:
            raise AssertionError(f"step {other.step} does not verify")


def measure(folder: str, blob: bytes, commits: int, keep_last: int) -> dict[str, float]:
    """Medians over ``commits`` steady-state commits: seconds, and bytes read per commit."""
    store = CheckpointStore(Storage(folder))
    keys = ("commit", "new", "old_reads", "fresh", "new_bytes", "old_bytes")
    rows: dict[str, list[float]] = {k: [] for k in keys}
    for step in range(1, commits + keep_last + 1):
        read = store.storage
        b0, t0 = read.bytes_read, time.perf_counter()
        info = store.commit(step, files(blob, step), {})
        b1, t1 = read.bytes_read, time.perf_counter()
        if step <= keep_last:  # warm-up: keep_last checkpoints kept before anything is measured
            store.retain(keep_last, read_back=info)
            continue
        old_rule_reads(store, keep_last, info)
        b2, t2 = read.bytes_read, time.perf_counter()
        deleted = store.retain(keep_last, read_back=info)
        b3, t3 = read.bytes_read, time.perf_counter()
        assert deleted == [step - keep_last], deleted
        assert CheckpointStore(Storage(folder)).retain(keep_last) == []
        t4 = time.perf_counter()
        rows["commit"].append(t1 - t0)
        rows["old_reads"].append(t2 - t1)
        rows["new"].append(t3 - t2)
        rows["fresh"].append(t4 - t3)
        rows["new_bytes"].append((b1 - b0) + (b3 - b2))  # the commit's read-back, retention's manifests
        rows["old_bytes"].append((b1 - b0) + (b3 - b2) + (b2 - b1))  # ... and the older kept ones
    return {k: statistics.median(v) for k, v in rows.items()}


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_readback",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", default="10,100,400", help="state sizes in MiB, comma-separated (e.g. 1800)")
    p.add_argument("--commits", type=int, default=3, help="steady-state commits measured per size")
    p.add_argument("--keep-last", type=int, default=3, help="retention's keep_last (the default's 3)")
    p.add_argument("--dir", default=None, help="folder for the checkpoints (default: a temporary one)")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-readback-", dir=args.dir)
    out = []
    try:
        for mb in (int(s) for s in args.sizes.split(",")):
            state = make_state(mb)
            blob = serialize(state)
            del state
            gc.collect()
            bare = bare_commits(f"{tmp}/bare-{mb}", blob, args.commits, args.keep_last)
            shutil.rmtree(f"{tmp}/bare-{mb}", ignore_errors=True)
            got = measure(f"{tmp}/rb-{mb}", blob, args.commits, args.keep_last)
            shutil.rmtree(f"{tmp}/rb-{mb}", ignore_errors=True)
            out.append((mb, len(blob), bare, got))
            print(f"{mb} MiB: no read-back {bare:.3f} s; {got}", file=sys.stderr, flush=True)
            del blob
            gc.collect()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table(out, args.commits, args.keep_last)


def table(out: list[tuple[int, int, float, dict[str, float]]], commits: int, keep_last: int) -> None:
    host = f"{platform.node()}: {os.cpu_count()} CPUs, torch {torch.__version__}"
    print(f"\n{host}, {commits} steady-state commits each, keep_last={keep_last}, medians\n")
    print(
        "| state | commit: no read-back / with (s) | read-back MB/s | retention old rule / new rule (s) "
        "| commit + retention old / new (s) | retention, fresh process (s) | read per commit old / new |"
    )
    print("|---|---|---|---|---|---|---|")
    for mb, size, bare, got in out:
        extra = got["old_bytes"] - got["new_bytes"]  # what the old rule read more, in old_reads seconds
        mbps = extra / 1e6 / got["old_reads"] if got["old_reads"] > 0 else float("nan")
        old = got["old_reads"] + got["new"]
        print(
            f"| {mb} MiB | {bare:.3f} / {got['commit']:.3f} | {mbps:,.0f} | {old:.3f} / {got['new']:.3f} "
            f"| {got['commit'] + old:.3f} / {got['commit'] + got['new']:.3f} | {got['fresh']:.3f} "
            f"| {got['old_bytes'] / size:.2f}x / {got['new_bytes'] / size:.2f}x |"
        )


if __name__ == "__main__":
    main()
