"""Evaluation: the product's distributed evaluation against the loop users write by hand, side by side.

    .venv/bin/python -m benchmarks.bench_eval [--ranks 2] [--repeats 7] [--eval-chars N] [--json out.json]

Workload: the char-LM of ``jobs/configs/tiny_cpu.yaml`` (context 64, d_model 64, 2 layers) and its held-out
text (``task_args.eval_chars``; 131,072 characters are 2,047 sequences), ``--ranks`` ranks over gloo in one
process group, one thread each. Both arms run in the same processes, alternating (the order rotates between
repeats), on the same model, with a barrier before and after each; the figure is rank 0's seconds between
the barriers.

  product  ``cluster.rank.evaluate.evaluate``: batches of the training micro-batch (32) in the set's order,
           batch ``b`` on rank ``b % W``, batched reads (``get_batch``), per-batch means gathered once and
           summed in batch order (bitwise the same at any world size)
  bare     what the DDP tutorials write: ``DataLoader(TensorDataset, batch_size=32,
           sampler=DistributedSampler(shuffle=False))``, the forward under ``no_grad`` on the unwrapped model,
           then one ``all_reduce`` of (loss sum, count). ``DistributedSampler`` pads the set to a multiple of
           W by repeating samples, so its mean counts some samples twice (printed)

With ``--read-ms X`` each batch read also waits X ms (a storage read's latency, as a Parquet eval set on
object storage has), and the arms are the product reading ahead (``read_ahead = True``, as
``ParquetDataset`` says: the next batch is read in a background thread) against the product reading in turn;
the figure is product/inturn. With ``--loaders N`` too, the product reads in ``N`` loader processes per
rank (``evaluation.loader_workers``, ``cluster.data.pipeline.EvalLoader``, started before the timed repeats as
a run starts them at its first evaluation) instead of a thread.

Output: per repeat the seconds of each arm and product/bare (or product/inturn); the median ratio and a 95%
t-interval of the mean ratio.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BATCH = 32


def _task(eval_chars: int) -> Any:
    from jobs.tasks.charlm import CharLMTask

    return CharLMTask(context=64, d_model=64, n_layers=2, n_heads=4, max_chars=200_000, eval_chars=eval_chars)


class _Slow:
    """The eval set with a fixed wait per batch read (``--read-ms``), read ahead or in turn."""

    def __init__(self, inner: Any, wait_s: float, ahead: bool) -> None:
        self.inner, self.wait_s, self.read_ahead = inner, wait_s, ahead

    def __len__(self) -> int:
        return len(self.inner)

    def get_batch(self, indices: torch.Tensor) -> Any:
        time.sleep(self.wait_s)
        return self.inner.get_batch(indices)


def _bare(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> tuple[float, int]:
    data = TensorDataset(x, y)
    loader = DataLoader(
        data,
        batch_size=BATCH,
        sampler=DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False),
    )
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for xb, yb in loader:
            logits = model(xb)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), yb.reshape(-1))
            total += torch.tensor([float(loss) * len(xb), len(xb)], dtype=torch.float64)
    model.train()
    dist.all_reduce(total)
    return float(total[0] / total[1]), int(total[1])


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from cluster.rank.evaluate import evaluate
        from cluster.spec.load import load_config

        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        task = _task(args.eval_chars)
        torch.manual_seed(0)
        model = task.build_model()
        ds = task.build_eval_dataset()
        x, y = ds.tensors
        cfg = load_config(None, [f"evaluation.batch_size={BATCH}", f"scaling.num_workers={world}"])
        out: list[dict[str, Any]] = []
        other = "inturn" if args.read_ms else "bare"
        wait = args.read_ms / 1000
        loader = None
        if args.loaders and wait:
            from cluster.data.pipeline import EvalLoader

            loader = EvalLoader(_Slow(ds, wait, ahead=False), args.loaders, 2, torch.device("cpu"))
        for rep in range(args.repeats + 1):  # the first round warms both arms up and is dropped
            order = ["product", other] if rep % 2 == 0 else [other, "product"]
            row: dict[str, Any] = {}
            for arm in order:
                dist.barrier()
                t0 = time.perf_counter()
                if arm in ("product", "inturn"):
                    data = _Slow(ds, wait, ahead=arm == "product") if wait else ds
                    reader = loader.batches if arm == "product" and loader is not None else None
                    res = evaluate(task, model, data, cfg, 0, rank, world, torch.device("cpu"), reader=reader)
                    row[f"{arm}_loss"], row[f"{arm}_samples"] = res.loss, res.samples
                else:
                    row["bare_loss"], row["bare_samples"] = _bare(model, x, y, rank, world)
                dist.barrier()
                row[f"{arm}_s"] = time.perf_counter() - t0
            if rep:
                out.append(row)
        dist.destroy_process_group()
        q.put((rank, out))
    except BaseException:
        q.put((rank, traceback.format_exc()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--eval-chars", type=int, default=131_072)
    parser.add_argument("--read-ms", type=float, default=0.0, help="wait per batch read (storage latency)")
    parser.add_argument("--loaders", type=int, default=0, help="with --read-ms: read in N loader processes")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(30)
    for r, v in got.items():
        if isinstance(v, str):
            raise SystemExit(f"rank {r} failed:\n{v}")
    rows = got[0]
    other = "inturn" if args.read_ms else "bare"
    ratios = [r["product_s"] / r[f"{other}_s"] for r in rows]
    mean = statistics.fmean(ratios)
    half = _t95(len(ratios) - 1) * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
    print(f"{'repeat':>6} {'product s':>10} {other + ' s':>9} {'product/' + other:>15}")
    for i, r in enumerate(rows):
        print(
            f"{i + 1:>6} {r['product_s']:>10.3f} {r[other + '_s']:>9.3f} "
            f"{r['product_s'] / r[other + '_s']:>15.3f}"
        )
    first = rows[0]
    if args.read_ms:
        print(
            f"product/inturn: median {statistics.median(ratios):.3f}, mean {mean:.3f} (95% {mean - half:.3f}-"
            f"{mean + half:.3f}); loss product {first['product_loss']!r}, inturn {first['inturn_loss']!r}"
        )
    else:
        print(
            f"product/bare: median {statistics.median(ratios):.3f}, mean {mean:.3f} (95% {mean - half:.3f}-"
            f"{mean + half:.3f}); samples evaluated: product {first['product_samples']}, bare "
            f"{first['bare_samples']} (DistributedSampler's padding); loss product "
            f"{first['product_loss']:.6f}, bare {first['bare_loss']:.6f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "when": datetime.datetime.now(datetime.UTC).isoformat(),
                    "machine": {
                        "cpus": os.cpu_count(),
                        "python": platform.python_version(),
                        "torch": torch.__version__,
                    },
                    "args": vars(args),
                    "rows": rows,
                    "ratio_median": statistics.median(ratios),
                    "ratio_mean": mean,
                    "ratio_ci95": [mean - half, mean + half],
                },
                fh,
                indent=1,
            )


def _t95(dof: int) -> float:
    table = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}
    return table.get(dof, 2.0)


if __name__ == "__main__":
    main()
