"""cluster: fault-tolerant PyTorch DDP training on Ray.

from cluster import load_config, train
result = train(load_config("jobs/configs/tiny_cpu.yaml", ["name=demo"]))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cluster.config import (
    CheckpointConfig,
    FailureConfig,
    FaultSpec,
    JobConfig,
    ScalingConfig,
    StorageConfig,
    TrainingConfig,
    load_config,
)
from cluster.data import ResumableDistributedSampler, TensorBatchDataset, read_parquet
from cluster.errors import (
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
from cluster.parquet import ParquetDataset
from cluster.task import Task

if TYPE_CHECKING:
    from cluster.api import Result, train
    from cluster.control import request_stop
    from cluster.driver import Driver
    from cluster.dryrun import DryRunReport, dry_run
    from cluster.goodput import Goodput, run_goodput
    from cluster.inspect import run_metrics
    from cluster.load import Checkpoint, evaluate_checkpoint, load_checkpoint, load_model
    from cluster.policy import FailurePolicy
    from cluster.submit import SubmittedJob, submit

# Imported on first use: a worker process imports this package (its actor class lives in it) but never the
# driver, whose imports (pyarrow for the metrics files, tracking) cost each worker ~0.35 s of CPU at start.
_LAZY = {
    "Driver": "cluster.driver",
    "FailurePolicy": "cluster.policy",
    "Result": "cluster.api",
    "train": "cluster.api",
    "Checkpoint": "cluster.load",
    "load_checkpoint": "cluster.load",
    "load_model": "cluster.load",
    "evaluate_checkpoint": "cluster.load",
    "request_stop": "cluster.control",
    "dry_run": "cluster.dryrun",
    "run_metrics": "cluster.inspect",
    "run_goodput": "cluster.goodput",
    "Goodput": "cluster.goodput",
    "submit": "cluster.submit",
    "SubmittedJob": "cluster.submit",
    "DryRunReport": "cluster.dryrun",
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
