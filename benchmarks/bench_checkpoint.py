"""Checkpoint stall and upload throughput: asynchronous (host copy, then a background write) vs synchronous.

    .venv/bin/python -m benchmarks.bench_checkpoint                          # 10 MB, 100 MB, 1 GB; local + S3
    .venv/bin/python -m benchmarks.bench_checkpoint --sizes 10,100 --targets local --saves 2   # quick

For each state size and each storage (a local folder; S3 = a moto_server on loopback, started here and
stopped at the end) it saves the same state ``--saves`` times through ``CheckpointWriter`` and reports:
the stall training sees per checkpoint (async: the host snapshot; sync: snapshot + serialise + checksum +
upload + commit), the ratio async/sync, and the upload throughput of the background write. The first
async save also allocates the reused host buffers; the steady state is the median of the later ones.
Prints a Markdown table (paste it into benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile

import torch

from cluster.run.checkpoint import CheckpointStore, CheckpointWriter
from cluster.run.storage import Storage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_state(mb: int) -> dict[str, torch.Tensor]:
    """A model-like state: ~16 MB tensors (plus one remainder) of float32, ``mb`` MiB in all."""
    total = mb * (1 << 20) // 4
    chunk = 4 << 20
    state, i = {}, 0
    while total > 0:
        n = min(chunk, total)
        state[f"layer{i}.weight"] = torch.randn(n)
        total -= n
        i += 1
    return state


def run(
    storage: Storage, state: dict[str, torch.Tensor], async_save: bool, saves: int
) -> tuple[list[float], list[float]]:
    store = CheckpointStore(storage)
    writer = CheckpointWriter(store, keep_last=1, async_save=async_save)
    stalls, writes = [], []
    for i in range(saves):
        stalls.append(writer.save(i + 1, 0, {}, {"model.pt": state, "train_state.pt": {"step": i + 1}}))
        writer.wait()  # let the write finish before the next save: measures the stall alone, not queueing
        rec = writer.drain()[-1]
        if rec.error:
            raise RuntimeError(rec.error)
        writes.append(rec.write_s)
    writer.close()
    return stalls, writes


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", default="10,100,1024", help="state sizes in MiB, comma-separated")
    p.add_argument("--targets", default="local,s3", help="local and/or s3 (moto_server on loopback)")
    p.add_argument("--saves", type=int, default=3)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    targets = args.targets.split(",")
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    moto = None
    tmp = tempfile.mkdtemp(prefix="bench-ckpt-")
    rows = []
    try:
        if "s3" in targets:
            sys.path.insert(0, REPO)
            from tests.support.storage import MotoS3, free_port

            moto = MotoS3(free_port(), log_path=f"{tmp}/moto.log")
            moto.start()
        for mb in sizes:
            state = make_state(mb)
            for target in targets:
                for mode in ("async", "sync"):
                    if target == "local":
                        st = Storage(f"{tmp}/{target}-{mode}-{mb}")
                    else:
                        assert moto is not None
                        st = Storage(moto.url(f"{mode}-{mb}"), moto.options)
                    stalls, writes = run(st, state, mode == "async", args.saves)
                    steady = statistics.median(stalls[1:]) if len(stalls) > 1 else stalls[0]
                    rows.append((mb, target, mode, stalls[0], steady, statistics.median(writes)))
                    print(
                        f"{mb} MiB {target} {mode}: stall first {stalls[0]:.4f}s, steady {steady:.4f}s, "
                        f"write {statistics.median(writes):.3f}s",
                        file=sys.stderr,
                        flush=True,
                    )
                    if target == "local":
                        shutil.rmtree(f"{tmp}/{target}-{mode}-{mb}", ignore_errors=True)
            del state
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{platform.node()}: {os.cpu_count()} CPUs, torch {torch.__version__}, {args.saves} saves each\n")
    print("| state | storage | async stall first / steady (s) | sync stall (s) | async/sync | upload MB/s |")
    print("|---|---|---|---|---|---|")
    for mb in sizes:
        for target in targets:
            a = next(r for r in rows if r[:3] == (mb, target, "async"))
            s = next(r for r in rows if r[:3] == (mb, target, "sync"))
            ratio = a[4] / s[4] if s[4] else float("nan")
            mbps = mb * 1.048576 / a[5] if a[5] else float("nan")
            print(
                f"| {mb} MiB | {target} | {a[3]:.4f} / {a[4]:.4f} | {s[4]:.3f} | {ratio:.1%} | {mbps:,.0f} |"
            )


if __name__ == "__main__":
    main()
