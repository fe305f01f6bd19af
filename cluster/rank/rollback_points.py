"""Rollback points in memory: every ``failures.nan_snapshot_steps`` steps each rank keeps a host copy of its
train state (model weights and the train state a checkpoint holds), the two newest, so that a rollback after
a loss that was not finite (``failures.nan_skip_steps``) resumes from the newest copy before the skipped
steps instead of the newest checkpoint there: a few dozen steps trained again instead of up to a checkpoint
interval, and nothing read from storage.

The ranks use a copy only when every rank of the new group holds one at that step and all of them have the
same digest (``cluster.rank.peer_transfer.state_digest``): a rank that started afresh (it holds none) or that
disagrees sends the rollback to the checkpoint, as before. A copy is a state every rank reached on the run's
path, so a resume from it is as exact as one from a checkpoint at that step. The copies are dropped past any
state a group resumes from (they would belong to a path the run left).

The copies are taken on the training thread at a step boundary (a device-to-host copy, into host buffers
reused from the copy two before: no allocation once warm). Not with a sharded optimizer
(``training.zero``): one rank's optimizer state is not the whole state; the rollback then reads the
checkpoint, and a line in the log says so once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from cluster.rank.ddp import unsendable
from cluster.rank.peer_transfer import state_digest
from cluster.rank.train_state import RunPosition, capture, checkpoint_files
from cluster.run.checkpoint import HostBuffers, snapshot
from cluster.spec.config import JobConfig

logger = logging.getLogger(__name__)

KEEP = 2
"""Copies kept per rank: the newest may hold a step the rollback skips (its loss was already not finite,
found at the next log step), the one before it then does not."""


class MemorySnapshots:
    """One rank's rollback points. ``every`` is 0 (off) unless the config rolls back on a NaN loss."""

    def __init__(self, cfg: JobConfig, keep: int = KEEP) -> None:
        f = cfg.failures
        self.every = f.nan_snapshot_steps if (f.nan_skip_steps and f.stop_on_nan) else 0
        self.keep = keep
        self.seed = cfg.training.seed
        self._held: list[
            tuple[int, dict[str, Any], HostBuffers]
        ] = []  # (step, files, their buffers), oldest first
        self._spare: HostBuffers | None = None  # buffers of a copy dropped, reused by the next
        self._refused = False  # the optimizer's state is sharded: no copies

    @property
    def on(self) -> bool:
        return self.every > 0

    def steps(self) -> list[int]:
        return [step for step, _, _ in self._held]

    def after_step(self, session: Any, pos: RunPosition, world_size: int) -> bool:
        """At a step boundary (every rank at the same step): copy the state when the step is due. Returns
        whether it copied."""
        if not self.every or self._refused or pos.global_step <= 0 or pos.global_step % self.every:
            return False
        why = unsendable(session.optimizer)
        if why:  # ``on`` stays as the config says: every rank still takes part in rollback_step's gather
            logger.warning(
                "failures.nan_snapshot_steps: no copies in memory (%s); a rollback reads the checkpoint", why
            )
            self._refused = True
            return False
        at = pos.at_epoch_start(session.sampler.steps_per_epoch)
        state = capture(at, world_size, self.seed, session.optimizer, session.scheduler)
        if len(self._held) >= self.keep:
            _, _, pool = self._held.pop(0)
        else:
            pool, self._spare = self._spare or HostBuffers(), None
        files = snapshot(checkpoint_files(session.raw_model, state), pool)
        self._held.append((pos.global_step, files, pool))
        return True

    def files(self, step: int) -> dict[str, Any]:
        """The copy at ``step``, as a checkpoint's files (``model.pt``, ``train_state.pt``)."""
        for held, files, _ in self._held:
            if held == step:
                return files
        raise KeyError(f"no copy in memory at step {step} (held: {self.steps()})")

    def digests(self, before: int) -> dict[int, str]:
        """The digest of each copy at a step before ``before``."""
        return {step: state_digest(files)[0] for step, files, _ in self._held if step < before}

    def drop_after(self, step: int) -> None:
        """A group resumed at ``step``: the copies past it belong to a path the run left."""
        while self._held and self._held[-1][0] > step:
            _, _, pool = self._held.pop()
            self._spare = pool

    def clear(self) -> None:
        self.drop_after(-1)


def agreed_step(gathered: list[dict[int, str]]) -> int | None:
    """The newest step at which every rank holds a copy with the same digest; None when there is none (a rank
    holds none, or they differ)."""
    if not gathered or any(not g for g in gathered):
        return None
    common = set(gathered[0]).intersection(*gathered[1:])
    same = [s for s in common if len({g[s] for g in gathered}) == 1]
    return max(same) if same else None


def rollback_step(memory: MemorySnapshots | None, before: int) -> int | None:
    """Every rank of the new group, in a rollback whose skipped steps begin at ``before``: the step of the
    copy in memory every rank agrees on (one ``all_gather_object`` of the digests), or None. Called on
    every rank or none (the config decides ``memory.on`` alike on every rank)."""
    if memory is None or not memory.on:
        return None
    mine = memory.digests(before)
    gathered: list[dict[int, str]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    return agreed_step(gathered)
