"""Validation of a job spec (``cluster.spec.config``), one function per section: values that cannot work are
refused with one :class:`~cluster.core.errors.ConfigError` naming the key and the fix, before anything
starts."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import TYPE_CHECKING, Any

from cluster.core.errors import ConfigError
from cluster.core.urls import url_problem
from cluster.spec.schedule import skip_windows

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TASK_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

if TYPE_CHECKING:
    from cluster.spec.config import (
        CheckpointConfig,
        EvaluationConfig,
        FailureConfig,
        FaultSpec,
        JobConfig,
        MetricsConfig,
        ScalingConfig,
        TrackingConfig,
        TrainingConfig,
    )


def validate(cfg: JobConfig) -> None:
    """Raise ConfigError naming the first impossible value and the fix (the sections in this order)."""
    _finite(cfg)
    _validate_job(cfg)
    _validate_scaling(cfg.scaling)
    _validate_training(cfg.training, cfg.scaling, cfg.effective_min_workers)
    _validate_checkpoint(cfg.checkpoint)
    _validate_evaluation(cfg.evaluation, cfg.checkpoint)
    _validate_failures(cfg.failures)
    _validate_tracking(cfg.tracking)
    _validate_metrics(cfg.metrics)
    _validate_injected_faults(cfg.failures.inject, cfg.scaling.num_workers)


def _finite(cfg: Any, prefix: str = "") -> None:
    """Every number of a float key (at any depth: ``scaling.resources_per_worker.NAME`` too) is finite.
    YAML's ``.nan`` and ``.inf`` are floats that pass every ``<`` and ``>`` check the sections make (a NaN
    hang timeout would turn hang detection off, a NaN wait would wait forever), so they are refused here,
    once, before the sections are checked."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        key, value = prefix + f.name, getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            _finite(value, key + ".")
            continue
        items = (
            value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        )
        for k, v in [(None, value), *items]:
            if isinstance(v, float) and not math.isfinite(v):
                where = key if k is None else f"{key}[{k}]" if isinstance(k, int) else f"{key}.{k}"
                optional = k is None and type(None) in typing.get_args(hints[f.name])
                raise ConfigError(
                    f"{where}={v!r} is not a finite number (YAML .nan and .inf are floats, but no setting "
                    f"can use them); give a number{', or null' if optional else ''}"
                )


SEED_MAX = 2**63 - 1
"""The largest ``training.seed``: torch's generators take 64-bit seeds and each epoch's permutation is
seeded ``seed + epoch`` (``cluster.data.pipeline.epoch_seed``), so a seed near 2**64 would fail epochs in."""

MIN_ORPHAN_TIMEOUT_S = 10.0
"""The shortest ``failures.orphan_timeout_s``: a few of the driver's pulses (``worker_group.pulse``)."""
MIN_HANG_TIMEOUT_S = 3.0
"""The shortest ``failures.hang_timeout_s``: the driver sees a rank's progress only at its heartbeat (every
second, and a heartbeat may take up to a second more to answer), so a shorter timeout would call a healthy
rank hung between two heartbeats."""


def _validate_job(cfg: JobConfig) -> None:
    """The job's own fields: name, task, storage."""
    if not _NAME_RE.match(cfg.name) or ".." in cfg.name:
        raise ConfigError(
            f"name={cfg.name!r} is not a valid run name; use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (no '/', no '..')"
        )
    if not _TASK_RE.match(cfg.task):
        raise ConfigError(f"task={cfg.task!r} must be an import path like 'package.module:ClassName'")
    problem = url_problem(cfg.storage.url)
    if problem is not None:
        raise ConfigError(problem)


def _validate_scaling(s: ScalingConfig) -> None:
    if s.num_workers < 1:
        raise ConfigError(f"scaling.num_workers={s.num_workers} must be at least 1")
    if s.min_workers is not None and not 1 <= s.min_workers <= s.num_workers:
        raise ConfigError(
            f"scaling.min_workers={s.min_workers} must be between 1 and scaling.num_workers={s.num_workers}"
        )
    if s.cpus_per_worker <= 0:
        raise ConfigError(f"scaling.cpus_per_worker={s.cpus_per_worker} must be positive")
    if not 0 < s.gpus_per_worker <= 1:
        raise ConfigError(
            f"scaling.gpus_per_worker={s.gpus_per_worker:g} must be in (0, 1]: a rank trains on one GPU "
            "(below 1, ranks share one)"
        )
    if s.backend == "nccl" and not s.use_gpu:
        raise ConfigError("scaling.backend=nccl needs scaling.use_gpu=true; CPU workers use gloo (auto)")
    if s.use_gpu and s.gpus_per_worker < 1 and s.backend != "gloo":
        raise ConfigError(
            f"scaling.gpus_per_worker={s.gpus_per_worker:g} puts several ranks on one GPU, which NCCL "
            "refuses (duplicate GPU); set scaling.backend=gloo, or scaling.gpus_per_worker=1"
        )
    if s.resource_wait_s <= 0:
        raise ConfigError(f"scaling.resource_wait_s={s.resource_wait_s} must be positive")
    if s.worker_niceness is not None and not -20 <= s.worker_niceness <= 19:
        raise ConfigError(
            f"scaling.worker_niceness={s.worker_niceness} is not a niceness; "
            "use -20..19 (0: normal priority) or null"
        )
    for k, v in s.resources_per_worker.items():
        if v < 0:
            raise ConfigError(f"scaling.resources_per_worker.{k}={v} must not be negative")


def _validate_training(t: TrainingConfig, s: ScalingConfig, min_workers: int) -> None:
    """``training``, and what it must agree with in ``scaling`` (``min_workers``: the effective one)."""
    if t.epochs < 1:
        raise ConfigError(f"training.epochs={t.epochs} must be at least 1")
    if t.grad_accum_steps < 1:
        raise ConfigError(f"training.grad_accum_steps={t.grad_accum_steps} must be at least 1")
    if not 0 <= t.seed <= SEED_MAX:
        raise ConfigError(
            f"training.seed={t.seed} is outside 0..2**63-1 ({SEED_MAX}), the seeds torch's generators take "
            "with room for each epoch's seed; pick a seed in that range"
        )
    if t.time_limit_s is not None and not t.time_limit_s > 0:
        raise ConfigError(f"training.time_limit_s={t.time_limit_s} must be positive seconds, or null")
    _validate_init_from(t)
    _validate_batch(t, s, min_workers)
    if t.grad_clip is not None and t.grad_clip <= 0:
        raise ConfigError(f"training.grad_clip={t.grad_clip} must be positive, or null to disable clipping")
    if t.max_steps_per_epoch is not None and t.max_steps_per_epoch < 1:
        raise ConfigError(f"training.max_steps_per_epoch={t.max_steps_per_epoch} must be at least 1, or null")
    if t.log_every_steps < 1:
        raise ConfigError(f"training.log_every_steps={t.log_every_steps} must be at least 1")
    if t.loader_workers < 0:
        raise ConfigError(
            f"training.loader_workers={t.loader_workers} must be 0 (fetch in the training thread) or positive"
        )
    if t.prefetch < 1:
        raise ConfigError(f"training.prefetch={t.prefetch} must be at least 1 (batches ahead per loader)")
    skip_windows(t.skip_steps)  # raises on a malformed entry
    if t.sync_batchnorm and not s.use_gpu:
        raise ConfigError(
            "training.sync_batchnorm=true needs scaling.use_gpu=true: torch's SyncBatchNorm runs only on "
            "GPUs. Set training.sync_batchnorm=false for a CPU job"
        )


def _validate_init_from(t: TrainingConfig) -> None:
    if t.init_from is not None:
        problem = url_problem(t.init_from, "training.init_from")
        if problem is not None:
            raise ConfigError(problem)
    elif t.init_from_step is not None:
        raise ConfigError(
            f"training.init_from_step={t.init_from_step!r} needs training.init_from: the run (or checkpoint "
            "folder) whose weights to start from"
        )
    if isinstance(t.init_from_step, int) and t.init_from_step < 0:
        raise ConfigError(
            f"training.init_from_step={t.init_from_step} must be a step (0 or more), best or null"
        )


def _validate_batch(t: TrainingConfig, s: ScalingConfig, min_workers: int) -> None:
    """The global batch splits evenly over the ranks and their accumulation steps, at full size and at
    ``min_workers``."""
    if t.global_batch_size < 1:
        raise ConfigError(f"training.global_batch_size={t.global_batch_size} must be at least 1")
    per_step = s.num_workers * t.grad_accum_steps
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} is not divisible by scaling.num_workers x "
            f"training.grad_accum_steps = {s.num_workers} x {t.grad_accum_steps} = {per_step}; "
            f"set training.global_batch_size to a multiple of {per_step}"
        )
    min_per_step = min_workers * t.grad_accum_steps
    if t.global_batch_size < per_step or t.global_batch_size < min_per_step:
        raise ConfigError(f"training.global_batch_size={t.global_batch_size} leaves a worker without samples")


def _validate_checkpoint(c: CheckpointConfig) -> None:
    if c.max_failed_commits < 1:
        raise ConfigError(
            f"checkpoint.max_failed_commits={c.max_failed_commits} must be at least 1 (checkpoints in a "
            "row that may fail before the run stops)"
        )
    if c.every_steps < 0:
        raise ConfigError(f"checkpoint.every_steps={c.every_steps} must be 0 (off) or positive")
    if c.every_epochs < 0:
        raise ConfigError(f"checkpoint.every_epochs={c.every_epochs} must be 0 (off) or positive")
    if c.best_metric is not None and not c.best_metric.strip():
        raise ConfigError(
            "checkpoint.best_metric is empty; name an evaluation metric (loss, or one compute_eval returns), "
            "or null for no best checkpoint"
        )
    if c.keep_every_steps < 0:
        raise ConfigError(f"checkpoint.keep_every_steps={c.keep_every_steps} must be 0 (off) or positive")
    if c.keep_every_steps and c.every_steps and c.keep_every_steps % c.every_steps:
        raise ConfigError(
            f"checkpoint.keep_every_steps={c.keep_every_steps} is not a multiple of checkpoint.every_steps="
            f"{c.every_steps}, so no checkpoint would land on it; use a multiple, e.g. "
            f"{c.every_steps * max(1, round(c.keep_every_steps / c.every_steps))}"
        )
    if c.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={c.keep_last} must be at least 1 (resuming needs one)")


def _validate_hang(f: FailureConfig) -> None:
    """The hang timeout's settings (their bound by the process-group timeout: ``_validate_failures``)."""
    if f.hang_timeout_s is not None and f.hang_timeout_s <= 0:
        raise ConfigError(
            f"failures.hang_timeout_s={f.hang_timeout_s} must be positive, or null for automatic"
        )
    if f.hang_timeout_s is not None and f.hang_timeout_s < MIN_HANG_TIMEOUT_S:
        raise ConfigError(
            f"failures.hang_timeout_s={f.hang_timeout_s:g} is shorter than the driver's heartbeat can "
            f"measure (a beat a second, answered within a second): use at least {MIN_HANG_TIMEOUT_S:g}, "
            "or null for automatic"
        )
    if f.hang_timeout_floor_s <= 0:
        raise ConfigError(f"failures.hang_timeout_floor_s={f.hang_timeout_floor_s} must be positive")
    if f.hang_timeout_min_s < MIN_HANG_TIMEOUT_S:
        raise ConfigError(
            f"failures.hang_timeout_min_s={f.hang_timeout_min_s:g} is shorter than the driver's heartbeat "
            f"can measure: use at least {MIN_HANG_TIMEOUT_S:g}"
        )
    if f.orphan_timeout_s < MIN_ORPHAN_TIMEOUT_S:
        raise ConfigError(
            f"failures.orphan_timeout_s={f.orphan_timeout_s:g} is too short: the ranks of a live driver "
            f"would take it for gone between two of its contacts; use at least {MIN_ORPHAN_TIMEOUT_S:g}"
        )
    if f.hang_warmup_steps < 0:
        raise ConfigError(f"failures.hang_warmup_steps={f.hang_warmup_steps} must be 0 or more")


def _validate_failures(f: FailureConfig) -> None:
    """``failures``, all but its injected faults (checked last, against the number of ranks)."""
    if f.max_failures < -1:
        raise ConfigError(f"failures.max_failures={f.max_failures} must be -1 (unlimited) or at least 0")
    _validate_hang(f)
    if f.backoff_s < 0 or f.backoff_max_s < f.backoff_s:
        raise ConfigError(
            f"failures.backoff_s={f.backoff_s} must be >= 0 and at most "
            f"failures.backoff_max_s={f.backoff_max_s}"
        )
    if f.slow_rank_ratio is not None and not f.slow_rank_ratio > 1:
        raise ConfigError(
            f"failures.slow_rank_ratio={f.slow_rank_ratio} must be above 1 (e.g. 1.5: a rank 50% slower than "
            "the others' median), or null to turn the check off"
        )
    if f.quarantine_after < 0:
        raise ConfigError(
            f"failures.quarantine_after={f.quarantine_after} must be 0 (never quarantine a node) or the "
            "number of incidents on one node that keep it out of the run"
        )
    if f.process_group_timeout_s <= 0:
        raise ConfigError(f"failures.process_group_timeout_s={f.process_group_timeout_s} must be positive")
    for name, value in (
        ("hang_timeout_s", f.hang_timeout_s),
        ("hang_timeout_floor_s", f.hang_timeout_floor_s),
    ):
        if value is not None and value >= f.process_group_timeout_s:
            raise ConfigError(
                f"failures.{name}={value:g} must be shorter than failures.process_group_timeout_s="
                f"{f.process_group_timeout_s:g}: a hung collective would otherwise time out first and be "
                "reported as a dead worker, not a hang. Lower it, or raise failures.process_group_timeout_s"
            )
    if f.nan_skip_steps < 0:
        raise ConfigError(
            f"failures.nan_skip_steps={f.nan_skip_steps} must be 0 (a NaN loss stops the run) or the number "
            "of steps to skip after rolling back"
        )
    if f.nan_skip_steps and not f.stop_on_nan:
        raise ConfigError(
            f"failures.nan_skip_steps={f.nan_skip_steps} rolls back on a NaN loss, but failures.stop_on_nan="
            "false trains on regardless (and commits checkpoints of NaN weights); set one of the two"
        )
    if f.nan_snapshot_steps < 0:
        raise ConfigError(
            f"failures.nan_snapshot_steps={f.nan_snapshot_steps} must be 0 (a NaN rollback reads the "
            "newest checkpoint before it) or how many steps apart each rank keeps a copy of its state to "
            "roll back to"
        )
    if f.replica_check_steps < 0:
        raise ConfigError(
            f"failures.replica_check_steps={f.replica_check_steps} must be 0 (no replica checks) or the "
            "number of steps between two checks of the ranks' parameters"
        )
    if f.preemption_margin_s < 0:
        raise ConfigError(
            f"failures.preemption_margin_s={f.preemption_margin_s} must be >= 0 (seconds before a drain's "
            "deadline by which the ranks must be off the node)"
        )


def _validate_injected_faults(inject: list[FaultSpec], num_workers: int) -> None:
    for i, spec in enumerate(inject):
        if not 0 <= spec.rank < num_workers:
            raise ConfigError(
                f"failures.inject[{i}].rank={spec.rank} is not a rank of this job (0..{num_workers - 1})"
            )
        if spec.step < 1:
            raise ConfigError(f"failures.inject[{i}].step={spec.step} must be at least 1")


def _validate_evaluation(e: EvaluationConfig, c: CheckpointConfig) -> None:
    """``evaluation``, and the best checkpoint its patience needs."""
    if e.every_epochs < 0:
        raise ConfigError(f"evaluation.every_epochs={e.every_epochs} must be 0 (off) or positive")
    if e.every_steps < 0:
        raise ConfigError(f"evaluation.every_steps={e.every_steps} must be 0 (off) or positive")
    if e.batch_size is not None and e.batch_size < 1:
        raise ConfigError(
            f"evaluation.batch_size={e.batch_size} must be positive, or null for the training micro-batch"
        )
    if e.loader_workers is not None and e.loader_workers < 0:
        raise ConfigError(
            f"evaluation.loader_workers={e.loader_workers} must be 0 or more, or null for "
            "training.loader_workers"
        )
    if e.max_batches is not None and e.max_batches < 1:
        raise ConfigError(f"evaluation.max_batches={e.max_batches} must be positive, or null for all")
    if e.patience is not None and e.patience < 1:
        raise ConfigError(f"evaluation.patience={e.patience} must be positive, or null for no early stopping")
    if e.patience is not None and c.best_metric is None:
        raise ConfigError(
            f"evaluation.patience={e.patience} stops the run when checkpoint.best_metric stops "
            "improving, but checkpoint.best_metric is null; set it (e.g. checkpoint.best_metric=loss)"
        )


def _validate_metrics(m: MetricsConfig) -> None:
    if not math.isfinite(m.flush_s) or m.flush_s < 0:
        raise ConfigError(
            f"metrics.flush_s={m.flush_s!r}: must be a number of seconds >= 0 (0: at every heartbeat)"
        )


def _validate_tracking(tr: TrackingConfig) -> None:
    import importlib.util

    url = tr.notify_url
    if url is not None and url.startswith("env:"):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", url[4:]):
            raise ConfigError(f"tracking.notify_url={url!r}: env: must be followed by a variable name")
    elif url is not None and (not url.startswith(("http://", "https://")) or not _host(url)):
        shown = url.partition("://")[0] + "://..." if "://" in url else "..."
        raise ConfigError(
            f"tracking.notify_url={shown!r} must be an http(s) URL of a webhook, or env:NAME to read it from "
            "the driver's environment"
        )

    if tr.flush_timeout_s < 0:
        raise ConfigError(f"tracking.flush_timeout_s={tr.flush_timeout_s} must be 0 or positive")
    if tr.queue_size < 1:
        raise ConfigError(f"tracking.queue_size={tr.queue_size} must be at least 1")
    if tr.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError(
            "tracking.tensorboard=true needs tensorboardX; pip install 'cluster[tensorboard]' "
            "(or set tracking.tensorboard=false)"
        )
    uri = tr.mlflow_uri
    if uri is None:
        return
    if not uri.strip():
        raise ConfigError(
            "tracking.mlflow_uri is empty; set it to the tracking server (http://host:5000) or null"
        )
    if "@" in uri.partition("://")[2].split("/", 1)[0]:
        raise ConfigError(
            "tracking.mlflow_uri has credentials in it; remove them and set MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment: the URI is logged"
        )
    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError(
            "tracking.mlflow_uri is set but MLflow is not installed; pip install 'cluster[mlflow]' "
            "(or set tracking.mlflow_uri=null)"
        )


def _host(url: str) -> str:
    return url.partition("://")[2].split("/", 1)[0].rpartition("@")[2]
