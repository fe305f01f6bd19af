"""A worker's evaluations: each run on every rank together (``cluster.rank.evaluate``, which computes them),
with the eval set's loader processes kept from one to the next; each recorded as rank 0's ``eval`` row for
the driver and counted towards the best so far (``cluster.rank.evaluate.BestEval``, in the run position); and
what an evaluation adds to the checkpoint of its step (its values, its score, an early stop)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cluster.data.pipeline import EvalLoader
from cluster.rank.evaluate import EvalResult, evaluate
from cluster.rank.step import autocast
from cluster.rank.train_state import RunPosition
from cluster.spec.config import JobConfig
from cluster.spec.task import Task

if TYPE_CHECKING:
    from cluster.rank.session import TrainSession


class Evaluations:
    """The evaluations of one worker process (kept across warm restarts; :meth:`forget` at a reset)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.dataset: Any = None
        """The task's eval set; None: no evaluation. Set when the task is built."""
        self.last: tuple[int, dict[str, float]] | None = None
        """The latest evaluation: (step, loss and metrics)."""
        self.best_at: int | None = None
        """The step of an evaluation that became the best: checkpoint it."""
        self.batches = 0
        """Eval batches done in this process: progress for the hang watch."""
        self._loader: EvalLoader | None = None  # the eval set's loader processes, once started

    def forget(self) -> None:
        self.best_at, self.last = None, None

    def _reader(self, device: Any) -> Any:
        """The eval loader processes' reader (``evaluation.loader_workers``, default the training's), made
        at the first evaluation and kept; None to read in turn."""
        e, t = self.cfg.evaluation, self.cfg.training
        workers = e.loader_workers if e.loader_workers is not None else t.loader_workers
        if workers == 0:
            return None
        if self._loader is None or self._loader.broken:
            self._loader = EvalLoader(self.dataset, workers, t.prefetch, device)
        return self._loader.batches

    def run(
        self,
        task: Task,
        s: TrainSession,
        pos: RunPosition,
        rank: int,
        world_size: int,
        attempt: int,
        alive: Callable[[], None],
    ) -> tuple[EvalResult, dict[str, Any] | None]:
        """Evaluate at ``pos``'s step, on every rank together, calling ``alive`` at each batch's progress
        and once at the end; the best so far (``pos.best``) counts it. Returns the result and, on rank 0,
        its ``eval`` metric row for the driver."""

        def progress() -> None:
            self.batches += 1
            alive()

        step = pos.global_step
        res = evaluate(
            task,
            s.raw_model,
            self.dataset,
            self.cfg,
            step,
            rank,
            world_size,
            s.device,
            autocast=lambda: autocast(self.cfg, s.device),
            progress=progress,
            reader=self._reader(s.device),
        )
        progress()
        values = {"loss": res.loss, **res.metrics}
        self.last = (step, values)
        if pos.best.update(step, values):
            self.best_at = step
        if rank != 0:
            return res, None
        spe = s.sampler.steps_per_epoch
        at_end = pos.step_in_epoch == 0 and step > 0  # resumed at an epoch's end
        epoch, in_epoch = (pos.epoch - 1, spe) if at_end else (pos.epoch, pos.step_in_epoch)
        row = {
            "kind": "eval",
            "time": time.time(),
            "global_step": step,
            "epoch": epoch,
            "step_in_epoch": in_epoch,
            "loss": res.loss,
            "step_time_s": res.seconds,
            "samples_per_s": res.samples / res.seconds if res.seconds > 0 else 0.0,
            "world_size": world_size,
            "attempt": attempt,
            "eval_samples": res.samples,
            **{f"m_{k}": v for k, v in res.metrics.items()},
        }
        return res, row

    def checkpoint_meta(self, pos: RunPosition) -> dict[str, Any]:
        """What the checkpoint of ``pos``'s step records of the evaluation of this very model (nothing when
        none ran at that step): its values, its score by ``checkpoint.best_metric``, and an early stop."""
        step = pos.global_step
        if self.last is None or self.last[0] != step:
            return {}
        meta: dict[str, Any] = {"eval": self.last[1]}
        metric = self.cfg.checkpoint.best_metric
        if metric is not None:
            meta["score"] = {
                "metric": metric,
                "mode": self.cfg.checkpoint.best_mode,
                "value": self.last[1][metric],
            }
        if pos.best.stop_due(step) and pos.best.state is not None:
            meta["early_stopped"] = {**pos.best.state, "patience": self.cfg.evaluation.patience}
        return meta
