"""cluster: fault-tolerant PyTorch DDP training on Ray.

from cluster import load_config, train
result = train(load_config("jobs/configs/tiny_cpu.yaml", ["name=demo"]))
"""

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
from cluster.driver import Driver, FailurePolicy, Result, train
from cluster.errors import (
    CheckpointError,
    ClusterError,
    ConfigError,
    ResourcesUnavailableError,
    StorageError,
    TrainingFailedError,
    WorkerError,
)
from cluster.load import Checkpoint, load_checkpoint, load_model
from cluster.parquet import ParquetDataset
from cluster.task import Task

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointError",
    "ClusterError",
    "ConfigError",
    "Driver",
    "FailureConfig",
    "FailurePolicy",
    "FaultSpec",
    "JobConfig",
    "ParquetDataset",
    "ResourcesUnavailableError",
    "Result",
    "ResumableDistributedSampler",
    "ScalingConfig",
    "StorageConfig",
    "StorageError",
    "Task",
    "TensorBatchDataset",
    "TrainingConfig",
    "TrainingFailedError",
    "WorkerError",
    "load_checkpoint",
    "load_config",
    "load_model",
    "read_parquet",
    "train",
]
