"""The peers' training loop in ``bench_chaos``: the char-LM of the product's arm (``ChaosCharLM``, same
model, data, optimizer, LR schedule, seed and global batch), written the way a user writes it for torchrun
and for Ray Train V2: ``DistributedSampler`` with ``set_epoch``, rank 0 checkpoints every
``ckpt_every_steps`` steps to the same S3 storage as the product's, resume from the latest checkpoint by
skipping the steps already done in that epoch, and a NaN check (``torch.isfinite`` on the loss, raising) so
that the launcher restarts from the last checkpoint instead of training on NaN weights.

    python -m torch.distributed.run --standalone --nproc-per-node 8 --max-restarts 100 \
        -m benchmarks.chaos_loop SPEC.json          # the torchrun arm (what bench_chaos starts)

The Ray Train arm calls :func:`raytrain_loop` as ``train_loop_per_worker``. At the end rank 0 writes the
final weights to ``<chaos_dir>/final.pt`` for the comparison with the product's fault-free run.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from benchmarks.chaos_task import ChaosCharLM

Spec = dict[str, Any]
State = dict[str, Any]


def train(
    rank: int,
    world: int,
    spec: Spec,
    wrap: Callable[[nn.Module], nn.Module],
    load: Callable[[], State | None],
    save: Callable[[State], None],
) -> None:
    torch.set_num_threads(1)
    seed, batch, epochs = int(spec["seed"]), int(spec["global_batch"]), int(spec["epochs"])
    every = int(spec["ckpt_every_steps"])
    task = ChaosCharLM(**spec["task_args"])
    torch.manual_seed(seed)
    model = task.build_model()
    ds = task.build_train_dataset()
    sampler: DistributedSampler[Any] = DistributedSampler(
        ds, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    per_rank = batch // world
    steps_per_epoch = len(sampler) // per_rank
    ddp = wrap(model)
    opt = task.build_optimizer(model)
    sched = task.build_scheduler(opt, steps_per_epoch * epochs)
    step = first_epoch = first_in_epoch = 0
    state = load()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step, first_epoch, first_in_epoch = state["global_step"], state["epoch"], state["step_in_epoch"]
    for epoch in range(first_epoch, epochs):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(iter(sampler)))
        ddp.train()
        for i in range(first_in_epoch if epoch == first_epoch else 0, steps_per_epoch):
            idx = order[i * per_rank : (i + 1) * per_rank]
            loss, _ = task.compute_loss(ddp, ds.get_batch(idx))
            if not torch.isfinite(loss):
                raise RuntimeError(
                    f"loss is {float(loss)} at step {step + 1}: restart from the last checkpoint"
                )
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            if every and step % every == 0:
                in_epoch = (epoch, i + 1) if i + 1 < steps_per_epoch else (epoch + 1, 0)
                save(_state(model, opt, sched, step, *in_epoch))
    save(_state(model, opt, sched, step, epochs, 0))
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(task.chaos_dir, "final.pt"))


def _state(model: nn.Module, opt: Any, sched: Any, step: int, epoch: int, in_epoch: int) -> State:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "global_step": step,
        "epoch": epoch,
        "step_in_epoch": in_epoch,
    }


# ------------------------------------------------------------------ torchrun
def _s3(spec: Spec) -> Any:
    import fsspec

    return fsspec.filesystem("s3", **spec["storage_options"])


def torchrun_main(spec_path: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    with open(spec_path) as fh:
        spec = json.load(fh)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=float(spec["collective_timeout_s"]))
    dist.init_process_group("gloo", timeout=timeout)
    fs, root = _s3(spec), spec["ckpt_url"].removeprefix("s3://")

    def load() -> State | None:
        if not fs.exists(f"{root}/latest"):
            return None
        name = fs.cat_file(f"{root}/latest").decode()
        state: State = torch.load(io.BytesIO(fs.cat_file(f"{root}/{name}")), weights_only=True)
        return state

    def save(state: State) -> None:
        if rank == 0:  # the state file first, then the pointer: a crash between leaves the previous one
            buf = io.BytesIO()
            torch.save(state, buf)
            name = f"step_{state['global_step']:09d}.pt"
            fs.pipe_file(f"{root}/{name}", buf.getvalue())
            fs.pipe_file(f"{root}/latest", name.encode())
        dist.barrier()

    try:
        train(rank, world, spec, lambda m: DDP(m), load, save)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ Ray Train V2
def raytrain_loop(spec: Spec) -> None:
    """``train_loop_per_worker`` for ``ray.train.torch.TorchTrainer``."""
    import shutil
    import tempfile

    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()

    def load() -> State | None:
        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            return None
        with ckpt.as_directory() as d:
            state: State = torch.load(os.path.join(d, "state.pt"), map_location="cpu", weights_only=True)
            return state

    def save(state: State) -> None:
        metrics = {"global_step": state["global_step"]}
        if rank != 0:  # every rank reports (Ray Train synchronises on it); rank 0 attaches the checkpoint
            ray.train.report(metrics)
            return
        d = tempfile.mkdtemp(prefix="chaos_rt_")
        try:
            torch.save(state, os.path.join(d, "state.pt"))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
        finally:
            shutil.rmtree(d, ignore_errors=True)

    train(rank, world, spec, ray.train.torch.prepare_model, load, save)


if __name__ == "__main__":
    torchrun_main(sys.argv[1])
