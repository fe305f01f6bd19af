"""Data: the resumable distributed sampler, and Parquet datasets read with pyarrow through fsspec.

Sampler contract: epoch ``e`` trains the global permutation ``perm(seed, e)`` of the dataset in order,
``global_batch_size`` samples per step. At step ``s`` rank ``r`` of ``W`` takes
``perm[s*B:(s+1)*B][r::W]``, which is exactly what ``torch.utils.data.DistributedSampler(shuffle=True,
seed=seed, drop_last=True)`` gives rank ``r`` after ``set_epoch(e)``, ``B/W`` samples per step: ``perm`` is
``randperm`` seeded with ``seed + e``, as there (runs begun before that, with another seed than 0, keep
their own order: :data:`LEGACY_ORDER`). Because a step's global batch does not depend on ``W``, a run
resumed at step ``s`` (global sample offset ``s*B``) with any world size trains the rest of the epoch
without repeating or skipping a sample.

Input pipeline (:class:`InputPipeline`): with ``training.loader_workers=0`` the training thread fetches each
micro-batch right before its forward. With ``k > 0`` a ``torch.utils.data.DataLoader`` with ``k``
persistent processes, built once per worker process (kept across epochs and warm restarts, like the task's
dataset), prepares ``training.prefetch`` micro-batches ahead per process, pinned when the device is CUDA;
the training thread only copies them to the device (``Task.move_to_device``, non-blocking).

- Order: the loader's sampler (:class:`MicroBatches`) yields exactly the index chunks the training loop
  trains (each step's local indices split into ``grad_accum_steps`` chunks, from the resume position on),
  and each batch comes back with its position (epoch, step, micro-batch), which the training thread checks.
  The sampler is passed as ``sampler=`` with automatic batching off (``batch_size=None``), DataLoader's
  documented form for loading a whole batch in one call: as a ``batch_sampler`` DataLoader would index the
  dataset sample by sample and lose ``get_batch``'s one gather per batch. Batches are built by the same
  :func:`fetch_batch` as in the training thread, so the samples are a pure function of (seed, epoch, step)
  with loader processes on or off.
- Every epoch (every ``run_epoch``) starts a fresh iterator; the processes persist. DataLoader drops what
  the previous iterator had prefetched, so an epoch cut short by a stop, or restarted at another step,
  never hands out a stale batch.
- Random draws in the dataset (augmentation) come, in a loader process, from torch's generator seeded per
  micro-batch from (seed, epoch, step, rank, micro-batch): a resume is exact, but the draws differ from
  ``loader_workers=0``, where they come from the step's stream in the training thread.
- Start method ``forkserver``, not Linux's default ``fork``: a forked loader would hold copies of the
  training process's sockets (gloo peers, the rendezvous store, Ray's), so a killed rank's connections
  would stay open until its loaders noticed (seconds), delaying its peers' failure detection; and fork
  after CUDA or other threads started is unsafe. The price: the dataset must be picklable (setup raises a
  ConfigError otherwise) and each loader process imports torch once, during setup. A loader's parent is
  the fork server, so DataLoader's own parent check cannot see the rank die: each loader watches the rank's
  pid itself (every :data:`LOADER_WATCH_S`) and exits when it is gone, SIGKILL included.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from cluster.core.errors import ConfigError

logger = logging.getLogger(__name__)

LOADER_WATCH_S = 1.0
"""How often a loader process checks that its rank still runs."""

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
        permutation: Callable[[int], Any] | None = None,
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
        self.permutation = permutation
        """The epoch's order given its seed, for datasets that choose it (``ParquetDataset.permutation``: read
        in row-group windows); default ``randperm``. Anything sliced like a 1-D index tensor."""
        self.epoch = 0
        self.start_step = 0
        self.skip: frozenset[int] = frozenset()
        """The epoch's steps (0-based, within it) whose batches are not trained (``training.skip_steps``):
        still yielded, in place, so positions never shift; the loader processes leave them out."""
        self._perm: Any = None
        self._perm_key: tuple[int, int] | None = None  # (epoch, order) of _perm

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch (the remainder is dropped, as with ``drop_last=True``)."""
        steps = self.num_samples // self.global_batch_size
        return min(steps, self.max_steps_per_epoch) if self.max_steps_per_epoch else steps

    def set_epoch(self, epoch: int, start_step: int = 0, skip: frozenset[int] = frozenset()) -> None:
        """Select the epoch's permutation, where in it to start (resume), and the steps to skip."""
        if not 0 <= start_step <= self.steps_per_epoch:
            raise ValueError(f"start_step={start_step} outside 0..{self.steps_per_epoch}")
        if self._perm is None or self._perm_key != (epoch, self.order):
            seed = epoch_seed(self.seed, epoch, self.order)
            if self.permutation is not None:
                self._perm = self.permutation(seed)
            else:
                g = torch.Generator()
                g.manual_seed(seed)
                self._perm = torch.randperm(self.num_samples, generator=g)
            self._perm_key = (epoch, self.order)
        self.epoch = epoch
        self.start_step = start_step
        self.skip = skip

    def global_batch(self, step: int) -> torch.Tensor:
        assert self._perm is not None, "call set_epoch first"
        b = self.global_batch_size
        return self._perm[step * b : (step + 1) * b]

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self._perm is None or self._perm_key != (self.epoch, self.order):
            self.set_epoch(self.epoch, self.start_step, self.skip)
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


Position = tuple[int, int, int]
"""(epoch, step in epoch, micro-batch) of a micro-batch."""


def _micro_seed(seed: int, position: Position, rank: int) -> int:
    epoch, step, micro = position
    return (seed * 1_000_003 + epoch * 999_983 + step * 7_919 + micro * 131 + rank * 104_729) % (2**63 - 1)


class MicroBatches(Sampler[tuple[Position, int, list[int]]]):
    """The loader's sampler: for each step of ``source`` (its epoch, from its start step on), the step's
    local indices split into ``grad_accum`` chunks, in training order, as (position, seed, indices).
    ``source`` is set per epoch (a warm restart brings a new rank and world size); None yields nothing."""

    def __init__(self, grad_accum: int, seed: int) -> None:
        self.grad_accum = grad_accum
        self.seed = seed
        self.source: ResumableDistributedSampler | None = None

    def __iter__(self) -> Iterator[tuple[Position, int, list[int]]]:
        src = self.source
        if src is None:
            return
        for step, local_idx in enumerate(src, start=src.start_step):
            if step in src.skip:
                continue  # not trained: the training thread fetches nothing for it
            chunks = [c for c in torch.tensor_split(local_idx, self.grad_accum) if len(c)]
            for micro, chunk in enumerate(chunks):
                pos = (src.epoch, step, micro)
                yield pos, _micro_seed(self.seed, pos, src.rank), chunk.tolist()


class _Fetch(Dataset[tuple[Position, Any]]):
    """Runs in a loader process: one micro-batch per item, built by :func:`fetch_batch`."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[Position, int, list[int]]) -> tuple[Position, Any]:
        pos, seed, indices = item
        torch.default_generator.manual_seed(seed)
        return pos, fetch_batch(self.dataset, torch.tensor(indices, dtype=torch.int64))


def _as_is(batch: Any) -> Any:
    return batch


def _exit_with(rank_pid: int, _worker_id: int) -> None:
    """In each loader process: end it once the rank process that owns it is gone (SIGKILLed, or left with
    ``os._exit``, before it could stop its loaders). DataLoader's own check watches the loader's parent, which
    under forkserver is the fork server, not the rank; and every loader holds the fork server's "alive" pipe,
    so neither would ever exit: each dead rank would leave its loaders and their memory behind."""

    def watch() -> None:
        while _alive(rank_pid):
            time.sleep(LOADER_WATCH_S)
        os._exit(0)

    threading.Thread(target=watch, name="cluster-loader-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc (not Linux): whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class InputPipeline:
    """Where the training thread's micro-batches come from (module docstring: order, staleness, start
    method). One per worker process; ``open`` once the device is known, ``start_epoch`` before each
    epoch's first step, then ``fetch`` once per micro-batch in training order."""

    def __init__(self, dataset: Any, loader_workers: int, prefetch: int, grad_accum: int, seed: int) -> None:
        self.dataset = dataset
        self.loader_workers = loader_workers
        self.prefetch = prefetch
        self._micro = MicroBatches(grad_accum, seed)
        self._loader: DataLoader[Any] | None = None
        self._it: Iterator[tuple[Position, Any]] | None = None

    def open(self, device: torch.device) -> None:
        """Start the loader processes (once per process; a no-op when they run or with 0 loaders), so their
        start overlaps the rest of setup. Raises ConfigError when the dataset cannot be sent to them."""
        if self.loader_workers == 0 or self._loader is not None:
            return
        loader = DataLoader(
            _Fetch(self.dataset),
            sampler=self._micro,
            batch_size=None,
            num_workers=self.loader_workers,
            persistent_workers=True,
            prefetch_factor=self.prefetch,
            pin_memory=device.type == "cuda",
            collate_fn=_as_is,  # fetch_batch already collated
            multiprocessing_context="forkserver",
            generator=torch.Generator(),  # DataLoader's base seed: never drawn from the step's stream
            worker_init_fn=functools.partial(_exit_with, os.getpid()),
        )
        self._micro.source = None
        try:
            self._it = iter(loader)  # starts the processes; nothing to fetch yet
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"training.loader_workers={self.loader_workers} sends the dataset to loader processes, but "
                f"{type(self.dataset).__name__} cannot be pickled ({exc}). Make it picklable (no open files, "
                "lambdas or locally defined classes), or set training.loader_workers=0"
            ) from None
        self._loader = loader

    def start_epoch(self, sampler: ResumableDistributedSampler, device: torch.device) -> None:
        """Before an epoch's first step, after ``sampler.set_epoch``: batches from the sampler's position
        on, nothing prefetched for an earlier position."""
        if self.loader_workers == 0:
            return
        self.open(device)
        assert self._loader is not None
        self._micro.source = sampler
        self._it = iter(self._loader)  # persistent: the same processes, a reset iterator

    def fetch(self, chunk: torch.Tensor, position: Position) -> Any:
        """The micro-batch of indices ``chunk`` at ``position``, on the host."""
        if self.loader_workers == 0:
            return fetch_batch(self.dataset, chunk)
        assert self._it is not None, "start_epoch first"
        try:
            got, batch = next(self._it)
        except Exception as exc:
            # A loader process failed (the dataset raised, or the process died): the next epoch or restart
            # builds new ones rather than resetting a broken iterator.
            logger.warning(
                "input pipeline failed at %s (%s); its loader processes are dropped", position, exc
            )
            self.close()
            raise
        if got != position:
            self.close()
            raise RuntimeError(f"the input pipeline handed out the batch of {got} at {position}")
        return batch

    def close(self) -> None:
        """Stop the loader processes (a later ``open`` starts new ones)."""
        self._it = self._loader = None  # the DataLoader's iterator shuts its processes down when released


class _EvalPlan(Sampler[tuple[int, int, int, int]]):
    """The eval loader's sampler: (seed, batch, start, stop) for each of this rank's eval batches, set per
    evaluation (``EvalLoader.batches``)."""

    def __init__(self) -> None:
        self.items: list[tuple[int, int, int, int]] = []

    def __iter__(self) -> Iterator[tuple[int, int, int, int]]:
        return iter(list(self.items))

    def __len__(self) -> int:
        return len(self.items)


class _EvalFetch(Dataset[tuple[int, Any]]):
    """Runs in an eval loader process: one eval batch per item, read after seeding torch's generator as an
    in-turn read is seeded, so a read that draws random numbers draws the same ones."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int, int, int]) -> tuple[int, Any]:
        seed, b, start, stop = item
        torch.default_generator.manual_seed(seed)
        return b, fetch_batch(self.dataset, torch.arange(start, stop))


class EvalLoader:
    """Loader processes for a rank's eval batches (``evaluation.loader_workers``), started at the first
    evaluation and kept for the next ones: the batches of an evaluation are read while the ones before
    them are evaluated, in batch order."""

    def __init__(self, dataset: Any, workers: int, prefetch: int, device: torch.device) -> None:
        self._plan = _EvalPlan()
        self._loader: DataLoader[Any] = DataLoader(
            _EvalFetch(dataset),
            sampler=self._plan,
            batch_size=None,
            num_workers=workers,
            persistent_workers=True,
            prefetch_factor=prefetch,
            pin_memory=device.type == "cuda",
            collate_fn=_as_is,
            multiprocessing_context="forkserver",
            generator=torch.Generator(),
            worker_init_fn=functools.partial(_exit_with, os.getpid()),
        )
        self.workers = workers
        self.dataset_name = type(dataset).__name__
        self.broken = False
        """A loader process failed (the dataset raised, or the process died): make a new EvalLoader."""

    def batches(self, items: list[tuple[int, int, int, int]]) -> Iterator[Any]:
        """The host data of each (seed, batch, start, stop), in order."""
        self._plan.items = items
        try:
            it = iter(self._loader)  # persistent: the same processes, a reset iterator
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"evaluation.loader_workers={self.workers} sends the eval set to loader processes, but "
                f"{self.dataset_name} cannot be pickled ({exc}). Make it picklable, or set "
                "evaluation.loader_workers=0"
            ) from None
        try:
            for want, (got, data) in zip(items, it, strict=True):
                if got != want[1]:
                    raise RuntimeError(f"the eval loader handed out batch {got} for batch {want[1]}")
                yield data
        except Exception:
            self.broken = True
            raise


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

    from cluster.data.parquet import list_parquet_files
    from cluster.run.storage import redact

    opts = storage_options or {}
    fs, files = list_parquet_files(url, opts)
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
