"""How the driver tells the ends of a run it decides on: a run already complete before any worker starts,
a final checkpoint that did not commit, too many commits in a row that failed, and what a stop before the
group trained loses. Out of the state machine (``cluster.driver.driver``), so that it reads as decisions;
each function only reads the run's checkpoints and words the outcome."""

from __future__ import annotations

import logging

from cluster.core.errors import CheckpointError, TrainingFailedError
from cluster.driver.record import ended_early
from cluster.run.checkpoint import CheckpointInfo, CheckpointStore, CommitRecord
from cluster.seam.protocol import Salvage

logger = logging.getLogger("cluster.driver.driver")  # the state machine's log, where these were said


def complete_checkpoint(store: CheckpointStore, epochs: int, patience: int | None) -> CheckpointInfo | None:
    """The newest verified checkpoint, when it covers every epoch (or early stopping ended the run there):
    the run is already complete. None when the newest usable checkpoint leaves work to do."""
    for info in reversed(store.list()):
        if info.epoch < epochs and not ended_early(info, patience):
            return None  # the newest usable checkpoint (this or an older one) leaves work to do
        try:
            store.read_verified(info)
        except CheckpointError as exc:  # (a read that fails past its retries is raised: not "absent")
            logger.warning(
                "final checkpoint at step %d does not verify, looking further back: %s", info.step, exc
            )
            continue
        return info
    return None


def final_commit_failed(store: CheckpointStore, step: int, last_error: str | None) -> TrainingFailedError:
    """The run's error when its final checkpoint did not commit, also when written again."""
    infos = store.list()
    last = f"step {infos[-1].step} ({infos[-1].url})" if infos else "none"
    return TrainingFailedError(
        f"the final checkpoint at step {step} failed to commit, also when written "
        f"again ({last_error or 'no record of it'}). The last good "
        f"checkpoint: {last}; fix the storage, then rerun the same job to train the steps after "
        "it"
    )


def commits_would_fail(in_a_row: int, commits: list[CommitRecord], limit: int) -> bool:
    """Whether ``commits`` bring the failed commits in a row (``in_a_row`` before them) to ``limit``."""
    for c in commits:
        in_a_row = in_a_row + 1 if c.error else 0
    return in_a_row >= limit


def commits_failing(
    store: CheckpointStore, limit: int, in_a_row: int, last_error: str | None
) -> TrainingFailedError:
    """The run's error when ``checkpoint.max_failed_commits`` commits in a row failed."""
    infos = store.list()
    last = f"step {infos[-1].step}" if infos else "none"
    return TrainingFailedError(
        f"checkpoint.max_failed_commits={limit}: {in_a_row} checkpoints in a "
        f"row failed to commit (the last: {last_error}); nothing durable since "
        f"the last good checkpoint ({last}). Fix the storage, then rerun the same job to resume from "
        "it"
    )


def unstarted_loss(store: CheckpointStore, salvage: Salvage | None) -> str:
    """What a stop before the group trained loses: the steps the survivors of a failure held in memory past
    the newest checkpoint, or nothing."""
    held = max((p.global_step for p in (salvage.peers or {}).values()), default=0) if salvage else 0
    infos = store.list()
    newest = infos[-1].step if infos else 0
    return (
        f"; the survivors of the failure held step {held}, which is lost (steps {newest + 1}-{held})"
        if held > newest
        else ": nothing trained since the newest checkpoint"
    )
