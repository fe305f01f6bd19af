"""The worker's half of recovery: leaving a failed group, keeping the state, and taking it up again.

A survivor of a failure leaves its process group at once (so peers blocked on it fail now, not at the
timeout) and keeps model, optimizer and position in memory (:func:`keep`). The next ``setup`` takes the
state either from a peer over the new group (:func:`receive`) or from the newest verified checkpoint
(:func:`resume`; after a NaN loss the newest before the skipped window, :func:`rollback_point`; a fresh
run's weights may come from another run, :func:`init_from`); :func:`take_state` chooses between them and
wraps the model. Each returns the :class:`ResumePoint` the
driver is told and the :class:`RunPosition` the worker continues from. The driver's half is
``cluster.driver.driver``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cluster.core.errors import CheckpointError, ConfigError, StorageError
from cluster.data.pipeline import ResumableDistributedSampler
from cluster.rank import ddp
from cluster.rank import dist as cdist
from cluster.rank.ddp import unsendable
from cluster.rank.peer_transfer import Transfer, broadcast_state, state_digest
from cluster.rank.rollback_points import MemorySnapshots, rollback_step
from cluster.rank.session import check_writable
from cluster.rank.train_state import RunPosition, Scheduler, TrainState, apply, capture, payload
from cluster.run.checkpoint import CheckpointStore, step_dir
from cluster.seam.peers import PeerPlan, PeerState
from cluster.seam.protocol import ResumePoint
from cluster.spec.config import JobConfig
from cluster.spec.schedule import Window, merge_windows
from cluster.spec.task import Task

logger = logging.getLogger(__name__)


def leave_group(session: Any) -> None:
    """Leave the process group at once after a failure, on the training thread, so that peers blocked on
    this rank fail now, not at the process-group timeout: NCCL aborts its communicators; under gloo this
    rank's peer connections are shut down (``cluster.rank.dist.sever_peers`` says why). ``session``: the
    worker's ``TrainSession``, or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if session is not None and session.backend == "nccl":
        group = dist.group.WORLD
        if group is not None:
            try:
                group.abort()
            except RuntimeError as exc:
                logger.warning("aborting the process group failed: %s", exc)
    else:
        cdist.sever_peers()
    if session is not None:
        session.model = None  # the failed group's DDP; a new one wraps next time
    cdist.destroy_process_group()


def abort(session: Any) -> bool:
    """From another thread, while the training thread may be blocked in a collective whose peer is
    gone: abort the process group so that the collective returns with an error. NCCL supports this;
    for gloo it is not needed (a dead peer's closed sockets fail the collective at once, and a rank
    that fails destroys its group, which fails its neighbours in turn). Returns whether it aborted."""
    if session is None or session.backend != "nccl" or not dist.is_initialized():
        return False
    group = dist.group.WORLD
    if group is None:
        return False
    group.abort()
    return True


def discard(kept: Any) -> None:
    """Drop a survivor's kept session whose state is not used."""
    if kept.writer is not None:
        kept.writer.close(flush=True)  # commit the checkpoint in flight: the fallback may use it


def keep(
    session: Any, pos: RunPosition, world_size: int, seed: int, rank: int
) -> tuple[RunPosition, PeerState]:
    """A survivor that left its group keeps ``session``'s model, optimizer and scheduler: the position it
    continues from (at an epoch's end, the next epoch's start) and its report as rank ``rank`` of the next
    group. A sharded optimizer's state is not asked for (it would take a collective on the failed group)
    and is not sent."""
    why = unsendable(session.optimizer)
    pos = pos.at_epoch_start(session.sampler.steps_per_epoch)
    state = capture(pos, world_size, seed, session.optimizer, session.scheduler, with_optimizer=not why)
    session.optimizer.zero_grad(set_to_none=True)  # gradients of a step that did not complete
    session.model = None  # the failed group's DDP reducer; a new one wraps next
    digest, nbytes = state_digest(payload(session.raw_model, state))
    report = PeerState(
        rank=rank,
        global_step=state.global_step,
        epoch=state.epoch,
        step_in_epoch=state.step_in_epoch,
        digest=digest,
        nbytes=nbytes,
        unsendable=why,
    )
    return pos, report


def receive(
    plan: PeerPlan,
    rank: int,
    world_size: int,
    seed: int,
    device: torch.device,
    raw_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Scheduler | None,
    pos: RunPosition,
) -> tuple[ResumePoint, RunPosition]:
    """Every rank of the new group: rank ``plan.source`` broadcasts its state, the ranks that do not hold
    it load it, and every rank checks it now holds the state the plan names."""
    holder = rank in plan.holders
    # Only the ranks that lack the state take part: the source and those not holding it (a group of
    # those; every rank of the default group must create it).
    takers = sorted({plan.source, *(r for r in range(world_size) if r not in plan.holders)})
    group = dist.new_group(takers) if len(takers) < world_size else None
    moved = Transfer(0, 0.0, 0.0, 0)
    ts = None
    if rank in takers:
        mine = None
        if rank == plan.source:
            mine = payload(raw_model, capture(pos, world_size, seed, optimizer, scheduler))
        sent, moved = broadcast_state(mine, plan.source, device, group)
        ts = TrainState.from_state_dict(sent["train_state"], f"the state sent by rank {plan.source}")
        if not holder:
            pos = apply(ts, sent["model"], raw_model, optimizer, scheduler, pos)
        del sent
    if group is not None and rank in takers:
        dist.destroy_process_group(group)
    if holder and (pos.global_step, pos.epoch, pos.step_in_epoch) != (
        plan.global_step,
        plan.epoch,
        plan.step_in_epoch,
    ):
        raise RuntimeError(f"rank {rank} holds step {pos.global_step}, the plan says {plan.global_step}")
    digest, _ = state_digest(payload(raw_model, capture(pos, world_size, seed, optimizer, scheduler)))
    if digest != plan.digest:
        raise RuntimeError(
            f"rank {rank} holds state {digest[:12]} after the transfer from rank {plan.source}, "
            f"which reported {plan.digest[:12]}: the peer copy is not exact"
        )
    check_writable(raw_model, optimizer, scheduler, pos, world_size, seed, "the task")
    point = ResumePoint(
        plan.global_step,
        plan.epoch,
        plan.step_in_epoch,
        None,
        ts.world_size if ts is not None else world_size,
        source="peers",
        peer_source=plan.source,
        nbytes=0 if rank == plan.source else moved.nbytes,
        transfer_s=moved.seconds,
    )
    return point, pos


def resume(
    store: CheckpointStore,
    rank: int,
    cfg: JobConfig,
    raw_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Scheduler | None,
    pos: RunPosition,
    sampler: ResumableDistributedSampler,
    rollback: Window | None = None,
    memory: MemorySnapshots | None = None,
) -> tuple[ResumePoint, list[tuple[int, str]], RunPosition]:
    """Rank 0 picks the newest verified checkpoint (with ``rollback``: :func:`rollback_point`, which takes
    the ranks' copy in ``memory`` instead when it is newer: ``cluster.rank.rollback_points``); every rank
    loads that one step. Returns where it resumed, the checkpoints passed over and the position. A
    fresh start is at step 0 with ``pos``'s skip windows, a new run's sampler order and no best
    evaluation. ConfigError (on every rank alike) when the checkpoint does not fit this job's model or
    steps per epoch (:func:`check_fits`), or when the state a checkpoint would hold cannot be loaded back
    (``cluster.rank.session.check_writable``)."""
    t0 = time.perf_counter()
    choice: list[Any] = [None, [], 0, None]
    files: dict[str, Any] | None = None
    in_memory = rollback_step(memory, rollback[0]) if rollback is not None else None  # every rank
    if rank == 0:
        if rollback is None:
            loaded = store.load_latest()  # records what it passed over in store.last_skipped
            back = None
        else:
            loaded, back = rollback_point(store, rollback, cfg.checkpoint.keep_every_steps, in_memory)
        step = loaded.info.step if loaded else back.get("memory_step") if back else None
        choice = [step, list(store.last_skipped), loaded.info.total_bytes if loaded else 0, back]
        files = loaded.files if loaded else None
    dist.broadcast_object_list(choice, src=0)
    step, skipped, nbytes, back = choice
    if back is not None and back.get("memory_step") is not None:
        assert memory is not None  # memory_step comes from rollback_step, None without it
        return _from_memory(memory, int(step), rank, cfg, raw_model, optimizer, scheduler, pos, back, t0)
    if step is None:
        pos = dataclasses.replace(RunPosition.start(cfg), skips=list(pos.skips))
        init = init_from(raw_model, rank, cfg) if cfg.training.init_from else None
        _writable(raw_model, optimizer, scheduler, pos, cfg)
        fresh = ResumePoint(0, 0, 0, None, init_from=init, transfer_s=time.perf_counter() - t0)
        return dataclasses.replace(fresh, skipped_steps=list(pos.skips), rollback=back), skipped, pos
    if files is None:
        files = store.load_step(step)
    url = store.storage.url(step_dir(step))
    state = TrainState.from_state_dict(files["train_state.pt"], f"{url}/train_state.pt")
    if state.seed != cfg.training.seed:
        raise CheckpointError(
            f"{url} was written with training.seed={state.seed}, this job has {cfg.training.seed}: "
            "resuming would change the data order mid-run. Keep the seed, or choose a new run name"
        )
    check_fits(files["model.pt"], state, raw_model, sampler, cfg, store, url)
    pos = apply(state, files["model.pt"], raw_model, optimizer, scheduler, pos)
    pos.skips = merge_windows([*pos.skips, *((a, b) for a, b in state.skipped_steps)])
    _writable(raw_model, optimizer, scheduler, pos, cfg)
    point = ResumePoint(
        state.global_step,
        state.epoch,
        state.step_in_epoch,
        url,
        state.world_size,
        source="checkpoint",
        nbytes=int(nbytes),
        transfer_s=time.perf_counter() - t0,
        skipped_steps=list(pos.skips),
        rollback=back,
    )
    return point, skipped, pos


def _from_memory(
    memory: MemorySnapshots,
    step: int,
    rank: int,
    cfg: JobConfig,
    raw_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Scheduler | None,
    pos: RunPosition,
    back: dict[str, Any],
    t0: float,
) -> tuple[ResumePoint, list[tuple[int, str]], RunPosition]:
    """Every rank loads its own copy at ``step`` (every rank's has the same digest: ``rollback_step``)."""
    files = memory.files(step)
    state = TrainState.from_state_dict(
        files["train_state.pt"], f"rank {rank}'s copy in memory at step {step}"
    )
    pos = apply(state, files["model.pt"], raw_model, optimizer, scheduler, pos)
    pos.skips = merge_windows([*pos.skips, *((a, b) for a, b in state.skipped_steps)])
    _writable(raw_model, optimizer, scheduler, pos, cfg)
    point = ResumePoint(
        state.global_step,
        state.epoch,
        state.step_in_epoch,
        None,
        state.world_size,
        source="memory",
        transfer_s=time.perf_counter() - t0,
        skipped_steps=list(pos.skips),
        rollback=back,
    )
    return point, [], pos


def _writable(
    raw_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Scheduler | None,
    pos: RunPosition,
    cfg: JobConfig,
) -> None:
    world_size = dist.get_world_size()
    check_writable(raw_model, optimizer, scheduler, pos, world_size, cfg.training.seed, cfg.task)


def check_fits(
    weights: dict[str, Any],
    state: TrainState,
    raw_model: nn.Module,
    sampler: ResumableDistributedSampler,
    cfg: JobConfig,
    store: CheckpointStore,
    url: str,
) -> None:
    """ConfigError unless the checkpoint at ``url`` fits this job: every tensor of the model by name and
    shape (as a strict ``load_state_dict``), and its position on this job's steps per epoch. Either
    changes only with the config (``task_args``, ``training.max_steps_per_epoch``) or the data, so a
    retry cannot help: the message names the first tensor or the position that does not fit, and the keys
    whose values differ from the run's ``run.json`` (the config that last started)."""
    wrong = _first_misfit(weights, raw_model.state_dict())
    if wrong is not None:
        changed = _changed(store, cfg, "task_args")
        raise ConfigError(
            f"{url}/model.pt does not fit this job's model ({wrong}): "
            + (
                f"{changed} changed since the run started. Keep the run's task_args"
                if changed
                else f"task_args are the run's, so {cfg.task}.build_model() builds another model now. "
                "Build the run's model"
            )
            + ", or choose a new run name (training.init_from can start it from these weights)"
        )
    spe = sampler.steps_per_epoch
    g, e, s = state.global_step, state.epoch, state.step_in_epoch
    if s < spe and g == e * spe + s:
        return
    was = f", written at {(g - s) // e} steps per epoch" if e > 0 and (g - s) % e == 0 else ""
    changed = _changed(store, cfg, "training", "max_steps_per_epoch")
    cap = sampler.max_steps_per_epoch
    at_most = f", at most training.max_steps_per_epoch={cap}" if cap else ""
    raise ConfigError(
        f"{url} is at step {g} (epoch {e}, {s} steps into it{was}), which does not fit this job's {spe} "
        f"steps per epoch ({sampler.num_samples} samples // training.global_batch_size="
        f"{sampler.global_batch_size}{at_most}): "
        + (f"{changed} changed since the run started" if changed else "the dataset's size changed")
        + ". Resuming would train other batches than the run's and count its epochs wrong: keep the run's "
        "training.max_steps_per_epoch and dataset, or choose a new run name"
    )


def _first_misfit(weights: dict[str, Any], own: dict[str, Any]) -> str | None:
    """The first tensor of a strict load of ``weights`` into a model whose state is ``own`` that does not
    fit, with its shapes (and how many do not); None when all fit."""
    out = []
    for name, mine in own.items():
        theirs = weights.get(name)
        if theirs is None:
            out.append(f"{name} {tuple(mine.shape)} is missing from the checkpoint")
        elif isinstance(theirs, torch.Tensor) and theirs.shape != mine.shape:
            out.append(f"{name} is {tuple(theirs.shape)} there, {tuple(mine.shape)} in this model")
    out += [f"{name} is not in this model" for name in weights if name not in own]
    if not out:
        return None
    return out[0] + (f"; {len(out) - 1} more tensors do not fit" if len(out) > 1 else "")


def _changed(store: CheckpointStore, cfg: JobConfig, section: str, key: str | None = None) -> str:
    """``section.key`` (or each key of ``section``) whose value in this job differs from the run's
    ``run.json`` config, with both values (redacted alike), e.g. ``task_args.d_model=64 (the run's:
    32)``; "" when none does or ``run.json`` cannot be read (logged)."""
    try:
        run = json.loads(store.storage.read_bytes("run.json")).get("config") or {}
    except (FileNotFoundError, StorageError, ValueError) as exc:
        logger.warning("could not read run.json to name the config's changes: %s", exc)
        return ""
    old, new = run.get(section) or {}, cfg.to_dict()[section]
    keys = [key] if key is not None else sorted(set(old) | set(new))

    def value(d: dict[str, Any], k: str) -> str:
        return repr(d[k]) if k in d else "unset"

    return ", ".join(
        f"{section}.{k}={value(new, k)} (the run's: {value(old, k)})"
        for k in keys
        if value(old, k) != value(new, k)
    )


def rollback_point(
    store: CheckpointStore, window: Window, keep_every: int = 0, in_memory: int | None = None
) -> tuple[Any, dict[str, Any]]:
    """Rank 0, restarting after a NaN loss whose steps ``window`` will be skipped: the newest verified
    checkpoint before the window, so that none of its batches is in the weights; when the newer ones
    kept (``checkpoint.keep_last``) leave none there, the newest before the window's last step (only the
    steps after it are skipped, then); none: the run's start. Every newer checkpoint is taken off the
    run's path: it trained batches now skipped, and a later recovery must never resume from it. What
    verified is not lost: the best and the milestones among them (steps that are multiples of
    ``keep_every``, ``checkpoint.keep_every_steps``) are set aside in ``checkpoints/discarded/``, the
    others deleted.

    ``in_memory``: the step of the ranks' copy before the window (``cluster.rank.rollback_points``). When no
    checkpoint between it and the window verifies, the run resumes from that copy (nothing read; ``None`` is
    returned for the checkpoint and ``memory_step`` is set)."""
    first, last = window
    loaded = None
    store.last_skipped = []
    if in_memory is None or any(in_memory < s < first for s in store.steps_on_storage()):
        loaded = store.load_latest(max_step=first - 1)
        passed = list(store.last_skipped)
        if loaded is None and in_memory is None and any(i.step < last for i in store.list()):
            loaded = store.load_latest(max_step=last - 1)
            passed += store.last_skipped
        store.last_skipped = passed
    if in_memory is not None and (loaded is None or loaded.info.step <= in_memory):
        loaded = None
    else:
        in_memory = None
    resume_step = loaded.info.step if loaded is not None else in_memory or 0
    off_path = store.discard_after(resume_step, keep_every=keep_every)
    aside = list(store.last_set_aside)
    return loaded, {
        "window": list(window),
        "checkpoint_step": resume_step if loaded else None,
        "memory_step": in_memory,
        "discarded": [s for s in off_path if s not in aside],  # deleted
        "set_aside": sorted(aside),
    }


def init_from(raw_model: nn.Module, rank: int, cfg: JobConfig) -> dict[str, Any]:
    """A new run's weights from another run's checkpoint (``training.init_from``): rank 0 picks the
    checkpoint, every rank loads that one (checksums verified) into its model. Every rank raises the
    same error when it cannot be used."""
    from cluster.run.restore import init_weights, load_checkpoint

    t, options = cfg.training, cfg.storage.options
    choice: list[Any] = [None, None]
    if rank == 0:
        try:
            choice = [load_checkpoint(t.init_from, t.init_from_step, options).url, None]  # type: ignore[arg-type]
        except (CheckpointError, ConfigError, StorageError) as exc:
            choice = [None, f"training.init_from={t.init_from!r}: {exc}"]
    dist.broadcast_object_list(choice, src=0)
    url, error = choice
    if error is not None:
        raise ConfigError(error)
    ckpt = load_checkpoint(url, None, options)
    report = init_weights(raw_model, ckpt.model, t.init_strict, url)
    return {"url": url, "step": ckpt.step, **report}


class Taken(NamedTuple):
    """What :func:`take_state` hands the worker: the wrapped model, optimizer and scheduler, where it
    resumes, the checkpoints skipped on the way, the new position and the step of the checkpoint resumed
    from (-1: none this process may count as written)."""

    model: DDP
    optimizer: torch.optim.Optimizer
    scheduler: Scheduler | None
    resume: ResumePoint
    skipped: list[tuple[int, str]]
    pos: RunPosition
    last_checkpoint: int


def take_state(
    task: Task,
    cfg: JobConfig,
    rank: int,
    world_size: int,
    pos: RunPosition,
    kept: Any,
    peers: PeerPlan | None,
    rollback: Window | None,
    raw_model: nn.Module,
    device: torch.device,
    sampler: ResumableDistributedSampler,
    store: CheckpointStore,
    memory: MemorySnapshots,
    t: dict[str, float],
) -> Taken:
    """Wrap the model and take the state to resume from: a peer's over the new group when ``peers`` is
    given (a survivor, ``kept``: its ``TrainSession``, keeps its own optimizer), else a checkpoint's (or a
    copy in memory, or the run's start). ``t``: the set-up's timings, to which this adds its marks."""
    total_steps = sampler.steps_per_epoch * cfg.training.epochs
    if peers is not None:
        if kept is not None:
            optimizer, scheduler = kept.optimizer, kept.scheduler
        else:
            optimizer, scheduler = _optimizer(task, cfg, raw_model, total_steps)
        # the same on every rank (a survivor's own may differ from a newcomer's)
        point, pos = receive(
            peers, rank, world_size, cfg.training.seed, device, raw_model, optimizer, scheduler, pos
        )
        t["peer_transfer"] = time.time()
        # every rank now holds the verified same parameters and buffers: DDP's own broadcast of rank 0's (a
        # model's worth of collectives across the whole group) would only repeat that
        model = ddp.wrap(raw_model, device, cfg, sync=False)
        t["ddp"] = time.time()
        return Taken(model, optimizer, scheduler, point, [], pos, -1)
    model = ddp.wrap(raw_model, device, cfg)
    optimizer, scheduler = _optimizer(task, cfg, raw_model, total_steps)
    t["ddp"] = time.time()
    point, skipped, pos = resume(
        store, rank, cfg, raw_model, optimizer, scheduler, pos, sampler, rollback, memory
    )
    # a checkpoint resumed from exists: an evaluation there never writes it again; any other state (a copy
    # in memory, the run's start) leaves the checkpoints this process wrote on another path
    last = point.global_step if point.source == "checkpoint" else -1
    t["checkpoint_load"] = time.time()
    return Taken(model, optimizer, scheduler, point, skipped, pos, last)


def _optimizer(
    task: Task, cfg: JobConfig, raw_model: nn.Module, total_steps: int
) -> tuple[torch.optim.Optimizer, Scheduler | None]:
    optimizer = ddp.build_optimizer(task, raw_model, cfg.training.zero)
    return optimizer, task.build_scheduler(optimizer, total_steps)
