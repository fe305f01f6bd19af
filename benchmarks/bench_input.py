"""Input pipeline: a data-bound 2-rank CPU workload, three ways, side by side in one run.

    .venv/bin/python -m benchmarks.bench_input [--repeats 2] [--json out.json]
    .venv/bin/python -m benchmarks.bench_input --modes cpu --repeats 1 --epochs 3     # quick

Workload (identical in every arm): ``ImageTask``, a map-style dataset of synthetic 3x36x36 images made on the
fly from the sample index (no ``get_batch``: one ``__getitem__`` per sample, collated), each decoded and
augmented (random 32x32 crop, flip, then ``decode_rounds`` 3x3 blurs: a fixed per-sample CPU cost); a small
CNN (two convolutions, a linear head), SGD, global batch 64, ``--ranks`` ranks (2) over gloo, one thread
per rank, ``--steps`` steps per epoch, ``--epochs`` epochs. Before the arms run, the parent times one
step and one batch on one thread and sets ``decode_rounds`` (and, in ``io`` mode, a per-sample wait) so
that preparing a rank's batch costs about as long as its step (``--prep-ratio``):

  cpu  the whole preparation is CPU work (decode rounds)
  io   20% CPU work, 80% a wait per sample (``time.sleep``: a storage read's latency)

Arms (each in fresh processes started with spawn; no Ray anywhere):

  product     cluster.rank.worker.Worker in plain processes (bind_store, setup, run_epoch per epoch, finish),
              as the multiprocess tests run it, with training.loader_workers=K (``--loaders``, default 1)
  bare        hand-written DDP: DistributedSampler(shuffle, seed, drop_last) + set_epoch, DataLoader(
              num_workers=K, persistent_workers=True, pin_memory=False, prefetch_factor=2), the same order
  inthread    the product's worker with training.loader_workers=0 (the training thread fetches each batch)

Figure: steady steps/s on rank 0, per epoch after the first, from its step-end times within the epoch
((steps - 1) / (last - first): epoch boundaries, loader start and the final checkpoint excluded), median
over those epochs; per repeat the ratios product/bare and product/inthread, then their median over
repeats (the arm order rotates between repeats). On 2 cores, 2 ranks and 2 loader processes oversubscribe
the CPU: in ``cpu`` mode the work per step is the same with loaders or without, so no arm can gain much
there; ``io`` mode shows what the overlap hides. ``--ranks 1`` leaves a core per rank for its loader: the
configuration of a GPU node, where the ranks' steps run on the GPUs and the cores prepare batches.
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
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import Dataset

from cluster.spec.task import Task

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("product", "bare", "inthread")
GLOBAL_BATCH, SEED, SAMPLES = 64, 0, 8192
TARGETS = {"product/bare": 0.98, "product/inthread": 1.6}


# ====================================================================== the workload
class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """Images made from the index, then decoded and augmented at a fixed CPU cost (plus a wait in io mode)."""

    def __init__(self, n: int, decode_rounds: int, wait_s: float) -> None:
        self.n, self.decode_rounds, self.wait_s = n, decode_rounds, wait_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.wait_s:
            time.sleep(self.wait_s)
        g = torch.Generator().manual_seed(int(i))
        raw = torch.randint(0, 256, (3, 36, 36), generator=g, dtype=torch.uint8)
        top, left = (int(v) for v in torch.randint(0, 5, (2,)))
        img = raw[:, top : top + 32, left : left + 32].float().div_(255.0)
        if bool(torch.rand(()) < 0.5):
            img = img.flip(-1)
        for _ in range(self.decode_rounds):
            img = nn.functional.avg_pool2d(
                nn.functional.pad(img[None], (1, 1, 1, 1), mode="replicate"), 3, 1
            )[0]
        return (img - 0.5) / 0.25, int(i) % 10


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(512, 10),
    )


class ImageTask(Task):
    """task_args: decode_rounds, wait_s, samples."""

    def build_model(self) -> nn.Module:
        return build_model()

    def build_train_dataset(self) -> SyntheticImages:
        a = self.args
        return SyntheticImages(int(a.get("samples", SAMPLES)), int(a["decode_rounds"]), float(a["wait_s"]))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y), {}


def calibrate(prep_ratio: float, io_share: float, world: int) -> dict[str, Any]:
    """On one thread: the step's time, a decode round's time per rank batch; rounds and wait to match."""
    torch.set_num_threads(1)
    per_rank = GLOBAL_BATCH // world
    model, x, y = build_model(), torch.randn(per_rank, 3, 32, 32), torch.randint(0, 10, (per_rank,))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step() -> None:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    def batch(ds: SyntheticImages) -> None:
        for i in range(per_rank):
            ds[i]

    step_s = _best(step)
    base_s = _best(lambda: batch(SyntheticImages(SAMPLES, 0, 0.0)))
    round_s = (_best(lambda: batch(SyntheticImages(SAMPLES, 20, 0.0))) - base_s) / 20
    cpu_target = prep_ratio * step_s * (1 - io_share)
    rounds = max(0, round((cpu_target - base_s) / max(round_s, 1e-9)))
    wait_s = prep_ratio * step_s * io_share / per_rank
    return {
        "step_ms": step_s * 1e3,
        "batch_base_ms": base_s * 1e3,
        "round_ms": round_s * 1e3,
        "decode_rounds": rounds,
        "wait_s": wait_s,
        "batch_prep_ms": (base_s + rounds * round_s + wait_s * per_rank) * 1e3,
    }


def _best(fn: Any, n: int = 7) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# ====================================================================== the arms (child processes)
def _product(rank: int, port: int, work: str, spec: dict[str, Any], loaders: int) -> list[list[float]]:
    from cluster.rank.process import worker_env
    from cluster.rank.worker import Worker
    from cluster.spec.load import load_config

    cfg = load_config(
        os.path.join(REPO, "jobs/configs/tiny_cpu.yaml"),
        [
            "name=bench-input",
            f"storage={work}/runs",
            f"training.epochs={spec['epochs']}",
            f"training.global_batch_size={GLOBAL_BATCH}",
            f"training.max_steps_per_epoch={spec['steps']}",
            f"training.seed={SEED}",
            f"training.loader_workers={loaders}",
            "training.log_every_steps=1",
            "checkpoint.every_steps=0",
            "checkpoint.every_epochs=0",
            "checkpoint.async_save=false",
        ],
        data={
            "task": "benchmarks.bench_input:ImageTask",
            "task_args": {"decode_rounds": spec["decode_rounds"], "wait_s": spec["wait_s"]},
        },
    )
    with worker_env(cfg):
        worker = Worker(cfg, rank, spec["world"], f"{work}/runs/bench-input")
    if rank == 0:
        port = worker.bind_store()
        _write(f"{work}/port", str(port))
    else:
        port = int(_wait_for(f"{work}/port"))
    worker.setup("127.0.0.1", port)
    epochs = []
    for epoch in range(spec["epochs"]):
        res = worker.run_epoch(epoch, 0)
        epochs.append([row["time"] for row in res.step_rows])
    worker.finish()
    worker.shutdown()
    return epochs


def _bare(rank: int, port: int, work: str, spec: dict[str, Any], loaders: int) -> list[list[float]]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    world = spec["world"]
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    task = ImageTask(decode_rounds=spec["decode_rounds"], wait_s=spec["wait_s"])
    dataset = task.build_train_dataset()
    torch.manual_seed(SEED)
    model = DDP(task.build_model())
    optimizer = task.build_optimizer(model.module)
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, world, rank, shuffle=True, seed=SEED, drop_last=True
    )
    loader = DataLoader(
        dataset,
        batch_size=GLOBAL_BATCH // world,
        sampler=sampler,
        drop_last=True,
        num_workers=loaders,
        persistent_workers=loaders > 0,
        prefetch_factor=2 if loaders else None,
        pin_memory=False,
    )
    epochs = []
    for epoch in range(spec["epochs"]):
        sampler.set_epoch(epoch)
        times = []
        for step, batch in enumerate(loader):
            if step == spec["steps"]:
                break
            loss, _ = task.compute_loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.time())
        epochs.append(times)
    dist.destroy_process_group()
    return epochs


def _child(arm: str, rank: int, port: int, work: str, spec: dict[str, Any], loaders: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if arm == "bare":
        epochs = _bare(rank, port, work, spec, loaders)
    else:
        epochs = _product(rank, port, work, spec, loaders if arm == "product" else 0)
    if rank == 0:
        _write(f"{work}/steps.json", json.dumps(epochs))
    sys.stdout.flush()
    os._exit(0)  # results are on disk and the process group is destroyed


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
    os.replace(path + ".tmp", path)


def _wait_for(path: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(path)
        time.sleep(0.05)
    return open(path).read()


def run_arm(arm: str, spec: dict[str, Any], loaders: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-input-") as work:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = mp.get_context("spawn")
        t0 = time.time()
        procs = [
            ctx.Process(target=_child, args=(arm, r, port, work, spec, loaders)) for r in range(spec["world"])
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join(5)
                raise TimeoutError(f"{arm}: rank {r} did not finish within {timeout}s")
            if p.exitcode != 0:
                raise RuntimeError(f"{arm}: rank {r} exited with {p.exitcode}")
        epochs: list[list[float]] = json.loads(open(f"{work}/steps.json").read())
    rates = [(len(ts) - 1) / (ts[-1] - ts[0]) for ts in epochs[1:] if len(ts) > 1]
    return {"steps_per_s": statistics.median(rates), "epoch_rates": rates, "wall_s": time.time() - t0}


# ====================================================================== driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="cpu,io")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--loaders", type=int, default=1, help="loader processes per rank (product and bare)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks (1: a core left for the loader on 2 cores)")
    ap.add_argument("--prep-ratio", type=float, default=1.0, help="a rank's batch preparation / its step")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()
    arms = args.arms.split(",")
    out: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "loaders": args.loaders,
        "ranks": args.ranks,
        "modes": {},
    }
    for mode in args.modes.split(","):
        cal = calibrate(args.prep_ratio, 0.8 if mode == "io" else 0.0, args.ranks)
        spec = {**cal, "epochs": args.epochs, "steps": args.steps, "world": args.ranks}
        print(
            f"[{mode}] one thread: step {cal['step_ms']:.1f} ms, "
            f"batch preparation {cal['batch_prep_ms']:.1f} ms "
            f"({cal['decode_rounds']} decode rounds, wait {cal['wait_s'] * 1e3:.2f} ms/sample)",
            flush=True,
        )
        runs: list[dict[str, Any]] = []
        for rep in range(args.repeats):
            order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
            row = {}
            for arm in order:
                row[arm] = run_arm(arm, spec, args.loaders, args.timeout)
                print(f"[{mode}] repeat {rep} {arm:9s} {row[arm]['steps_per_s']:.2f} steps/s", flush=True)
            runs.append(row)
        summary = {arm: statistics.median(r[arm]["steps_per_s"] for r in runs) for arm in arms}
        ratios = {}
        for other in ("bare", "inthread"):
            if "product" in arms and other in arms:
                ratios[f"product/{other}"] = statistics.median(
                    r["product"]["steps_per_s"] / r[other]["steps_per_s"] for r in runs
                )
        out["modes"][mode] = {"calibration": cal, "runs": runs, "steps_per_s": summary, "ratios": ratios}
    print()
    print("| mode | " + " | ".join(f"{a} steps/s" for a in arms) + " | product/bare | product/inthread |")
    print("|---|" + "---:|" * (len(arms) + 2))
    for mode, m in out["modes"].items():
        cells = [f"{m['steps_per_s'][a]:.2f}" for a in arms]
        rs = [f"{m['ratios'].get(k, float('nan')):.2f}x" for k in TARGETS]
        print(f"| {mode} | " + " | ".join(cells + rs) + " |")
    for mode, m in out["modes"].items():
        for key, target in TARGETS.items():
            if key in m["ratios"]:
                ok = m["ratios"][key] >= target
                print(
                    f"[{mode}] {key} {m['ratios'][key]:.2f}x (target >= {target}x): "
                    + ("met" if ok else "missed")
                )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
