"""The hand-written training loop of the two reference arms of ``bench_ddp`` (bare DDP and Ray Train).

Same model, data, optimizer, LR schedule, seed, global batch and checkpoint cadence as the product's worker
(``cluster/rank/worker.py``), written the way a user writes it by hand: ``DistributedSampler`` with
``set_epoch``, per-rank batch ``B / W``, rank 0 checkpoints every ``ckpt_every_steps`` steps and at every
epoch end, resume from the latest checkpoint by skipping the steps already done in that epoch.

Rank 0 appends one line per optimizer step to ``spec["steplog"]`` (``step ATTEMPT TIME GLOBAL_STEP``), and
a ``start ATTEMPT TIME RESUME_STEP`` line when its loop begins: that is how the benchmark reads time to
first step, epoch times and recovery without touching the loop's hot path beyond one buffered write.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from cluster.spec.task import Task, build_task

Spec = dict[str, Any]
State = dict[str, Any]


def make_task(spec: Spec) -> Task:
    return build_task(spec["task"], spec["task_args"])


def train_loop(
    rank: int,
    world: int,
    spec: Spec,
    wrap: Callable[[nn.Module], nn.Module],
    load: Callable[[], State | None],
    save: Callable[[State], None],
) -> None:
    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1 and the product's cpus_per_worker=1
    if spec.get("tune_allocator"):  # bench_interleaved's like-for-like variant of the product's default
        from cluster.rank.process import tune_allocator

        tune_allocator()
    kill_file = spec.get("kill_file") or ""
    attempt = 1 if kill_file and os.path.exists(kill_file) else 0
    seed, batch, epochs = int(spec["seed"]), int(spec["global_batch"]), int(spec["epochs"])
    every = int(spec["ckpt_every_steps"])
    task = make_task(spec)
    torch.manual_seed(seed)
    model = task.build_model()
    ds = task.build_train_dataset()
    x, y = ds.tensors
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
        if sched is not None:
            sched.load_state_dict(state["scheduler"])
        step, first_epoch, first_in_epoch = state["global_step"], state["epoch"], state["step_in_epoch"]
    log = open(spec["steplog"], "a", buffering=1) if rank == 0 else None
    try:
        if log:
            log.write(f"start {attempt} {time.time():.6f} {step}\n")

        def checkpoint(epoch: int, in_epoch: int) -> None:
            save(
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict() if sched is not None else None,
                    "global_step": step,
                    "epoch": epoch,
                    "step_in_epoch": in_epoch,
                }
            )

        for epoch in range(first_epoch, epochs):
            sampler.set_epoch(epoch)
            order = torch.tensor(list(iter(sampler)))
            ddp.train()
            for i in range(first_in_epoch if epoch == first_epoch else 0, steps_per_epoch):
                idx = order[i * per_rank : (i + 1) * per_rank]
                loss, _ = task.compute_loss(ddp, (x[idx], y[idx]))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if sched is not None:
                    sched.step()
                step += 1
                if log:
                    log.write(f"step {attempt} {time.time():.6f} {step} {float(loss.detach()):.5f}\n")
                if every and step % every == 0 and i + 1 < steps_per_epoch:
                    checkpoint(epoch, i + 1)
            checkpoint(epoch + 1, 0)  # every epoch end (checkpoint.every_epochs=1, as tiny_cpu.yaml)
    finally:
        if log:
            log.close()


# ------------------------------------------------------------------ (b) bare PyTorch DDP
def bare_worker(rank: int, world: int, port: int, spec: Spec) -> None:
    """Entry of one process spawned by torch.multiprocessing (fn(i, *args): i is the rank)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    latest = os.path.join(spec["ckpt_dir"], "latest.pt")

    def load() -> State | None:
        if not os.path.exists(latest):
            return None
        state: State = torch.load(latest, map_location="cpu", weights_only=True)
        return state

    def save(state: State) -> None:
        if rank == 0:
            tmp = latest + ".tmp"
            torch.save(state, tmp)
            os.replace(tmp, latest)  # atomic: a crash never leaves a torn "latest"

    def run() -> None:
        train_loop(rank, world, spec, lambda m: DDP(m), load, save)

    try:
        if spec.get("loop_thread"):
            _run_in_thread(run)  # as the product's actor runs run_epoch: not on the process's main thread
        else:
            run()
    finally:
        dist.destroy_process_group()


def _run_in_thread(fn: Callable[[], None]) -> None:
    import threading

    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # re-raised on the main thread
            errors.append(e)

    thread = threading.Thread(target=target, name="train")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


# ------------------------------------------------------------------ (c) Ray Train V2
def raytrain_loop(spec: Spec) -> None:
    """``train_loop_per_worker`` for ``ray.train.torch.TorchTrainer``."""
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
        # Every rank calls report (Ray Train V2 synchronises on it); rank 0 attaches the checkpoint.
        metrics = {"global_step": state["global_step"]}
        if rank != 0:
            ray.train.report(metrics)
            return
        d = tempfile.mkdtemp(prefix="rt_ckpt_")
        try:
            torch.save(state, os.path.join(d, "state.pt"))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
        finally:
            shutil.rmtree(d, ignore_errors=True)

    train_loop(rank, world, spec, ray.train.torch.prepare_model, load, save)
