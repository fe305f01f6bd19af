"""An MLP classifier over a Parquet dataset read with pyarrow through fsspec (local folder or s3://).

Write a dataset first: ``python -m jobs.make_tabular --out ./data/tabular``. With ``task_args.cache_mb``
the dataset is read lazily (``cluster.ParquetDataset``: larger than memory, row groups on demand).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cluster.data.parquet import ParquetDataset
from cluster.data.pipeline import TensorBatchDataset, read_parquet
from cluster.spec.task import Task


class TabularTask(Task):
    """task_args: dataset (URL, required), features (list of column names, default f0..f15),
    label ("label"), num_classes (4), hidden (128), lr (1e-3), storage_options ({}); cache_mb (read
    lazily within this many MiB of decoded rows; default: read it all into memory) and window (row groups
    shuffled together, 4); eval_dataset (URL of a held-out Parquet set with the same columns, evaluated at
    ``evaluation.*``; read lazily, one batch ahead, when cache_mb is set)."""

    def __init__(self, **args: Any) -> None:
        super().__init__(**args)
        if "dataset" not in args:
            from cluster.core.errors import ConfigError

            raise ConfigError("task_args.dataset is required: the URL of a Parquet file, folder or glob")
        self.features = list(args.get("features", [f"f{i}" for i in range(16)]))
        self.label = str(args.get("label", "label"))
        self.num_classes = int(args.get("num_classes", 4))

    def build_model(self) -> nn.Module:
        h = int(self.args.get("hidden", 128))
        return nn.Sequential(
            nn.Linear(len(self.features), h),
            nn.ReLU(),
            nn.Linear(h, h),
            nn.ReLU(),
            nn.Linear(h, self.num_classes),
        )

    def build_train_dataset(self) -> TensorBatchDataset | FeaturesAndLabel:
        return self._dataset(str(self.args["dataset"]))

    def build_eval_dataset(self) -> TensorBatchDataset | FeaturesAndLabel | None:
        url = self.args.get("eval_dataset")
        return self._dataset(str(url)) if url else None

    def _dataset(self, url: str) -> TensorBatchDataset | FeaturesAndLabel:
        if self.args.get("cache_mb") is not None:
            return FeaturesAndLabel(
                url,
                self.features,
                self.label,
                self.args.get("storage_options") or {},
                window=int(self.args.get("window", 4)),
                cache_mb=float(self.args["cache_mb"]),
            )
        cols = read_parquet(url, [*self.features, self.label], self.args.get("storage_options") or {})
        x = torch.stack([torch.as_tensor(cols[f], dtype=torch.float32) for f in self.features], dim=1)
        y = torch.as_tensor(cols[self.label]).long()
        if int(y.min()) < 0 or int(y.max()) >= self.num_classes:
            from cluster.core.errors import ConfigError

            raise ConfigError(
                f"label column {self.label!r} has values {int(y.min())}..{int(y.max())}, outside "
                f"0..{self.num_classes - 1}; set task_args.num_classes"
            )
        return TensorBatchDataset(x, y)

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        x, y = batch
        logits = model(x)
        accuracy = (logits.argmax(dim=-1) == y).float().mean().detach()  # a tensor: no device sync per step
        return nn.functional.cross_entropy(logits.float(), y), {"acc": accuracy}


class FeaturesAndLabel(ParquetDataset):
    """A lazy Parquet dataset whose batches are ``(features stacked as float32 [n, F], label as int64)``.
    Labels outside ``0..num_classes-1`` surface at the step that reads them (cross_entropy raises)."""

    def __init__(
        self,
        url: str,
        features: list[str],
        label: str,
        storage_options: dict[str, Any],
        window: int,
        cache_mb: float,
    ) -> None:
        dtypes = {**dict.fromkeys(features, "float32"), label: "int64"}
        super().__init__(url, [*features, label], storage_options, dtypes, window, cache_mb)
        self.n_features = len(features)

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cols = super().get_batch(indices)
        return torch.stack(cols[: self.n_features], dim=1), cols[self.n_features]
