"""ParquetDataset (cluster.data.parquet): lazy reads by row group, the windowed order, exact resume at any
world size, the errors before training starts, and an s3:// dataset on a real S3 server (moto)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from cluster.core.errors import ConfigError
from cluster.data.parquet import BlockedPermutation, ParquetDataset
from cluster.data.pipeline import ResumableDistributedSampler
from tests.support.storage import MotoS3

pytestmark = pytest.mark.timeout(60)


def _write(folder: Path, files: int = 3, rows: int = 1000, group: int = 100, start: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    n = start
    for f in range(files):
        ids = np.arange(n, n + rows)
        table = pa.table(
            {
                "id": ids.astype(np.int64),
                "x": (ids * 0.5).astype(np.float32),
                "label": (ids % 3).astype(np.int32),
                "name": [f"r{i}" for i in ids],
            }
        )
        pq.write_table(table, folder / f"part-{f:03d}.parquet", row_group_size=group)
        n += rows
    return folder


def test_batches_are_the_rows_at_the_indices_read_one_row_group_at_a_time(tmp_path: Path) -> None:
    ds = ParquetDataset(
        str(_write(tmp_path / "d")), ["id", "x", "label"], dtypes={"label": "int64"}, window=2
    )
    assert len(ds) == 3000 and len(ds.sizes) == 30 and ds.reads == 0  # only the footers were read
    idx = torch.tensor([2999, 0, 150, 151, 1234, 150])
    ids, x, label = ds.get_batch(idx)
    assert ids.tolist() == idx.tolist()
    torch.testing.assert_close(x, (idx * 0.5).float())
    assert label.dtype == torch.int64 and label.tolist() == (idx % 3).tolist()
    assert ds.reads == 4  # row groups 29, 0, 1 and 12, each once
    assert [int(t) for t in ds[151]] == [151, 75, 1]


def test_the_order_is_a_windowed_permutation_fixed_by_the_seed(tmp_path: Path) -> None:
    sizes = [100, 50, 100, 80, 100, 30, 100]
    starts = list(np.cumsum([0, *sizes[:-1]]))
    perm = BlockedPermutation(sizes, starts, window=3, seed=5)
    whole = perm[0 : len(perm)]
    assert sorted(whole.tolist()) == list(range(sum(sizes)))
    for w, groups in enumerate(perm.windows):  # each window holds exactly its row groups' rows
        rows = whole[perm.window_start[w] : perm.window_start[w + 1]]
        expected = {r for g in groups for r in range(starts[g], starts[g] + sizes[g])}
        assert set(rows.tolist()) == expected
    # slices across window boundaries are the same stream, in any pieces
    pieces = torch.cat([perm[i : min(i + 64, len(perm))] for i in range(0, len(perm), 64)])
    assert torch.equal(pieces, whole)
    assert torch.equal(BlockedPermutation(sizes, starts, 3, 5)[0 : len(perm)], whole)
    assert not torch.equal(BlockedPermutation(sizes, starts, 3, 6)[0 : len(perm)], whole)


def test_resume_mid_epoch_and_any_world_size_see_the_same_global_batches(tmp_path: Path) -> None:
    ds = ParquetDataset(str(_write(tmp_path / "d")), ["id"], window=4)

    def stream(world: int, start: int) -> list[list[int]]:
        ranks = []
        for r in range(world):
            s = ResumableDistributedSampler(len(ds), 48, r, world, seed=3, permutation=ds.permutation)
            s.set_epoch(2, start)
            ranks.append([idx.tolist() for idx in s])
        return [sorted(x for r in range(world) for x in ranks[r][i]) for i in range(len(ranks[0]))]

    whole = stream(1, 0)
    assert len(whole) == 3000 // 48
    assert stream(2, 0) == whole and stream(4, 0) == whole
    assert stream(3, 17) == whole[17:]  # a resume at step 17 on another world size
    epoch3 = ResumableDistributedSampler(len(ds), 48, 0, 1, seed=3, permutation=ds.permutation)
    epoch3.set_epoch(3)
    assert [sorted(i.tolist()) for i in epoch3] != whole


def test_a_pickled_dataset_reads_the_same_with_its_own_cache(tmp_path: Path) -> None:
    ds = ParquetDataset(str(_write(tmp_path / "d")), ["id", "x"])
    ds.get_batch(torch.tensor([5, 500]))
    copy = pickle.loads(pickle.dumps(ds))  # what a loader process receives
    assert copy.reads == 0 and not copy._rows
    idx = torch.tensor([7, 2500, 1999])
    for a, b in zip(copy.get_batch(idx), ds.get_batch(idx)):
        assert torch.equal(a, b)


def test_memory_is_bounded_by_the_cache(tmp_path: Path) -> None:
    ds = ParquetDataset(
        str(_write(tmp_path / "d", files=2, rows=5000, group=500)), ["id", "x"], cache_mb=0.05
    )
    one_group = 500 * 12  # int64 + float32 per row
    perm = ds.permutation(0)
    for step in range(len(perm) // 100):
        ds.get_batch(perm[step * 100 : (step + 1) * 100])
        assert ds._held <= 0.05 * (1 << 20) and ds._held >= one_group
    assert ds.reads <= 2 * len(ds.sizes)  # a window's groups stay cached while its batches are drawn


def test_errors_before_training_name_the_file_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no Parquet files"):
        ParquetDataset(str(tmp_path / "nothing"), ["id"])
    d = _write(tmp_path / "d", files=2)
    with pytest.raises(ConfigError, match="has no column 'nope'; its columns are id, x, label, name"):
        ParquetDataset(str(d), ["id", "nope"])
    with pytest.raises(ConfigError, match="column 'name' has type string, but a numeric column is needed"):
        ParquetDataset(str(d), ["name"])
    with pytest.raises(ConfigError, match="raise cache_mb, lower window"):
        ParquetDataset(str(d), ["id"], window=4, cache_mb=0.001)
    drift = _write(tmp_path / "drift", files=1)
    pq.write_table(pa.table({"id": np.arange(5, dtype=np.float64)}), drift / "part-zzz.parquet")
    with pytest.raises(
        ConfigError, match=r"column 'id' is int64 in .*part-000.parquet but double in .*part-zzz"
    ):
        ParquetDataset(str(drift), ["id"])
    empty = _write(tmp_path / "empty", files=1)
    pq.write_table(pa.table({"id": np.zeros(0, dtype=np.int64)}), empty / "part-001.parquet")
    with pytest.raises(ConfigError, match=r"part-001.parquet has no rows \(an empty shard\)"):
        ParquetDataset(str(empty), ["id"])
    bad = _write(tmp_path / "bad", files=1)
    (bad / "part-009.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"part-009\.parquet is not a readable Parquet file"):
        ParquetDataset(str(bad), ["id"])


@pytest.mark.timeout(120)
def test_an_s3_dataset_reads_lazily(tmp_path: Path, moto_s3: MotoS3) -> None:
    import fsspec

    local = _write(tmp_path / "d", files=2, rows=400, group=100)
    fs = fsspec.filesystem("s3", **moto_s3.options)
    for f in sorted(local.iterdir()):
        fs.put(str(f), f"bucket/data/{f.name}")
    ds = ParquetDataset(moto_s3.url("data"), ["id", "x"], moto_s3.options, window=2)
    assert len(ds) == 800 and ds.files == ["bucket/data/part-000.parquet", "bucket/data/part-001.parquet"]
    ids, _ = ds.get_batch(torch.tensor([799, 3]))
    assert ids.tolist() == [799, 3] and ds.reads == 2
