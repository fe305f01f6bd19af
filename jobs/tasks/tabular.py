"""An MLP classifier over a Parquet dataset read with pyarrow through fsspec (local folder or s3://).

Write a dataset first: ``python -m jobs.make_tabular --out ./data/tabular``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cluster import Task, TensorBatchDataset, read_parquet


class TabularTask(Task):
    """task_args: dataset (URL, required), features (list of column names, default f0..f15),
    label ("label"), num_classes (4), hidden (128), lr (1e-3), storage_options ({})."""

    def __init__(self, **args: Any) -> None:
        super().__init__(**args)
        if "dataset" not in args:
            from cluster import ConfigError

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

    def build_train_dataset(self) -> TensorBatchDataset:
        cols = read_parquet(
            str(self.args["dataset"]), [*self.features, self.label], self.args.get("storage_options") or {}
        )
        x = torch.stack([torch.as_tensor(cols[f], dtype=torch.float32) for f in self.features], dim=1)
        y = torch.as_tensor(cols[self.label]).long()
        if int(y.min()) < 0 or int(y.max()) >= self.num_classes:
            from cluster import ConfigError

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
