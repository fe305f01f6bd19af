"""The train state besides the weights, and the run's position in it: one capture, one apply.

:class:`TrainState` is what ``train_state.pt`` of a checkpoint holds and what a peer sends with the weights
(:func:`payload`). :func:`capture` builds it from the optimizer, the scheduler and the :class:`RunPosition`;
:func:`apply` loads it (weights included) and returns the position it names. Checkpoints, peer transfers
and resumes all go through these two, so what is written and what is read cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import nn

from cluster.core.errors import CheckpointError
from cluster.data.pipeline import LEGACY_ORDER, ORDERS, TORCH_ORDER
from cluster.rank.evaluate import BestEval
from cluster.spec.schedule import Window, skip_windows

Scheduler = torch.optim.lr_scheduler.LRScheduler


@dataclass
class TrainState:
    """Everything besides the weights that exact resume needs: ``train_state.pt`` of a checkpoint.

    :meth:`state_dict` writes every field and :meth:`from_state_dict` reads every field back, so what is
    saved and what is loaded cannot drift apart. The sampler needs no state of its own: it is a pure
    function of (seed, sampler_order, epoch, step_in_epoch), and each step reseeds the RNGs from (seed, step,
    rank).
    """

    global_step: int
    """Optimizer steps done."""
    epoch: int
    """The epoch to continue in (the next one when the checkpoint was taken at an epoch's end)."""
    step_in_epoch: int
    """Steps of ``epoch`` already done."""
    world_size: int
    """Ranks of the group that wrote it; a different world size resumes at the same global sample."""
    seed: int
    """training.seed of the run; resuming with another seed would change the data order mid-run."""
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    sampler_order: int
    """How the run's sampler seeds each epoch's permutation (``cluster.data.pipeline.LEGACY_ORDER`` or
    ``TORCH_ORDER``): fixed for the life of a run, so a resumed run keeps its data order."""
    best_eval: dict[str, Any] | None = None
    """The best evaluation so far by ``checkpoint.best_metric``: ``value`` and ``step``, ``since`` (the
    evaluations after it, for ``evaluation.patience``) and ``last`` (the step of the latest one counted), so
    that a resumed run checkpoints only evaluations better than every earlier one, and stops as early."""
    skipped_steps: list[list[int]] = field(default_factory=list)
    """The run's skip windows (``training.skip_steps`` and NaN rollbacks), ``[first, last]`` each: a resumed
    run skips the same batches, also when the driver that rolled back is gone."""

    # Keys that checkpoints written by earlier versions carry and that resume does not need.
    LEGACY_KEYS = frozenset({"sample_offset", "rng"})
    # Fields that checkpoints written by earlier versions lack, with the value that reproduces what they did.
    OLD_DEFAULTS: ClassVar[dict[str, Any]] = {
        "sampler_order": LEGACY_ORDER,
        "best_eval": None,
        "skipped_steps": [],
    }

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], where: str = "train_state.pt") -> TrainState:
        names = {f.name for f in fields(cls)}
        state = {**cls.OLD_DEFAULTS, **state}
        missing = names - set(state)
        unknown = set(state) - names - cls.LEGACY_KEYS
        if missing or unknown:
            raise CheckpointError(
                f"{where} does not hold a train state of this version: missing {sorted(missing)}, unknown "
                f"{sorted(unknown)}. Resume with the version of cluster that wrote it, "
                "or start a new run name"
            )
        return cls(
            global_step=int(state["global_step"]),
            epoch=int(state["epoch"]),
            step_in_epoch=int(state["step_in_epoch"]),
            world_size=int(state["world_size"]),
            seed=int(state["seed"]),
            optimizer=state["optimizer"],
            scheduler=state["scheduler"],
            sampler_order=_sampler_order(state["sampler_order"], where),
            best_eval=state["best_eval"],
            skipped_steps=[[int(a), int(b)] for a, b in state["skipped_steps"]],
        )


def _sampler_order(value: Any, where: str) -> int:
    if value not in ORDERS:
        raise CheckpointError(
            f"{where} has sampler_order={value!r}, which this version does not know (it knows {ORDERS}). "
            "Resume with the version of cluster that wrote it, or start a new run name"
        )
    return int(value)


@dataclass
class RunPosition:
    """Where a rank's run stands: the part of the train state that is not the optimizer's. Replaced whole
    when the run's state changes hands (a reset, a release, a resume); advanced in place by the steps."""

    best: BestEval
    """The best evaluation so far (``TrainState.best_eval`` is its ``state``) and its early-stopping rule."""
    global_step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    sampler_order: int = TORCH_ORDER
    """A new run's; a resumed run keeps its checkpoint's."""
    skips: list[Window] = field(default_factory=list)
    """The run's skip windows: ``training.skip_steps``, the driver's and the checkpoint's."""

    @classmethod
    def start(cls, cfg: Any) -> RunPosition:
        """A new run's position under ``cfg`` (a ``JobConfig``): step 0, nothing evaluated yet."""
        c = cfg.checkpoint
        best = BestEval(c.best_metric, c.best_mode, cfg.evaluation.patience)
        return cls(best, skips=skip_windows(cfg.training.skip_steps))

    def at_epoch_start(self, steps_per_epoch: int) -> RunPosition:
        """The same position, at the start of the next epoch when the current one is done."""
        if self.step_in_epoch != steps_per_epoch:
            return self
        return dataclasses.replace(self, epoch=self.epoch + 1, step_in_epoch=0)


def capture(
    pos: RunPosition,
    world_size: int,
    seed: int,
    optimizer: torch.optim.Optimizer,
    scheduler: Scheduler | None,
    with_optimizer: bool = True,
) -> TrainState:
    """The train state at ``pos``. A sharded optimizer's ``state_dict`` needs ``consolidate_state_dict`` on
    every rank first; ``with_optimizer=False`` leaves the optimizer out."""
    return TrainState(
        global_step=pos.global_step,
        epoch=pos.epoch,
        step_in_epoch=pos.step_in_epoch,
        world_size=world_size,
        seed=seed,
        optimizer=optimizer.state_dict() if with_optimizer else {},
        scheduler=scheduler.state_dict() if scheduler is not None else None,
        sampler_order=pos.sampler_order,
        best_eval=pos.best.state,
        skipped_steps=[list(w) for w in pos.skips],
    )


def apply(
    state: TrainState,
    weights: dict[str, Any],
    raw_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Scheduler | None,
    pos: RunPosition,
) -> RunPosition:
    """Load ``weights`` and ``state`` into the model, optimizer and scheduler; return the position
    ``state`` names (best evaluation included; the skip windows stay ``pos``'s: the caller joins
    them)."""
    raw_model.load_state_dict(weights)
    optimizer.load_state_dict(state.optimizer)
    if scheduler is not None and state.scheduler is not None:
        scheduler.load_state_dict(state.scheduler)
    best = BestEval(pos.best.metric, pos.best.mode, pos.best.patience)
    best.state = state.best_eval
    return RunPosition(
        best, state.global_step, state.epoch, state.step_in_epoch, state.sampler_order, list(pos.skips)
    )


def payload(raw_model: nn.Module, state: TrainState) -> dict[str, Any]:
    """What a peer sends: exactly what a checkpoint holds (``model.pt`` and ``train_state.pt``)."""
    return {"model": raw_model.state_dict(), "train_state": state.state_dict()}


def checkpoint_files(raw_model: nn.Module, state: TrainState) -> dict[str, Any]:
    """A checkpoint's files: the unwrapped model's weights and the train state."""
    return {"model.pt": raw_model.state_dict(), "train_state.pt": state.state_dict()}
