"""The run's record: what the driver writes about a run while it runs it, kept apart from the running.

One :class:`RunRecord` per driver. Each of its methods records one thing that happened, writing the event
(``events/NNNNNN.jsonl``), its console line and, where there are any, the metric rows (``metrics/``) and
tracking (TensorBoard, MLflow, notifications) together, so the driver's state machine only says *what*
happened. It also keeps what the run's :class:`cluster.driver.result.Result` reports (metrics, evaluations,
slow ranks).
"""

from __future__ import annotations

import itertools
import json
import logging
import platform
import time
from typing import Any, TextIO

import torch

from cluster.core.errors import ConfigError, Failure, StorageError
from cluster.core.events import console_line
from cluster.core.redact import redact_text, redact_tree
from cluster.driver.listeners import DriverListener
from cluster.driver.policy import Decision, SlowRank
from cluster.driver.states import RecoveryTiming
from cluster.driver.tracking import MlflowSink, Sink, TensorBoardSink, Tracker, WebhookSink
from cluster.run.checkpoint import CheckpointInfo, CommitRecord, step_dir
from cluster.run.folder import RunFolder
from cluster.run.goodput import Ledger, ledger_for
from cluster.run.lease import Lease
from cluster.run.logs import EventLog, ProgressDisplay, write_metrics
from cluster.run.requests import read_driver_file
from cluster.run.storage import Storage
from cluster.seam.peers import PeerPlan
from cluster.seam.preemption import Move
from cluster.seam.protocol import EpochResult, SetupInfo
from cluster.spec.config import JobConfig, resolve_notify_url
from cluster.spec.schedule import Window, eval_due

logger = logging.getLogger(__name__)

SUBMISSIONS = "submissions"

__version__ = "0.1.0"


def slow_report(r: SlowRank, host: str, step: int, attempt: int) -> dict[str, Any]:
    """A ``slow_rank`` event's fields (also ``Result.slow_ranks``)."""
    return {
        "rank": r.rank,
        "host": host,
        "step": step,
        "attempt": attempt,
        "ratio": round(r.ratio, 2),
        "compute_ms": round(r.compute_s * 1000, 1),
        "others_ms": round(r.others_s * 1000, 1),
        "step_ms": round(r.step_s * 1000, 1),
        "input_ms": round(r.input_s * 1000, 1),
        "others_input_ms": round(r.others_input_s * 1000, 1),
    }


class RunRecord(DriverListener):
    """Events, console lines, metric rows and tracking of one run (module doc): the driver's first listener
    (``cluster.driver.listeners``)."""

    def __init__(self, cfg: JobConfig, folder: RunFolder, out: TextIO) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.folder = folder
        """The run's folder (``cluster.run.folder``): the driver's, its checkpoints read here."""
        self.storage = folder.storage
        self.out = out
        self.events = EventLog(self.storage)
        self.display: ProgressDisplay | None = None
        self.tracker: Tracker | None = None
        self.rows: list[dict[str, Any]] = []  # rank 0's step rows streamed by heartbeats, not yet written
        self.evaluated: set[int] = set()  # global steps whose evaluation was recorded (any submission)
        self.last_eval: dict[str, Any] | None = None
        self.last_metrics: dict[str, Any] = {}
        self.slow_reports: list[dict[str, Any]] = []
        self._flushed_at = time.monotonic()  # rows last written (``metrics.flush_s``)
        self._created = time.time()
        self._started = False
        self.eval_total = 0  # batches of one evaluation (the live bar's total)
        self._live_step, self._live_evals = -1, 0  # the live bar's: step, and eval batches done then
        self.failed_in_a_row = 0
        self.last_commit_error = ""
        self.committed: dict[int, bool] = {}  # step -> whether a commit there succeeded (this submission)
        self.t0 = time.time()  # when the job was asked for (``cluster.train`` sets it): the ledger's start
        self.ledger = Ledger(self.t0)  # the goodput account (``cluster.run.goodput``), continued in ``open``

    # ------------------------------------------------------------------ the run's files
    def open(self) -> None:
        """``run.json`` (written by the run's first driver; later ones check their config against it and
        rewrite it once they started: :meth:`started`), this submission's config in ``submissions/``, the
        evaluations already recorded, and the tracking sinks."""
        try:
            previous = json.loads(self.storage.read_bytes("run.json"))
        except FileNotFoundError:
            previous = None
        history: list[dict[str, Any]] = []
        if previous is not None:
            check_compatible(previous.get("config", {}), self.cfg)
            history = self.events.records()
            self.evaluated = {int(r["global_step"]) for r in history if r.get("event") == "evaluation"}
            self._created = float(previous.get("created") or time.time())
        else:
            self._write_run_json()
        number = self._submit()
        previous = read_driver_file(self.storage) if history else None  # the last driver's last beat
        self.ledger = ledger_for(self.t0, number, history, previous)
        self.tracker = make_tracker(self.cfg, self.storage, self.events)
        if self.tracker is not None:
            self.events.listeners.append(self.tracker.event)

    def _write_run_json(self) -> None:
        info = {
            "name": self.cfg.name,
            "created": self._created,
            "config": self.cfg.to_dict(),
            "versions": {
                "cluster": __version__,
                "torch": torch.__version__,
                "ray": _ray_version(),
                "python": platform.python_version(),
            },
        }
        self.storage.write_atomic("run.json", json.dumps(info, indent=1, default=str).encode())

    def goodput_event(self, ended: bool = True) -> None:
        """The account as it stands (a ``goodput`` event; the run's end writes it with ``ended``)."""
        self.ledger.close()
        snap = self.ledger.snapshot(ended=ended)
        self.event("goodput", global_step=self.ledger.step, **snap)

    def _submit(self) -> int:
        """``submissions/NNNNNN.json``: each submission's config (redacted as in run.json), in order."""
        numbers = [int(n[:-5]) for n in self.storage.listdir(SUBMISSIONS) if n[:-5].isdigit()]
        number = max(numbers, default=0) + 1
        body = {"submission": number, "time": time.time(), "config": self.cfg.to_dict()}
        self.storage.write_atomic(f"{SUBMISSIONS}/{number:06d}.json", json.dumps(body, default=str).encode())
        return number

    def started(self) -> None:
        """A group of this submission set up and started (its checkpoint loaded into its model): ``run.json``
        now says this submission's config, the one the run continues with."""
        if not self._started:
            self._started = True
            self._write_run_json()

    def run_start(self, attempt: int, lease: Lease) -> None:
        self.event(
            "run_start",
            attempt=attempt,
            config=self.cfg.to_dict(),
            lease=lease.generation,
            took_over=lease.took_over.describe() if lease.took_over is not None else None,
        )

    def phase(self, name: str) -> None:
        self.ledger.enter(name)

    def track(self, rows: list[dict[str, Any]]) -> None:
        """Hand metric rows to tracking (returns at once) and record what the sinks reported."""
        if self.tracker is None:
            return
        self.tracker.rows(rows)
        for event, fields in self.tracker.notes():
            self.events.append(event, **fields)

    def run_ended(self, status: str, finished: bool) -> None:
        """Send the summary and wait for tracking (at most ``tracking.flush_timeout_s``); never raises."""
        tracker, self.tracker = self.tracker, None
        if tracker is None:
            return
        records = self.events.records()
        infos = self.folder.checkpoints.list()
        summary = {
            "status": status,
            "checkpoint": step_dir(infos[-1].step) if infos and finished else None,
            "attempts": sum(1 for r in records if r["event"] == "group_started"),
            "failures_survived": sum(1 for r in records if r["event"] == "recovered"),
        }
        try:
            left = tracker.close(summary)
            for event, fields in tracker.notes():
                self.events.append(event, **fields)
            if left is not None:
                self.events.append("tracking_incomplete", timeout_s=tracker.flush_timeout_s, **left)
        except Exception as exc:  # the run's own result must not be lost to a tracking problem
            logger.warning("closing tracking failed: %s: %s", type(exc).__name__, exc)

    # ------------------------------------------------------------------ console
    def print(self, text: str) -> None:
        """One console line (above the live bar when one is drawn)."""
        text = redact_text(text)
        if self.display is not None:
            self.display.line(text)
        else:
            self.out.write(text + "\n")
            self.out.flush()

    def event(self, kind: str, /, **fields: Any) -> None:
        """Write an event and, for the kinds the console shows (``cluster.core.events``), its console line."""
        record = self.events.append(kind, **redact_tree(fields))  # (a task's error may quote a secret)
        text = console_line(kind, record)
        if text is not None:
            self.print(f"[{self.name}] {text}")

    # ------------------------------------------------------------------ starting
    def adopted(self, pids: list[int], step: int, from_generation: int) -> None:
        self.ledger.adopted(step)  # the steps they trained with no driver are kept
        self.event("adopted", ranks=len(pids), step=step, from_generation=from_generation, pids=pids)

    def already_complete(self, global_step: int, early_stopped: bool) -> None:
        cfg = self.cfg
        self.event(
            "already_complete",
            global_step=global_step,
            early_stopped=early_stopped,
            epochs=cfg.training.epochs,
            patience=cfg.evaluation.patience,
        )

    def reserving(self, at: float) -> None:
        self.ledger.reserving(at)

    def reserved(self, at: float) -> None:
        self.ledger.reserved(at)

    def shrunk(self, old: int, new: int) -> None:
        s = self.cfg.scaling
        self.event(
            "resize",
            old=old,
            new=new,
            reason=f"resources for {s.num_workers} workers not available within {s.resource_wait_s:g}s",
            target=s.num_workers,
            min_workers=self.cfg.effective_min_workers,
        )

    def group_ready(
        self,
        attempt: int,
        infos: list[SetupInfo],
        seconds: float,
        spare_note: str,
        skips: list[Window],
        move: Move | None,
        t_ready: float,
    ) -> None:
        """A group is set up: the steps it skips, the checkpoints it passed over, the rollback it made, the
        live bar, the ``group_started`` event and its line saying where it starts (and this submission's
        config in ``run.json``); the move it finished is ``MoveRecord``'s."""
        head, r = infos[0], infos[0].resume
        self.ledger.skips = list(skips)  # steps that train no batch are neither kept nor redone
        for step, reason in head.skipped_checkpoints:
            self.event("checkpoint_skipped", step=step, reason=reason)
        if r.rollback is not None:
            self.rollback(r.rollback, r.global_step)
        self.display = ProgressDisplay(head.steps_per_epoch * self.cfg.training.epochs, self.out)
        self.ledger.started(attempt, r.global_step)
        niceness = sorted({i.niceness for i in infos})
        for note in niceness:
            if "not permitted" in note:
                self.print(f"[{self.name}] warning: workers run at niceness {note}")
        self.event(
            "group_started",
            attempt=attempt,
            world_size=len(infos),
            backend=head.backend,
            resume_step=r.global_step,
            resume_epoch=r.epoch,
            resume_step_in_epoch=r.step_in_epoch,
            resume_checkpoint=r.checkpoint_url,
            resume_world_size=r.world_size,
            resume_source=r.source,
            resume_peer=r.peer_source,
            init_from=r.init_from,
            pids=[i.pid for i in infos],
            nodes=[i.node_id for i in infos],
            hosts=sorted({i.hostname for i in infos}),
            seconds=round(seconds, 3),
            setup_s=_phase_max(infos),
            hot_spare=spare_note,
            allocator=sorted({i.allocator for i in infos}),
            niceness=niceness,
        )
        self.started()
        self.eval_total = head.eval_batches

    # ------------------------------------------------------------------ training
    def heartbeat(self, beats: list[Any], epoch: int, attempt: int) -> None:
        """The step rows rank 0 streams with its heartbeats: tracked at once, and written at least every
        ``metrics.flush_s`` (each time as a file of their own), so a driver killed mid-epoch loses at most
        that window of them."""
        live = [b for b in beats if b is not None]
        if live:
            firsts = [b.first_step_at for b in live if b.first_step_at is not None]
            step, at = max(b.global_step for b in live), max(b.last_step_at for b in live)
            self.ledger.progressed(step, at, min(firsts, default=None))
        for b in beats:
            if b is not None and b.rows:
                rows = self.arrived(b.rows)
                self.rows.extend(rows)
                self.track([{"kind": "step", **r} for r in rows])  # live in TensorBoard / MLflow
        if self.rows and time.monotonic() - self._flushed_at >= self.cfg.metrics.flush_s:
            rows, self.rows = self.rows, []
            self._write([{"kind": "step", **r} for r in rows], epoch, attempt)

    def _write(self, rows: list[dict[str, Any]], epoch: int, attempt: int) -> None:
        write_metrics(self.storage, rows, epoch, attempt, seq=self.events.count)
        self._flushed_at = time.monotonic()

    def arrived(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Metric rows as rank 0 hands them over; each new evaluation is recorded (event, console line)
        and one repeated after a recovery is dropped: it was recorded once already."""
        if not any(r.get("kind") == "eval" for r in rows):
            return rows
        out = []
        for r in rows:
            if r.get("kind") == "eval":
                if r["global_step"] in self.evaluated:
                    continue
                self.evaluation(r)
            out.append(r)
        return out

    def evaluation(self, row: dict[str, Any]) -> None:
        step = int(row["global_step"])
        self.evaluated.add(step)
        self.ledger.stall("evaluation", float(row.get("step_time_s") or 0.0))
        metrics = {k[2:]: v for k, v in row.items() if k.startswith("m_")}
        self.last_eval = {"global_step": step, "epoch": row["epoch"], "loss": row["loss"], **metrics}
        self.event(
            "evaluation",
            global_step=step,
            epoch=row["epoch"],
            loss=row["loss"],
            metrics=metrics,
            samples=row.get("eval_samples"),
            seconds=round(row["step_time_s"], 3),
            world_size=row.get("world_size"),
        )

    def live(self, beats: list[Any], step: int) -> None:
        """The live bar at a heartbeat: the step reached, or while the step stands still, an evaluation's
        batches done (of ``eval_total``) since it last moved."""
        assert self.display is not None
        done = sum(b.eval_batches for b in beats if b is not None)
        evaluating = None
        if step != self._live_step:
            self._live_step, self._live_evals = step, done
        elif done > self._live_evals:
            evaluating = done - self._live_evals
        self.display.live(step, self.cfg.training.global_batch_size, evaluating, self.eval_total)

    def eval_missing(self, step: int, steps_per_epoch: int) -> bool:
        """An evaluation is due right at ``step`` (where training resumes) and was never recorded: the
        failure took it (or its result) with it."""
        cfg = self.cfg
        return eval_due(step, steps_per_epoch, cfg.training.epochs, cfg.evaluation) and (
            step not in self.evaluated
        )

    def epoch_ended(
        self,
        head: EpochResult,
        wall_s: float,
        world_size: int,
        attempt: int,
        steps_per_epoch: int,
        recovery: RecoveryTiming | None,
    ) -> None:
        """A whole epoch: its step rows and epoch row, its checkpoints, ``epoch_end``, the console's epoch
        line and, the first after a recovery, ``recovered``."""
        assert self.display is not None
        cfg = self.cfg
        samples_per_s = head.samples / wall_s if wall_s > 0 else 0.0
        epoch_row = {
            "kind": "epoch",
            "time": time.time(),
            "global_step": head.global_step,
            "epoch": head.epoch,
            "step_in_epoch": steps_per_epoch,
            "loss": head.loss,
            "step_time_s": head.seconds / max(1, head.steps),
            "samples_per_s": samples_per_s,
            "checkpoint_stall_s": sum(c.stall_s for c in head.commits),
            "world_size": world_size,
            "attempt": attempt,
            "lr": next((r["lr"] for r in reversed(head.step_rows) if r.get("lr") is not None), None),
            **{f"m_{k}": v for k, v in head.metrics.items()},
        }
        streamed, self.rows = self.rows, []  # tracked as their heartbeats brought them
        unstreamed = [{"kind": "step", **r} for r in self.arrived(head.step_rows)] + [epoch_row]
        self._write([{"kind": "step", **r} for r in streamed] + unstreamed, head.epoch, attempt)
        self.track(unstreamed)
        self.commits(head.commits)
        self._ran(head)
        self.event(
            "epoch_end",
            epoch=head.epoch,
            global_step=head.global_step,
            loss=head.loss,
            seconds=round(wall_s, 3),
            samples_per_s=round(samples_per_s, 1),
            world_size=world_size,
            **({"skipped_steps": head.skipped} if head.skipped else {}),
            goodput=self.ledger.snapshot(),
        )
        self.last_metrics = {
            "epoch": head.epoch,
            "loss": head.loss,
            "samples_per_s": samples_per_s,
            "global_step": head.global_step,
            "epoch_seconds": wall_s,
            **head.metrics,
        }
        remaining_steps = (cfg.training.epochs - head.epoch - 1) * steps_per_epoch
        eta = remaining_steps * (wall_s / max(1, head.steps))
        self.display.epoch_line(
            head.epoch, cfg.training.epochs, head.global_step, head.loss, samples_per_s, eta
        )
        if recovery is not None and head.first_step_at is not None:
            self.recovered(recovery, head.first_step_at)

    def stretch_ended(self, head: EpochResult, attempt: int, recovery: RecoveryTiming | None) -> None:
        """A stopped epoch's step rows and checkpoints (its end is recorded by the epoch that finishes it)
        and, the first after a recovery, ``recovered``."""
        streamed, self.rows = self.rows, []
        rows = [{"kind": "step", **r} for r in streamed + self.arrived(head.step_rows)]
        if rows:
            self._write(rows, head.epoch, attempt)
            self.track(rows[len(streamed) :])
        self.commits(head.commits)
        self._ran(head)
        if recovery is not None and head.first_step_at is not None:
            self.recovered(recovery, head.first_step_at)

    def _ran(self, head: EpochResult) -> None:
        """The ledger's account of what a group trained until ``head``."""
        self.ledger.stall("input_stall", head.input_wait_s)
        start = head.global_step - head.steps - head.skipped
        self.ledger.ran(head.first_step_at, start, head.global_step)

    def flush_rows(self, more: list[dict[str, Any]], epoch: int, attempt: int) -> None:
        """After a failure: write every step row rank 0 logged before it (nothing recorded is lost)."""
        more = self.arrived(more)
        rows, self.rows = self.rows + more, []
        if rows:
            step_rows = [{"kind": "step", **r} for r in rows]
            self._write(step_rows, epoch, attempt)
            self.track(step_rows[len(rows) - len(more) :])  # the heartbeats' rows are tracked already

    def commits(self, commits: list[CommitRecord]) -> None:
        """Each commit's event (``checkpoint`` or ``checkpoint_failed``, and what retention quarantined);
        ``failed_in_a_row`` counts the commits that failed since the last one that did not."""
        for c in commits:
            self.ledger.stall("checkpoint_stall", c.stall_s)
            self.committed[c.step] = self.committed.get(c.step, False) or not c.error
            self.failed_in_a_row = self.failed_in_a_row + 1 if c.error else 0
            if c.error:
                self.last_commit_error = c.error
            for step, reason in c.quarantined:
                self.event("checkpoint_quarantined", step=step, found_at=c.step, reason=reason)
            if c.error:
                self.event("checkpoint_failed", step=c.step, error=c.error)
            else:
                self.event(
                    "checkpoint",
                    step=c.step,
                    epoch=c.epoch,
                    url=c.url,
                    bytes=c.bytes,
                    stall_s=round(c.stall_s, 4),
                    write_s=round(c.write_s, 3),
                )

    def spare_ready(self, attempt: int, prepare_s: float) -> None:
        self.event("spare_ready", attempt=attempt, prepare_s=round(prepare_s, 3))

    def slow_rank(self, r: SlowRank, host: str, step: int, attempt: int) -> None:
        report = self.slow_report(r, host, step, attempt)
        self.slow_reports.append(report)
        self.event("slow_rank", **report)

    slow_report = staticmethod(slow_report)

    def slow_rank_cleared(self, rank: int, host: str, step: int, attempt: int) -> None:
        self.event("slow_rank_cleared", rank=rank, host=host, step=step, attempt=attempt)

    # ------------------------------------------------------------------ ends
    def early_stopped(self, head: EpochResult) -> None:
        best = head.best or {}
        self.event(
            "early_stopped",
            global_step=head.global_step,
            metric=self.cfg.checkpoint.best_metric,
            best_step=best.get("step"),
            best_value=best.get("value"),
            evaluations_since_best=best.get("since"),
            patience=self.cfg.evaluation.patience,
        )

    def finished(self, global_step: int, loss: float, attempts: int) -> None:
        self.goodput_event()
        self.event(
            "finished",
            global_step=global_step,
            loss=loss,
            attempts=attempts,
            checkpoints=f"{self.storage.root}/checkpoints",
        )

    def grown(self, old: int, new: int, at_step: int) -> None:
        self.event("resize", old=old, new=new, reason="resources returned", at_step=at_step)

    def stop_requested(self, reason: str, stop_step: int, grace: str) -> None:
        self.event("stop_requested", reason=reason, stop_step=stop_step, note=grace or None)

    def stopped(
        self, reason: str, requested_at: float, global_step: int, committed: bool, note: str | None
    ) -> None:
        infos = self.folder.checkpoints.list()
        self.goodput_event()
        self.event(
            "stopped",
            reason=reason,
            global_step=global_step,
            checkpoint_step=infos[-1].step if infos else None,
            committed=committed,
            seconds=round(time.time() - requested_at, 3),
            note=note,
        )

    def run_failed(self, exc: BaseException) -> None:
        try:
            self.goodput_event()
        except StorageError as err:  # the failure's own event matters more
            logger.warning("could not record the run's goodput account: %s", err)
        self.event("run_failed", error=str(exc)[:4000])

    # ------------------------------------------------------------------ failures and recovery
    def failure(self, failure: Failure, attempt: int, step: int | None) -> None:
        self.ledger.failed()
        hang = failure.hang  # a hang: its suspect, as the ranks' stacks tell it (``cluster.driver.hang``)
        self.event(
            "failure",
            kind=failure.kind,
            rank=failure.rank,
            attempt=attempt,
            message=failure.message[-4000:],
            step=step,
            suspect=hang.suspect if hang is not None else None,
            told_by=hang.how if hang is not None else None,
            survivors_kept=hang.keep_survivors if hang is not None else None,
            hang_timeout_from=hang.timeout_from if hang is not None else None,
        )

    def decision(
        self, decision: Decision, plan: PeerPlan | None, fallback: str, rollback: Window | None = None
    ) -> None:
        """What the failure policy decided, and (on a restart) where the state comes from."""
        more = {"rollback": list(rollback)} if rollback is not None and decision.restart else {}
        self.event(
            "decision",
            restart=decision.restart,
            reason=decision.reason,
            delay_s=decision.delay_s,
            source=None if not decision.restart else "peers" if plan is not None else "checkpoint",
            fallback=fallback or None,
            peer_source=plan.source if plan is not None else None,
            peer_step=plan.global_step if plan is not None else None,
            **more,
        )

    def recovered(self, timing: RecoveryTiming, first_step_at: float) -> None:
        phases = timing.phases(first_step_at)
        self.event(
            "recovered",
            kind=timing.kind,
            source=timing.source,
            fallback=timing.fallback or None,
            resume_step=timing.resume_step,
            lost_steps=timing.lost_steps,
            bytes=timing.nbytes,
            storage_reads=timing.storage_reads,
            storage_read_bytes=timing.storage_read_bytes,
            reused_workers=timing.reused_workers,
            spare=timing.spare,
            **{k: round(v, 3) for k, v in phases.items()},
        )

    def rollback(self, back: dict[str, Any], resume_step: int) -> None:
        first, last = back["window"]
        trained = max(first, resume_step + 1)  # the window's steps the resumed weights have not trained
        self.event(
            "rollback",
            window=[first, last],
            skipped=[trained, last],
            checkpoint_step=back["checkpoint_step"],
            memory_step=back.get("memory_step"),
            discarded=back["discarded"],
            set_aside=back.get("set_aside", []),
            resume_step=resume_step,
        )


def make_tracker(cfg: JobConfig, storage: Storage, events: EventLog) -> Tracker | None:
    """The run's tracking sinks (``tracking``: TensorBoard, MLflow, a webhook), or None without any."""
    tr = cfg.tracking
    sinks: list[Sink] = []
    if tr.tensorboard:
        sinks.append(TensorBoardSink(storage))
    if tr.mlflow_uri:
        config = cfg.to_dict()
        history = events.records()
        sinks.append(MlflowSink(tr.mlflow_uri, tr.mlflow_experiment, storage, config, cfg.name, history))
    url = resolve_notify_url(tr)
    if url:
        sinks.append(WebhookSink(url, tr.notify_events, cfg.name, storage.root))
    return Tracker(sinks, tr.queue_size, tr.flush_timeout_s) if sinks else None


def _phase_max(infos: list[SetupInfo]) -> dict[str, float]:
    """Slowest rank's seconds per setup phase (each phase ends at the named timestamp)."""
    out: dict[str, float] = {}
    for info in infos:
        marks = list(info.timings.items())
        for (_, t0), (name, t1) in itertools.pairwise(marks):
            out[name] = max(out.get(name, 0.0), round(t1 - t0, 3))
    return out


def check_compatible(previous: dict[str, Any], cfg: JobConfig) -> None:
    """Refuse to resume a run with a config that would change what its checkpoints mean."""
    now = cfg.to_dict()
    for section, key in (("", "task"), ("training", "global_batch_size"), ("training", "seed")):
        old = previous.get(section, {}).get(key) if section else previous.get(key)
        new = now[section][key] if section else now[key]
        if old is not None and old != new:
            name = f"{section}.{key}" if section else key
            raise ConfigError(
                f"{name}={new!r} differs from {old!r} in the existing run {cfg.name!r}; "
                "resuming would mix two "
                f"different trainings. Keep {name}={old!r}, or choose a new name (--set name=...)"
            )


def ended_early(info: CheckpointInfo, patience: int | None) -> bool:
    """The checkpoint early stopping wrote at the run's end, and this job stops as early: with the same
    ``evaluation.patience`` (or a smaller one) a resubmission has nothing to train."""
    stopped = info.manifest.get("early_stopped")
    return isinstance(stopped, dict) and patience is not None and int(stopped.get("since", 0)) >= patience


def _ray_version() -> str:
    """Ray's version, from its installed metadata (the driver imports no Ray of its own)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ray")
    except PackageNotFoundError:  # pragma: no cover
        return "missing"
