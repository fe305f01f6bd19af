"""A large state moved two ways, side by side: from a peer's memory over gloo, and from a checkpoint.

    .venv/bin/python -m benchmarks.bench_peer_transfer [--gib 1.0] [--repeats 3] [--json out.json]

Two processes on this machine, one gloo process group. Rank 0 holds a model (a stack of square Linear layers)
and an AdamW optimizer after one step, so its state (weights + two moments) is ``--gib`` GiB. Rank 1 holds the
same model freshly built and an optimizer with no state: a replacement rank. Per repeat, rank 1 gets the state

  peers     ``cluster.rank.peer_transfer.broadcast_state`` from rank 0, load into model and optimizer, digest
            check: what a recovery from peers does (``Worker._receive``)
  storage   ``CheckpointStore.load_latest`` of the checkpoint rank 0 committed to a local folder (read, verify
            every checksum, deserialize), load into model and optimizer: what every rank of a checkpoint
            recovery does

and reports seconds (transfer alone, and with the load). A local folder is storage's best case (the page
cache holds the file after the first read); a network store adds its bandwidth on top.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(gib: float) -> Any:
    import torch
    from torch import nn

    width = 4096
    per_layer = width * width + width
    layers = max(1, math.ceil(gib * (1 << 30) / (3 * 4 * per_layer)))  # weights + 2 AdamW moments, float32
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _entry(rank: int, port: int, gib: float, repeats: int, work: str) -> None:
    try:
        import torch
        import torch.distributed as dist

        from cluster.rank.peer_transfer import broadcast_state, state_digest
        from cluster.run.checkpoint import CheckpointStore
        from cluster.run.storage import Storage

        torch.set_num_threads(1)
        store = dist.TCPStore(
            "127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=600)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        model = _model(gib)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ckpt = CheckpointStore(Storage(os.path.join(work, "run")))
        if rank == 0:
            for p in model.parameters():
                p.grad = torch.full_like(p, 1e-3)
            opt.step()
            opt.zero_grad(set_to_none=True)
            state = {"model": model.state_dict(), "train_state": {"optimizer": opt.state_dict()}}
            digest, nbytes = state_digest(state)
            t = time.perf_counter()
            ckpt.commit(
                1,
                {"model.pt": _ser(state["model"]), "train_state.pt": _ser(state["train_state"])},
                {"epoch": 0},
            )
            write_s = time.perf_counter() - t
        box: list[Any] = [(digest, nbytes, write_s) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        digest, nbytes, write_s = box[0]
        rows = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            got, moved = broadcast_state(state if rank == 0 else None, 0, torch.device("cpu"))
            t1 = time.perf_counter()
            if rank == 1:
                fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
                model.load_state_dict(got["model"])
                fresh.load_state_dict(got["train_state"]["optimizer"])
                check = {"model": model.state_dict(), "train_state": {"optimizer": fresh.state_dict()}}
                assert state_digest(check)[0] == digest, "the peer copy is not exact"
                t2 = time.perf_counter()
                del got, fresh, check
                loaded = CheckpointStore(Storage(os.path.join(work, "run"))).load_latest()
                assert loaded is not None
                t3 = time.perf_counter()
                fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
                model.load_state_dict(loaded.files["model.pt"])
                fresh.load_state_dict(loaded.files["train_state.pt"]["optimizer"])
                t4 = time.perf_counter()
                del loaded, fresh
                rows.append(
                    {
                        "peer_transfer_s": t1 - t0,
                        "peer_total_s": t2 - t0,
                        "peer_bytes": moved.nbytes,
                        "storage_read_s": t3 - t2,
                        "storage_total_s": t4 - t2,
                    }
                )
            else:
                del got
        if rank == 1:
            with open(os.path.join(work, "result.json"), "w") as fh:
                json.dump({"state_bytes": nbytes, "checkpoint_write_s": write_s, "rows": rows}, fh)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(work, f"rank{rank}.err"), "w") as fh:
            fh.write(traceback.format_exc())
        raise


def _ser(obj: Any) -> bytes:
    from cluster.run.checkpoint import serialize

    return serialize(obj)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_peer_transfer", description=__doc__)
    p.add_argument("--gib", type=float, default=1.0, help="model + optimizer state size in GiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the runs and medians to this file")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    sys.path.insert(0, REPO)
    work = tempfile.mkdtemp(prefix="bpt", dir="/tmp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, port, args.gib, args.repeats, work)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(1800)
    for r, proc in enumerate(procs):
        if proc.exitcode != 0:
            err = os.path.join(work, f"rank{r}.err")
            print(open(err).read() if os.path.exists(err) else f"rank {r} exit {proc.exitcode}")
            return 1
    with open(os.path.join(work, "result.json")) as fh:
        res = json.load(fh)
    med = {k: statistics.median(r[k] for r in res["rows"]) for k in res["rows"][0]}
    gib = res["state_bytes"] / (1 << 30)
    print(
        f"state: {gib:.2f} GiB (weights + AdamW moments); checkpoint write {res['checkpoint_write_s']:.2f}s"
    )
    print(f"{'':10} {'transfer_s':>10} {'with load_s':>11}   (median of {len(res['rows'])})")
    print(f"{'peers':10} {med['peer_transfer_s']:>10.2f} {med['peer_total_s']:>11.2f}")
    print(f"{'storage':10} {med['storage_read_s']:>10.2f} {med['storage_total_s']:>11.2f}")
    print(f"peers/storage with load: {med['peer_total_s'] / med['storage_total_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "command": " ".join(["python", "-m", "benchmarks.bench_peer_transfer", *sys.argv[1:]]),
                    "date": datetime.datetime.now().isoformat(timespec="seconds"),
                    **res,
                    "median": med,
                },
                fh,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
