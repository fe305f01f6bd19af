"""cluster: fault-tolerant PyTorch DDP training on Ray.

from cluster import load_config, train
result = train(load_config("jobs/configs/tiny_cpu.yaml", ["name=demo"]))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cluster.core.imports import gc_paused

# torch's import (through cluster.data) is much of a rank's start: it takes less CPU without the collector
# (cluster.core.imports)
with gc_paused():
    from cluster.core.errors import (
        CheckpointError,
        ClusterError,
        ConfigError,
        DivergedError,
        FencedError,
        LeaseHeldError,
        ResourcesUnavailableError,
        StorageError,
        TrainingFailedError,
        WorkerError,
    )
    from cluster.data.parquet import ParquetDataset
    from cluster.data.pipeline import ResumableDistributedSampler, TensorBatchDataset, read_parquet
    from cluster.spec.config import (
        CheckpointConfig,
        FailureConfig,
        FaultSpec,
        JobConfig,
        ScalingConfig,
        StorageConfig,
        TrainingConfig,
    )
    from cluster.spec.load import load_config
    from cluster.spec.task import Task

if TYPE_CHECKING:
    from cluster.api.driver import Driver
    from cluster.api.dryrun import DryRunReport, dry_run
    from cluster.api.load import evaluate_checkpoint, load_model
    from cluster.api.submit import SubmittedJob, submit
    from cluster.api.train import train
    from cluster.driver.policy import FailurePolicy
    from cluster.driver.result import Result
    from cluster.inspect import run_metrics
    from cluster.run.goodput import Goodput, run_goodput
    from cluster.run.requests import request_stop
    from cluster.run.restore import Checkpoint, load_checkpoint

# Imported on first use: a worker process imports this package (its actor class lives in it) but never the
# driver, whose imports (pyarrow for the metrics files, tracking) cost each worker ~0.35 s of CPU at start.
_LAZY = {
    "Driver": "cluster.api.driver",
    "FailurePolicy": "cluster.driver.policy",
    "Result": "cluster.driver.result",
    "train": "cluster.api.train",
    "Checkpoint": "cluster.run.restore",
    "load_checkpoint": "cluster.run.restore",
    "load_model": "cluster.api.load",
    "evaluate_checkpoint": "cluster.api.load",
    "request_stop": "cluster.run.requests",
    "dry_run": "cluster.api.dryrun",
    "run_metrics": "cluster.inspect",
    "run_goodput": "cluster.run.goodput",
    "Goodput": "cluster.run.goodput",
    "submit": "cluster.api.submit",
    "SubmittedJob": "cluster.api.submit",
    "DryRunReport": "cluster.api.dryrun",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")


__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointError",
    "ClusterError",
    "ConfigError",
    "DivergedError",
    "Driver",
    "DryRunReport",
    "FailureConfig",
    "FailurePolicy",
    "FaultSpec",
    "FencedError",
    "Goodput",
    "JobConfig",
    "LeaseHeldError",
    "ParquetDataset",
    "ResourcesUnavailableError",
    "Result",
    "ResumableDistributedSampler",
    "ScalingConfig",
    "StorageConfig",
    "StorageError",
    "SubmittedJob",
    "Task",
    "TensorBatchDataset",
    "TrainingConfig",
    "TrainingFailedError",
    "WorkerError",
    "dry_run",
    "evaluate_checkpoint",
    "load_checkpoint",
    "load_config",
    "load_model",
    "read_parquet",
    "request_stop",
    "run_goodput",
    "run_metrics",
    "submit",
    "train",
]
