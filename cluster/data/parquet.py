"""Parquet datasets larger than memory: read lazily, row group by row group, in an order that is a pure
function of (seed, epoch), so a resume is exact mid-epoch and at any world size.

:class:`ParquetDataset` lists the files (a local folder, a glob or an ``s3://`` prefix, through fsspec) and
reads only their footers up front: the row groups and the schema. Rows are read when a batch needs them,
one row group at a time and only the named columns, into a cache of half of ``cache_mb`` (least recently
used row groups go first; the other half is headroom for decoding and gathering). The process's memory
for the data stays within ``cache_mb``, whatever the dataset's size.

Order (:class:`BlockedPermutation`, what the sampler takes in place of ``randperm``): epoch ``e``'s row
groups are permuted with a generator seeded by the epoch's seed; consecutive runs of ``window`` row groups
in that order form a window, and each window's rows are shuffled together (a shuffle buffer of ``window``
row groups). Step ``s``'s global batch is positions ``s*B .. (s+1)*B`` of that order and rank ``r`` takes
every ``W``-th of them, exactly as for an in-memory dataset (``cluster.data.pipeline``), so the batches do not
depend on the world size and a resume at step ``s`` continues the same stream. Every rank reads the
windows its steps touch: over an epoch, every row group once (the cost of an order that does not depend
on the world size); loader processes (``training.loader_workers``) each hold a cache of their own.

Errors before training starts (:class:`cluster.core.errors.ConfigError`): no files, a file that is not
Parquet, a missing or non-numeric column, a column whose type differs between files (schema drift, naming both
files), a file without rows (an empty shard), and a cache too small for one window.
"""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from cluster.core.errors import ConfigError

logger = logging.getLogger(__name__)

OPEN_FILES = 16
"""Parquet files kept open per process (least recently used closed first)."""


class BlockedPermutation:
    """A permutation of ``sum(sizes)`` rows, computed a window at a time; sliced like a 1-D index tensor.

    ``sizes[i]`` and ``starts[i]`` are row group ``i``'s row count and first global row."""

    def __init__(self, sizes: Sequence[int], starts: Sequence[int], window: int, seed: int) -> None:
        self.sizes, self.starts, self.seed = list(sizes), list(starts), seed
        g = torch.Generator()
        g.manual_seed(seed)
        order = torch.randperm(len(self.sizes), generator=g).tolist()
        self.windows = [order[i : i + window] for i in range(0, len(order), window)]
        self.window_start = [0]
        for w in self.windows:
            self.window_start.append(self.window_start[-1] + sum(self.sizes[j] for j in w))
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()  # the last two windows' orders

    def __len__(self) -> int:
        return self.window_start[-1]

    def window_rows(self, w: int) -> torch.Tensor:
        """Window ``w``'s global rows in their shuffled order."""
        if w in self._cache:
            return self._cache[w]
        rows = torch.cat(
            [torch.arange(self.starts[j], self.starts[j] + self.sizes[j]) for j in self.windows[w]]
        )
        g = torch.Generator()
        g.manual_seed((self.seed * 1_000_003 + w + 1) % (2**63 - 1))
        out = rows[torch.randperm(len(rows), generator=g)]
        self._cache[w] = out
        while len(self._cache) > 2:
            self._cache.popitem(last=False)
        return out

    def __getitem__(self, key: slice) -> torch.Tensor:
        if not isinstance(key, slice):
            raise TypeError("a BlockedPermutation is read in slices")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("a BlockedPermutation is read in contiguous slices")
        parts = []
        pos = start
        w = bisect.bisect_right(self.window_start, start) - 1
        while pos < stop:
            base = self.window_start[w]
            hi = min(stop, self.window_start[w + 1])
            parts.append(self.window_rows(w)[pos - base : hi - base])
            pos, w = hi, w + 1
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


class ParquetDataset(Dataset[tuple[torch.Tensor, ...]]):
    """``columns`` of the Parquet files at ``url``, read lazily; items and batches are tuples of tensors in
    ``columns`` order (``dtypes`` converts columns, e.g. ``{"label": "int64"}``). ``window``: row groups
    shuffled together (module docstring); ``cache_mb``: the memory reading may take (half of it caches
    row groups, the rest is headroom for decoding and gathering)."""

    read_ahead = True
    """An evaluation reads its next batch in a background thread (``cluster.rank.evaluate``): ``get_batch``
    draws no random numbers, and storage reads and Parquet decoding release the GIL."""

    def __init__(
        self,
        url: str,
        columns: Sequence[str],
        storage_options: dict[str, Any] | None = None,
        dtypes: dict[str, str] | None = None,
        window: int = 4,
        cache_mb: float = 256.0,
    ) -> None:
        if window < 1:
            raise ConfigError(f"ParquetDataset window={window}: must be at least 1 row group")
        self.url, self.columns = url, list(columns)
        self.options = dict(storage_options or {})
        self.window = window
        self.cache_bytes = int(cache_mb * (1 << 20))
        _, self.files = list_parquet_files(url, self.options)
        self._fs: Any = None
        self._open: OrderedDict[int, Any] = OrderedDict()
        self._rows: OrderedDict[int, tuple[dict[str, np.ndarray], int]] = OrderedDict()
        self._held = 0
        self.reads = 0
        """Row groups read by this process (a test counts them)."""
        sizes, where, self.dtypes = self._inspect(dtypes or {})
        self.sizes = sizes
        self.where = where  # row group -> (file index, index in file)
        self.starts = [0]
        for n in sizes:
            self.starts.append(self.starts[-1] + n)
        row_bytes = sum(np.dtype(d).itemsize for d in self.dtypes.values())
        group_bytes = max(sizes) * row_bytes
        # Half the budget holds cached row groups; the other half is headroom for what reading costs beyond
        # them: the row group being decoded (Arrow's pool keeps freed pages for reuse), the batch being
        # gathered, the allocator's slack (tests/multiprocess/test_parquet_memory.py measures the whole).
        self._limit = self.cache_bytes // 2
        need = window * group_bytes
        if need > self._limit:
            raise ConfigError(
                f"dataset {url!r}: a window of {window} row groups of up to {max(sizes)} rows takes "
                f"{need / (1 << 20):.1f} MiB decoded, more than half of cache_mb={cache_mb:g}; raise "
                "cache_mb, lower window, or write smaller row groups"
            )

    # ------------------------------------------------------------------ set-up
    def _inspect(self, dtypes: dict[str, str]) -> tuple[list[int], list[tuple[int, int]], dict[str, str]]:
        import pyarrow.types as pat

        from cluster.run.storage import redact

        sizes: list[int] = []
        where: list[tuple[int, int]] = []
        types: dict[str, Any] = {}
        first: dict[str, str] = {}
        for fi, name in enumerate(self.files):
            try:
                meta = self._file(fi).metadata
                schema = self._file(fi).schema_arrow
            except ConfigError:
                raise
            except Exception as exc:  # pyarrow.ArrowInvalid: not Parquet, or truncated
                raise ConfigError(
                    f"dataset {self.url!r}: {name} is not a readable Parquet file: "
                    f"{redact(str(exc), self.options)}"
                ) from None
            for col in self.columns:
                if col not in schema.names:
                    raise ConfigError(
                        f"dataset {self.url!r}: {name} has no column {col!r}; its columns are "
                        f"{', '.join(schema.names)}. Fix the task's column names"
                    )
                tp = schema.field(col).type
                if col not in types:
                    if not (pat.is_integer(tp) or pat.is_floating(tp) or pat.is_boolean(tp)):
                        raise ConfigError(
                            f"dataset {self.url!r}: column {col!r} has type {tp}, but a numeric column is "
                            "needed"
                        )
                    types[col], first[col] = tp, name
                elif tp != types[col]:
                    raise ConfigError(
                        f"dataset {self.url!r}: column {col!r} is {types[col]} in {first[col]} but {tp} in "
                        f"{name} (schema drift); rewrite the files with one schema"
                    )
            if meta.num_rows == 0:
                raise ConfigError(
                    f"dataset {self.url!r}: {name} has no rows (an empty shard); remove it or write rows "
                    "to it"
                )
            for rg in range(meta.num_row_groups):
                n = meta.row_group(rg).num_rows
                if n:
                    sizes.append(n)
                    where.append((fi, rg))
        out = {c: dtypes.get(c, types[c].to_pandas_dtype().__name__) for c in self.columns}
        return sizes, where, out

    def _file(self, fi: int) -> Any:
        """File ``fi`` as an open ``pyarrow.parquet.ParquetFile`` (kept open, :data:`OPEN_FILES` at most)."""
        import pyarrow.parquet as pq

        from cluster.run.storage import url_to_fs

        if fi in self._open:
            self._open.move_to_end(fi)
            return self._open[fi]
        if self._fs is None:
            self._fs, _ = url_to_fs(self.url, **self.options)
        handle = self._fs.open(self.files[fi], "rb")
        try:
            pf = pq.ParquetFile(handle)
        except Exception:
            handle.close()
            raise
        self._open[fi] = pf
        while len(self._open) > OPEN_FILES:
            _, old = self._open.popitem(last=False)
            old.close(force=True)
        return pf

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for loader processes: without open files and cache (each process opens its own)."""
        state = dict(self.__dict__)
        state.update(_fs=None, _open=OrderedDict(), _rows=OrderedDict(), _held=0, reads=0)
        return state

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return self.starts[-1]

    def permutation(self, seed: int) -> BlockedPermutation:
        """The epoch's order for the sampler (``ResumableDistributedSampler`` asks for it)."""
        return BlockedPermutation(self.sizes, self.starts[:-1], self.window, seed)

    def _row_group(self, g: int) -> dict[str, np.ndarray]:
        if g in self._rows:
            self._rows.move_to_end(g)
            return self._rows[g][0]
        fi, rg = self.where[g]
        table = self._file(fi).read_row_group(rg, columns=self.columns, use_threads=False)
        # copied out of Arrow's memory pool, which keeps freed pages for reuse: evicting a row group then
        # returns its memory to the allocator every other allocation uses
        cols = {
            c: np.array(table.column(c).to_numpy(), dtype=self.dtypes[c], copy=True) for c in self.columns
        }
        del table
        self.reads += 1
        size = sum(a.nbytes for a in cols.values())
        while self._rows and self._held + size > self._limit:
            _, (_, freed) = self._rows.popitem(last=False)
            self._held -= freed
        self._rows[g] = (cols, size)
        self._held += size
        return cols

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        idx = indices.numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices, dtype=np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"row index out of range 0..{len(self) - 1}")
        groups = np.searchsorted(np.asarray(self.starts), idx, side="right") - 1
        out = {c: np.empty(len(idx), dtype=self.dtypes[c]) for c in self.columns}
        for g in np.unique(groups):
            mask = groups == g
            local = idx[mask] - self.starts[g]
            data = self._row_group(int(g))
            for c in self.columns:
                out[c][mask] = data[c][local]
        return tuple(torch.from_numpy(out[c]) for c in self.columns)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[0] for t in self.get_batch(torch.tensor([int(i)])))


def list_parquet_files(url: str, options: dict[str, Any]) -> tuple[Any, list[str]]:
    """(filesystem, sorted paths) of the Parquet files at ``url``: a file, a folder (its ``*.parquet``,
    recursively) or a glob. ConfigError when there are none or the URL cannot be read."""
    from cluster.run.storage import redact, url_to_fs

    try:
        fs, path = url_to_fs(url, **options)
        if any(ch in path for ch in "*?["):
            files = sorted(fs.glob(path))
        elif fs.isdir(path):
            files = sorted(p for p in fs.find(path) if p.endswith(".parquet"))
        else:
            files = [path] if fs.exists(path) else []
    except Exception as exc:
        raise ConfigError(f"cannot read dataset {url!r}: {redact(str(exc), options)}") from None
    if not files:
        raise ConfigError(
            f"dataset {url!r} has no Parquet files; write one first (python -m jobs.make_tabular)"
        )
    return fs, list(files)
