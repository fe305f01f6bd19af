"""Data: the resumable distributed sampler, and Parquet datasets read with pyarrow through fsspec.

Sampler contract: epoch ``e`` trains the global permutation ``perm(seed, e)`` of the dataset in order,
``global_batch_size`` samples per step. At step ``s`` rank ``r`` of ``W`` takes
``perm[s*B:(s+1)*B][r::W]``, which is exactly what ``torch.utils.data.DistributedSampler(shuffle=True,
seed=seed, drop_last=True)`` gives rank ``r`` after ``set_epoch(e)``, ``B/W`` samples per step: ``perm`` is
``randperm`` seeded with ``seed + e``, as there (runs begun before that, with another seed than 0, keep
their own order: :data:`LEGACY_ORDER`). Because a step's global batch does not depend on ``W``, a run
resumed at step ``s`` (global sample offset ``s*B``) with any world size trains the rest of the epoch
without repeating or skipping a sample.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from cluster.errors import ConfigError

LEGACY_ORDER = 1
"""Epoch ``e`` permutes with ``randperm`` seeded ``seed * 1_000_003 + e``: runs started before order 2."""
TORCH_ORDER = 2
"""Epoch ``e`` permutes with ``randperm`` seeded ``seed + e``, as ``DistributedSampler`` does: new runs."""
ORDERS = (LEGACY_ORDER, TORCH_ORDER)


def epoch_seed(seed: int, epoch: int, order: int) -> int:
    """The seed of epoch ``epoch``'s permutation under ``order`` (for seed 0 both orders agree)."""
    if order == TORCH_ORDER:
        return seed + epoch
    if order == LEGACY_ORDER:
        return seed * 1_000_003 + epoch
    raise ValueError(f"unknown sampler order {order}; known: {ORDERS}")


class ResumableDistributedSampler(Sampler[torch.Tensor]):
    """Yields, for one rank, the index tensor of its share of each step's global batch.

    ``order`` picks how each epoch's permutation is seeded (:data:`TORCH_ORDER` for new runs; a resumed run
    keeps the order its checkpoint was written with, see ``TrainState.sampler_order``)."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        max_steps_per_epoch: int | None = None,
        order: int = TORCH_ORDER,
    ) -> None:
        if num_samples < global_batch_size:
            raise ConfigError(
                f"the dataset has {num_samples} samples, fewer than training.global_batch_size="
                f"{global_batch_size}; lower the batch size or use more data"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.order = order
        self.max_steps_per_epoch = max_steps_per_epoch
        self.epoch = 0
        self.start_step = 0
        self._perm: torch.Tensor | None = None
        self._perm_key: tuple[int, int] | None = None  # (epoch, order) of _perm

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch (the remainder is dropped, as with ``drop_last=True``)."""
        steps = self.num_samples // self.global_batch_size
        return min(steps, self.max_steps_per_epoch) if self.max_steps_per_epoch else steps

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Select the epoch's permutation and where in it to start (resume)."""
        if not 0 <= start_step <= self.steps_per_epoch:
            raise ValueError(f"start_step={start_step} outside 0..{self.steps_per_epoch}")
        if self._perm is None or self._perm_key != (epoch, self.order):
            g = torch.Generator()
            g.manual_seed(epoch_seed(self.seed, epoch, self.order))
            self._perm = torch.randperm(self.num_samples, generator=g)
            self._perm_key = (epoch, self.order)
        self.epoch = epoch
        self.start_step = start_step

    def global_batch(self, step: int) -> torch.Tensor:
        assert self._perm is not None, "call set_epoch first"
        b = self.global_batch_size
        return self._perm[step * b : (step + 1) * b]

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self._perm is None or self._perm_key != (self.epoch, self.order):
            self.set_epoch(self.epoch, self.start_step)
        for step in range(self.start_step, self.steps_per_epoch):
            yield self.global_batch(step)[self.rank :: self.world_size]

    def __len__(self) -> int:
        return self.steps_per_epoch - self.start_step


class TensorBatchDataset(Dataset[tuple[torch.Tensor, ...]]):
    """Tensors indexed by a whole index tensor at once: one gather per batch instead of per sample."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        if not tensors or any(len(t) != len(tensors[0]) for t in tensors):
            raise ValueError("TensorBatchDataset needs tensors of equal length")
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t[indices] for t in self.tensors)


def fetch_batch(dataset: Any, indices: torch.Tensor) -> Any:
    """A batch of ``dataset`` at ``indices``: ``get_batch`` when the dataset has it, else collate."""
    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(indices)
    from torch.utils.data import default_collate

    return default_collate([dataset[int(i)] for i in indices])


def read_parquet(
    url: str,
    columns: Sequence[str],
    storage_options: dict[str, Any] | None = None,
    dtypes: dict[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Read ``columns`` of a Parquet file, folder or glob at an fsspec URL into numpy arrays.

    Only the named columns are read (Parquet is columnar). Missing columns, non-numeric columns and an
    empty dataset raise :class:`ConfigError` naming the URL and the column.
    """
    import pyarrow.dataset as pads
    import pyarrow.types as pat

    from cluster.storage import redact, url_to_fs

    opts = storage_options or {}
    try:
        fs, path = url_to_fs(url, **opts)
        if any(ch in path for ch in "*?["):
            files = sorted(fs.glob(path))
        elif fs.isdir(path):
            files = sorted(p for p in fs.find(path) if p.endswith(".parquet"))
        else:
            files = [path] if fs.exists(path) else []
    except Exception as exc:
        raise ConfigError(f"cannot read dataset {url!r}: {redact(str(exc), opts)}") from None
    if not files:
        raise ConfigError(
            f"dataset {url!r} has no Parquet files; write one first (python -m jobs.make_tabular)"
        )
    try:
        dataset = pads.dataset(files, filesystem=fs, format="parquet")
    except Exception as exc:  # pyarrow.ArrowInvalid: not Parquet, or truncated
        raise ConfigError(
            f"dataset {url!r} is not a readable Parquet dataset: {redact(str(exc), opts)}"
        ) from None
    schema = dataset.schema
    for col in columns:
        if col not in schema.names:
            raise ConfigError(
                f"dataset {url!r} has no column {col!r}; its columns are {', '.join(schema.names)}. "
                "Fix the task's column names"
            )
        tp = schema.field(col).type
        if not (pat.is_integer(tp) or pat.is_floating(tp) or pat.is_boolean(tp)):
            raise ConfigError(
                f"dataset {url!r}: column {col!r} has type {tp}, but a numeric column is needed"
            )
    try:
        table = dataset.to_table(columns=list(columns))
    except Exception as exc:  # files whose schemas disagree, or a file that cannot be decoded
        raise ConfigError(
            f"cannot read columns {list(columns)} of dataset {url!r}: {redact(str(exc), opts)}"
        ) from None
    if table.num_rows == 0:
        raise ConfigError(f"dataset {url!r} is empty (0 rows)")
    out = {}
    for col in columns:
        arr = table.column(col).to_numpy()
        if dtypes and col in dtypes:
            arr = arr.astype(dtypes[col])
        out[col] = arr
    return out
