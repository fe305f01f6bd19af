"""The job spec: typed dataclasses, one a section of the YAML file.

Every field has a docstring (the README's config reference is generated from them:
``cluster.spec.reference``). They are loaded from YAML, overridden with ``key=value`` and validated up front
by ``cluster.spec.load``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from cluster.core.errors import ConfigError
from cluster.core.redact import redact_config


@dataclass
class StorageConfig:
    url: str = "./runs"
    """A local folder or a writable fsspec URL (``s3://``, ``gs://``, ``abfs://`` with the extra of that
    name); runs go under ``<url>/<name>/``. Multi-node jobs need storage every node sees."""
    options: dict[str, Any] = field(default_factory=dict)
    """fsspec ``storage_options`` (credentials, ``endpoint_url``...). Never written to logs or run.json."""


@dataclass
class ScalingConfig:
    num_workers: int = 2
    """Number of DDP workers (ranks) the job wants: one Ray actor and one process each."""
    min_workers: int | None = None
    """Fewest workers the job may continue with after losing nodes (elastic). Defaults to num_workers."""
    use_gpu: bool = False
    """One GPU per worker and the NCCL backend; otherwise CPU workers over gloo."""
    gpus_per_worker: float = 1.0
    """GPUs reserved per worker with use_gpu. Below 1, ranks share a GPU (Ray's fractional GPUs): small
    models, tests. NCCL refuses two ranks on one GPU, so that needs backend gloo."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: auto is NCCL on GPUs, gloo on CPUs. gloo on GPUs is slower: for ranks that share
    a GPU, or to tell an NCCL problem from a training one."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per worker; also the worker's OMP_NUM_THREADS (rounded down, at least 1)."""
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    """Extra custom Ray resources each worker needs, e.g. ``{"trainer": 1}``."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement group strategy for the workers' bundles."""
    resource_wait_s: float = 60.0
    """How long to wait for the cluster to provide the workers' resources before giving up or shrinking."""
    socket_ifname: str | None = None
    """Network interface for gloo/NCCL traffic (sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in workers)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every worker process."""
    worker_niceness: int | None = 0
    """Niceness of the training processes (-20..19; Ray's workers run at 15, which lets any daemon stall
    the gang). Lowering needs CAP_SYS_NICE (docs/tuning.md). null keeps Ray's."""
    tune_allocator: bool = True
    """Keep glibc from returning freed memory to the kernel after each step (``mallopt``; docs/tuning.md)."""


@dataclass
class TrainingConfig:
    epochs: int = 1
    """Number of passes over the training set. Raising it on a finished run trains only the new epochs."""
    global_batch_size: int = 64
    """Samples per optimizer step across all workers; kept fixed when the job shrinks or grows."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step on each worker (gradients accumulate under ``no_sync``)."""
    seed: int = 0
    """Seeds the model init, the per-epoch data permutation and every per-step random stream."""
    amp: Literal["none", "bf16"] = "none"
    """Mixed precision: ``bf16`` autocast (no grad scaler needed) or ``none``."""
    grad_clip: float | None = None
    """Clip the global gradient norm to this value before each optimizer step; ``null`` disables."""
    max_steps_per_epoch: int | None = None
    """Cap on optimizer steps per epoch (shortens epochs for smoke tests); ``null`` uses the whole dataset."""
    log_every_steps: int = 10
    """Record per-step metrics (loss, lr, step time) every this many steps."""
    time_limit_s: float | None = None
    """Stop cleanly after this many seconds of this submission (a cluster's job time limit, a budget):
    every rank stops at the next step with a checkpoint there, status ``stopped``; resubmit to go on.
    ``null``: no limit."""
    fixed_buckets: bool = True
    """Keep DDP's first gradient-bucket layout all run, so a resume is bitwise exact beyond 2 ranks
    (docs/performance.md). ``false``: DDP's default."""
    sync_batchnorm: bool = False
    """BatchNorm layers become ``SyncBatchNorm`` (global-batch statistics). GPU jobs only."""
    zero: bool = False
    """Shard optimizer state across ranks (``ZeroRedundancyOptimizer``); checkpoints hold it whole."""
    compile: bool = False
    """``torch.compile`` the DDP model; checkpoints hold plain weights. CPU jobs need a C++ compiler."""
    deterministic: bool = False
    """Deterministic torch ops and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: a resumed GPU run is bitwise an
    uninterrupted one (CPU: always). Slower."""
    loader_workers: int = 0
    """Processes per worker preparing batches ahead (dataset must pickle); 0: none."""
    prefetch: int = 2
    """Batches each loader keeps ready."""
    init_from: str | None = None
    """Start a new run from another run's weights (fine-tuning): that run's URL, or one of its checkpoint
    folders. Only the model's weights: optimizer, step and data order start fresh. Ignored once this run
    has a checkpoint of its own (a resume)."""
    init_from_step: int | Literal["best"] | None = None
    """Which checkpoint of ``init_from``: a step, ``best`` (its ``checkpoint.best_metric``'s), or ``null``
    for its latest verified one."""
    init_strict: bool = True
    """Every weight of the model must come from ``init_from``, shapes equal. ``false``: load the weights
    whose names and shapes match, keep the model's own init for the rest (a new head), and report both."""
    skip_steps: list[int | str] = field(default_factory=list)
    """Steps whose global batches are not trained: ``[1450, "1201-1300"]`` (inclusive; steps count optimizer
    steps from 1). The data position, step count and learning-rate schedule move on as if trained (as
    Megatron's skip ranges): resubmit with the batches of a loss spike skipped. The windows a NaN rollback
    skipped (``failures.nan_skip_steps``) are added to these and kept in the run's checkpoints."""


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save a checkpoint every this many optimizer steps (0 disables step checkpoints)."""
    every_epochs: int = 1
    """Save a checkpoint at the end of every this many epochs (0 disables; the last epoch always saves)."""
    keep_last: int = 3
    """Verified checkpoints to keep; older ones are deleted (the newest verified one is never deleted)."""
    keep_every_steps: int = 0
    """Also keep, for good, every checkpoint whose step is a multiple of this (milestones to evaluate,
    fine-tune from, or roll back to; ``checkpoint.every_steps`` should divide it). 0: off."""
    async_save: bool = True
    """Copy state to host memory and upload in the background, so training is not stalled by storage."""
    best_metric: str | None = None
    """Also keep the checkpoint of the best evaluation of this metric (``loss``, or a metric the task's
    ``compute_eval`` returns), whatever ``keep_last`` says; an evaluation better than every earlier one
    checkpoints its step. Needs an eval set; ``load_model(run, step="best")`` loads it. null: off."""
    best_mode: Literal["min", "max"] = "min"
    """Whether a lower (``min``) or a higher (``max``) ``best_metric`` is better."""
    max_failed_commits: int = 3
    """Checkpoints in a row that may fail to commit (storage refusing writes) before the run stops as
    failed, naming the last good checkpoint: a job never trains on for long with nothing durable. The
    final checkpoint is written again before the run ends; if it still fails the run ends failed."""


@dataclass
class EvaluationConfig:
    """Evaluation on the task's ``build_eval_dataset`` (nothing happens for a task without one)."""

    every_epochs: int = 1
    """Evaluate at the end of every this many epochs (0 disables; the last epoch always evaluates)."""
    every_steps: int = 0
    """Also evaluate every this many optimizer steps (0 disables step evaluations)."""
    batch_size: int | None = None
    """Samples per evaluation forward on one rank; ``null``: the training micro-batch at
    ``scaling.num_workers``. The results do not depend on the world size (docs/runs.md)."""
    max_batches: int | None = None
    """Evaluate only the first this many batches of the eval set (a quick look at a large one); ``null``:
    all of it."""
    loader_workers: int | None = None
    """Processes per worker reading eval batches ahead (the eval set must pickle), kept between
    evaluations; ``null``: ``training.loader_workers``; 0: read in turn (or ahead in a thread for a
    dataset that says ``read_ahead``)."""
    at_start: bool = False
    """Also evaluate the initial model, before a new run's first step: a baseline (with
    ``checkpoint.best_metric`` it is the first best, checkpointed at step 0)."""
    patience: int | None = None
    """Early stopping: end the run when ``checkpoint.best_metric`` has not improved for this many
    evaluations in a row (checkpointed there; the best checkpoint is kept). ``null``: never."""


@dataclass
class FaultSpec:
    """A fault to inject on purpose, to rehearse recovery. Fires on the first attempt only."""

    rank: int = 0
    """Rank that misbehaves."""
    step: int = 1
    """Global step (1-based optimizer step count) at which it misbehaves, before running that step."""
    kind: Literal[
        "crash",
        "hang",
        "raise",
        "crash_in_checkpoint",
        "crash_in_backward",
        "crash_after_step",
        "crash_in_eval",
        "slow",
        "nan",
        "flip_bit",
    ] = "crash"
    """``crash``: the process is SIGKILLed before the step; ``hang``: it stops making progress;
    ``raise``: user code raises RuntimeError; ``crash_in_checkpoint``: rank 0 is SIGKILLed while writing
    the checkpoint of that step, after its files and before its manifest; ``crash_in_backward``: SIGKILLed
    in that step's backward pass, while the other ranks wait in its gradient all-reduce;
    ``crash_after_step``: SIGKILLed right after that step's optimizer update, before the next collective;
    ``crash_in_eval``: SIGKILLed in the evaluation after that step, after its first eval batch;
    ``slow``: from that step on, the rank sleeps 50 ms at the start of each step (it holds the others up);
    ``nan``: from that step on, the rank's loss is NaN (a diverged run); ``flip_bit``: one bit of the
    rank's first parameter is flipped before the step (silent data corruption: found by
    ``replica_check_steps``)."""
    attempt: int = 0
    """Attempt (0 = first start, 1 = after the first recovery...) on which it fires; -1 = every attempt."""


@dataclass
class FailureConfig:
    max_failures: int = 3
    """Failures survived before the job gives up; -1 means unlimited."""
    hang_timeout_s: float | None = None
    """Seconds without step progress before a worker counts as hung. ``null``: automatic, 10x the slowest
    observed step time and 3x the longest checkpoint stall, at least ``hang_timeout_floor_s`` while the
    group warms up and ``hang_timeout_min_s`` after (docs/failures.md)."""
    hang_timeout_floor_s: float = 60.0
    """Lower bound on the automatic hang timeout while a group warms up (before its first step too)."""
    hang_timeout_min_s: float = 10.0
    """Lower bound on the automatic hang timeout once a group is warm: it trained ``hang_warmup_steps``
    steps and, with checkpoints on, took one. Set it to ``hang_timeout_floor_s`` to keep that floor."""
    hang_warmup_steps: int = 100
    """Steps a group trains before its automatic hang timeout may drop below ``hang_timeout_floor_s``."""
    backoff_s: float = 1.0
    """The first restart after progress is immediate; a second failure before an epoch completes waits
    this long, doubling per failure up to ``backoff_max_s``."""
    backoff_max_s: float = 30.0
    """Upper bound on the restart wait."""
    orphan_timeout_s: float = 300.0
    """On a running Ray cluster (``ray job submit``, ``RAY_ADDRESS``) the ranks outlive a driver that dies:
    the next submission of the run adopts them (docs/failures.md). A group that no driver contacts for this
    many seconds stops by itself and frees its resources. The embedded Ray dies with its driver."""
    warm_restart: bool = True
    """After a failure, keep the healthy workers' processes and replace only the lost ones."""
    hot_spare: bool | Literal["auto"] = "auto"
    """CPU jobs: an idle, prepared process that replaces a dead worker at once (taken even while it still
    prepares: it is ahead of a new process). ``auto``: only where a node has a free CPU share, started with
    the group; ``true``: always, started after the ranks' setup (it shares their CPUs)."""
    recover_from_peers: bool = True
    """A survivor sends its in-memory state to a replacement: at most one step lost, no storage read; else
    the latest checkpoint (docs/failures.md)."""
    slow_rank_ratio: float | None = 1.5
    """Report a rank whose own part of each step (input, forward, backward: before it waits for the others)
    takes at least this many times the other ranks' median, over three heartbeats in a row: a
    ``slow_rank`` event and a console line naming its host (docs/failures.md). ``null``: off."""
    slow_rank_action: Literal["report", "move"] = "report"
    """What a slow rank gets: ``report`` (an event and a console line), or ``move``: also a replacement on
    another node, prepared while training goes on, that takes its place between two steps with the state
    of a healthy rank (as a drain notice's move; docs/failures.md). No room elsewhere: reported only."""
    quarantine_after: int = 2
    """A node involved in this many incidents of one run (a rank's process died there, the node was lost, a
    hang or a replica mismatch blamed on a rank there, a slow rank moved off it) gets no more ranks of the
    run, also after a resubmission; ``python -m cluster unquarantine`` releases it (docs/failures.md).
    ``0``: never."""
    process_group_timeout_s: float = 300.0
    """Timeout of collectives in the process group (init_process_group ``timeout``)."""
    preemption: bool = True
    """Act on Ray's drain notices (spot preemption): move ranks off a draining node before its deadline,
    losing no step (docs/failures.md)."""
    preemption_margin_s: float = 10.0
    """Ranks must be off a draining node this long before its deadline; else checkpoint, then shrink or
    wait."""
    stop_on_nan: bool = True
    """Stop the run when training diverges: a NaN or infinite loss (read at log steps and epoch ends) ends it
    with an error naming the step, without retries (an exact resume would diverge again); weights that are
    not finite are never committed as a checkpoint, so the good ones are kept."""
    nan_skip_steps: int = 0
    """``0``: a NaN or infinite loss stops the run (``stop_on_nan``). ``N`` > 0: it rolls back instead, to
    the newest state before the ``N`` steps that end at the first step whose loss was not finite (the ranks'
    copy in memory, ``nan_snapshot_steps``, or a checkpoint), skips those steps' batches (as
    ``training.skip_steps``) and trains on. Each rollback counts against
    ``max_failures`` (docs/failures.md)."""
    nan_snapshot_steps: int = 50
    """With ``nan_skip_steps``: every this many steps each rank keeps a host copy of its train state (the two
    newest), so that a rollback goes back to the newest copy before the skipped steps when it is newer than
    the newest checkpoint there: a few dozen steps recomputed, not up to a checkpoint interval, and no storage
    read (``cluster.rank.rollback_points``; docs/failures.md). Costs two host copies of the state per rank.
    ``0``: off."""
    replica_check_steps: int = 25
    """Every this many steps, and at every checkpoint before it is written, the ranks compare a digest of
    their parameters (one small all_gather): a rank that computed wrong numbers silently is found, the run
    rolls back to the newest checkpoint the replicas agreed on and that rank gets a new process
    (docs/failures.md). ``0``: off."""
    inject: list[FaultSpec] = field(default_factory=list)
    """Faults to inject (see FaultSpec). The env var CLUSTER_INJECT_FAULT=``rank:step:kind`` adds one."""


@dataclass
class MetricsConfig:
    flush_s: float = 30.0
    """Step rows reach storage at least this often while an epoch trains, each time as a file of their own
    written atomically: a driver killed mid-epoch (``ray job stop`` past its wait, an OOM, a lost head node)
    loses at most this window of rows. 0: at every heartbeat."""


@dataclass
class TrackingConfig:
    tensorboard: bool = False
    """Write TensorBoard event files into ``<run>/tensorboard/`` on any storage (docs/runs.md)."""
    mlflow_uri: str | None = None
    """MLflow tracking URI (``http://host:5000``): params, metrics, tags, final ``model.pt``; a
    resubmission continues the same MLflow run. Needs the ``mlflow`` extra."""
    mlflow_experiment: str = "cluster"
    """MLflow experiment the run is logged under (created when missing)."""
    flush_timeout_s: float = 30.0
    """At the end, wait at most this long for tracking to send what is queued (never during training)."""
    queue_size: int = 100_000
    """Rows and events queued per sink while it cannot send; beyond it the oldest are dropped (counted)."""
    notify_url: str | None = None
    """Webhook that gets a JSON POST (``{"text": ...}``: Slack, Mattermost, Teams and most chat tools take
    it) for each event of ``notify_events``. ``env:NAME`` reads the URL from the driver's environment
    variable NAME (webhook URLs are secrets; run.json never holds one)."""
    notify_events: list[str] = field(
        default_factory=lambda: [
            "failure",
            "run_failed",
            "finished",
            "stopped",
            "early_stopped",
            "slow_rank",
            "preemption_notice",
            "rollback",
        ]
    )
    """The events ``notify_url`` is told of (names as in the event log, docs/runs.md)."""


@dataclass
class JobConfig:
    name: str = "run"
    """Run name: the folder under ``storage.url``. Same name and storage = resume that run."""
    task: str = "jobs.tasks.charlm:CharLMTask"
    """Import path of the Task class, ``package.module:ClassName``; must be importable on every node."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the Task's constructor (model size, dataset URL, learning rate...)."""
    storage: StorageConfig = field(default_factory=StorageConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def effective_min_workers(self) -> int:
        return self.scaling.num_workers if self.scaling.min_workers is None else self.scaling.min_workers

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        """Plain dict of the spec, its secrets ``***`` (``cluster.core.redact.redact_config``: ``scaling.env``
        but its harmless names, ``storage.options``, secret-looking keys of ``task_args``, URLs' users and
        query values, the webhook's path) unless ``redact=False``: what every sink writes."""
        data = dataclasses.asdict(self)
        return redact_config(data) if redact else data


def resolve_notify_url(tr: TrackingConfig) -> str | None:
    """``tracking.notify_url`` with ``env:NAME`` read from the environment; ConfigError when unset."""
    url = tr.notify_url
    if url is None or not url.startswith("env:"):
        return url
    name = url[4:]
    value = os.environ.get(name, "").strip()
    if not value:
        raise ConfigError(
            f"tracking.notify_url={url!r}: the environment variable {name} is not set where the driver runs "
            "(with ray job submit, pass it in --runtime-env-json env_vars)"
        )
    return value
