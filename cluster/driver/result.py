"""What a run returns (:class:`Result`), read from where its driver ended."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from cluster.core.errors import Failure, StorageError
from cluster.driver.control import RunControl
from cluster.driver.record import RunRecord
from cluster.driver.states import Failed, State, Stopped
from cluster.run.folder import RunFolder
from cluster.run.goodput import Goodput
from cluster.spec.config import JobConfig
from cluster.spec.schedule import Window

logger = logging.getLogger(__name__)


@dataclass
class Result:
    """What a finished (or failed) run returns."""

    name: str
    run_url: str
    status: str
    epochs_completed: int
    global_step: int
    metrics: dict[str, Any]
    latest_checkpoint: str | None
    attempts: int
    failures: list[dict[str, Any]] = field(default_factory=list)
    world_size: int = 0
    error: str | None = None
    slow_ranks: list[dict[str, Any]] = field(default_factory=list)
    """Each ``slow_rank`` event of this submission: a rank that held the others up (docs/failures.md)."""
    evaluation: dict[str, Any] | None = None
    """The latest evaluation of this submission (``global_step``, ``epoch``, ``loss`` and the task's eval
    metrics); None when the task has no eval set or none ran."""
    stopped_early: bool = False
    """Early stopping (``evaluation.patience``) ended the run before its last epoch."""
    goodput: Goodput | None = None
    """Where the run's wall clock went, every second in one class, and its ETTR (docs/goodput.md): for the
    whole run, across submissions, and per attempt."""
    stop_reason: str | None = None
    """With status ``stopped``: who asked (``SIGINT``, ``SIGTERM``, ``python -m cluster stop by ...``). The
    ranks stopped at ``global_step`` with a checkpoint there; resubmitting the same job resumes from it."""
    skipped_steps: list[tuple[int, int]] = field(default_factory=list)
    """The run's skip windows (first and last step, inclusive): ``training.skip_steps`` and each NaN
    rollback's (``failures.nan_skip_steps``). Their batches were not trained."""


class Ended(Protocol):
    """What :func:`result_of` reads of a driver whose run ended (:class:`cluster.driver.driver.Driver`)."""

    cfg: JobConfig
    folder: RunFolder
    state: State
    control: RunControl
    record: RunRecord
    epoch: int
    global_step: int
    attempt: int
    failures: list[Failure]
    world_size: int
    stopped_early: bool
    skips: list[Window]


def result_of(driver: Ended) -> Result:
    """What a driver's run returns, from where it ended."""
    try:
        infos = driver.folder.checkpoints.list()
    except StorageError as exc:  # the result is still returned (or its error raised)
        logger.warning("could not list the run's checkpoints for its result: %s", exc)
        infos = []
    state, stop = driver.state, driver.control.stop
    error = state.error if isinstance(state, Failed) else None
    return Result(
        name=driver.cfg.name,
        run_url=driver.folder.url,
        status=state.name,
        epochs_completed=driver.epoch,
        global_step=driver.global_step,
        metrics=driver.record.last_metrics,
        latest_checkpoint=infos[-1].url if infos else None,
        attempts=driver.attempt + 1,
        failures=[{"kind": f.kind, "rank": f.rank, "message": f.message[:2000]} for f in driver.failures],
        world_size=driver.world_size,
        error=str(error) if error is not None else None,
        slow_ranks=list(driver.record.slow_reports),
        evaluation=driver.record.last_eval,
        stopped_early=driver.stopped_early,
        skipped_steps=list(driver.skips),
        stop_reason=stop.reason if isinstance(state, Stopped) and stop is not None else None,
        goodput=driver.record.ledger.goodput(driver.record.ledger.ended_at),
    )


def result_to_json(result: Result) -> str:
    """``python -m jobs.train --result-json``'s file."""
    return json.dumps(asdict(result), indent=1, default=str)
