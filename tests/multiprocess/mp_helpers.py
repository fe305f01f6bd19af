"""Run cluster.rank.worker.Worker in plain processes (no Ray): what the multiprocess tests drive."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from cluster.data.pipeline import fetch_batch
from cluster.rank.dist import share_gpus
from cluster.rank.worker import Worker
from cluster.spec.config import JobConfig
from cluster.spec.load import load_config


def tiny_config(storage: str, overrides: list[str] | None = None) -> JobConfig:
    base = [
        f"storage={storage}",
        "task_args.max_chars=30000",
        "task_args.d_model=32",
        "task_args.n_layers=1",
        "task_args.context=32",
        "training.global_batch_size=32",
        "training.log_every_steps=1",
        "checkpoint.async_save=false",
    ]
    return load_config("jobs/configs/tiny_cpu.yaml", base + (overrides or []))


def _entry(
    rank: int,
    world: int,
    cfg: JobConfig,
    run_url: str,
    plan: list[tuple[int, int]],
    out: str,
    port_q: Any,
    attempt: int,
    grads: bool,
    gpu: tuple[str, int] | None,
) -> None:
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        worker = Worker(cfg, rank, world, run_url, attempt)
        if gpu:  # every rank sees all the GPUs and selects its own, as the Ray path arranges (share_gpus)
            worker.use_gpus(*gpu)
        if rank == 0:
            port = worker.bind_store()
            for _ in range(world - 1):
                port_q.put(port)
        else:
            port = port_q.get(timeout=60)
        session = worker.setup("127.0.0.1", port)
        info = session.info
        result: dict[str, Any] = {"resume": info.resume, "epochs": [], "rows": [], "commits": []}
        if grads:
            result["grads"] = one_backward(worker)
        for epoch, start in plan:
            if epoch < 0:  # "from wherever setup resumed"
                epoch, start = info.resume.epoch, info.resume.step_in_epoch
            r = worker.run_epoch(epoch, start)
            result["epochs"].append((r.epoch, r.global_step, r.loss))
            result["rows"] += r.step_rows
            result["commits"] += r.commits
        result["commits"] += worker.finish()  # and the ones not yet reported
        result["params"] = {k: v.detach().clone() for k, v in session.raw_model.state_dict().items()}
        local = getattr(session.optimizer, "optim", session.optimizer)  # a ZeroRedundancyOptimizer's own
        result["optimizer"] = (type(session.optimizer).__name__, len(local.state))
        torch.save(result, f"{out}/rank{rank}.pt")
        worker.shutdown()
    except BaseException:
        with open(f"{out}/rank{rank}.err", "w") as fh:
            fh.write(traceback.format_exc())
        raise
    # Everything this rank is tested for is on disk and its process group is destroyed: leave without the
    # interpreter's teardown. Once in a CI run (2026-12-03), rank 0 aborted there ("terminate called without
    # an active exception", SIGABRT) after saving its results; not reproduced in 38 reruns. Ray actors, where
    # the product's workers run, end through Ray's own exit path, not this one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def mp_context() -> Any:
    """Where the tests start their ranks: children forked from a server that already imported torch and the
    worker (``forkserver`` with this module preloaded), not fresh interpreters (``spawn``) that import them
    again, ~1.6 s of CPU each. Start a child with :func:`process`: the server's environment is the one it
    started in, so the child is handed the test's own."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def process(ctx: Any, target: Any, args: tuple[Any, ...]) -> Any:
    """``ctx.Process(target=target, args=args)`` run in this process's environment as it is now (a test's
    ``os.environ`` changes included), as a spawned child would see it."""
    return ctx.Process(target=_in_env, args=(dict(os.environ), target, args))


def _in_env(env: dict[str, str], target: Any, args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def one_backward(worker: Worker) -> dict[str, torch.Tensor]:
    """Gradients after one DDP backward on this rank's share (all-reduced by DDP)."""
    s = worker.session
    assert s is not None
    s.sampler.set_epoch(0, 0)
    idx = next(iter(s.sampler))
    batch = fetch_batch(worker.dataset, idx)
    loss, _ = worker.task.compute_loss(s.model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in s.raw_model.named_parameters() if p.grad is not None}
    s.optimizer.zero_grad(set_to_none=True)
    return grads


def run_workers(
    world: int,
    cfg: JobConfig,
    run_url: str,
    plan: list[tuple[int, int]],
    out: str,
    attempt: int = 0,
    grads: bool = False,
    timeout: float = 120,
) -> list[dict[str, Any]]:
    """Start ``world`` processes, run ``plan`` (list of (epoch, start_step)), return each rank's result."""
    ctx = mp_context()
    q = ctx.Queue()
    gpus = _gpu_placement(cfg, world)
    procs = [
        process(ctx, _entry, (r, world, cfg, run_url, plan, out, q, attempt, grads, gpu))
        for r, gpu in enumerate(gpus or [None] * world)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
        for r, p in enumerate(procs):
            if p.is_alive():
                raise TimeoutError(f"rank {r} did not finish within {timeout}s")
            if p.exitcode != 0:
                err = f"{out}/rank{r}.err"
                text = open(err).read() if os.path.exists(err) else f"exit code {p.exitcode}"
                raise RuntimeError(f"rank {r} failed:\n{text}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [torch.load(f"{out}/rank{r}.pt", weights_only=False) for r in range(world)]


def _gpu_placement(cfg: JobConfig, world: int) -> list[tuple[str, int]] | None:
    """Per rank, (CUDA_VISIBLE_DEVICES, its index): one GPU each, or ``1 / gpus_per_worker`` ranks per GPU,
    assigned as Ray would and shared by ``cluster.rank.dist.share_gpus``."""
    if not cfg.scaling.use_gpu or world == 1:
        return None
    gpus, per_gpu = _gpu_ids(), max(1, int(1 / cfg.scaling.gpus_per_worker + 1e-9))
    if len(gpus) * per_gpu < world:
        raise RuntimeError(f"{world} GPU ranks, {per_gpu} per GPU, need more GPUs than the {len(gpus)} here")
    placements = [("local", [gpus[r // per_gpu]]) for r in range(world)]
    return share_gpus(placements, shared=per_gpu > 1)


def _gpu_ids() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [v.strip() for v in visible.split(",") if v.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]
