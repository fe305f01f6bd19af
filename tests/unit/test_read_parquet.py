"""read_parquet: a file, a folder or a glob, only the named columns, and one clear ConfigError per bad
input."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster.core.errors import ConfigError
from cluster.data.pipeline import read_parquet
from jobs.make_tabular import make_table, write

pytestmark = pytest.mark.timeout(60)


def test_folder_file_and_glob(tmp_path: object) -> None:
    root = f"{tmp_path}/tab"
    write(root, rows=300, files=3)
    expect = make_table(300)
    cols = read_parquet(root, ["f3", "label"], dtypes={"label": "int32"})
    assert list(cols) == ["f3", "label"]
    assert cols["label"].dtype == np.int32
    np.testing.assert_array_equal(cols["label"], expect.column("label").to_numpy())
    assert len(read_parquet(f"{root}/part-002.parquet", ["id"])["id"]) == 100
    assert len(read_parquet(f"{root}/part-00[12].parquet", ["id"])["id"]) == 200


def test_missing_column_names_it_and_lists_the_columns(tmp_path: object) -> None:
    root = f"{tmp_path}/tab"
    write(root, rows=50, files=1)
    with pytest.raises(ConfigError) as info:
        read_parquet(root, ["f0", "target"])
    msg = str(info.value)
    assert "no column 'target'" in msg and root in msg and "f0, f1" in msg and "label" in msg


def test_wrong_type_names_column_and_type(tmp_path: object) -> None:
    os.makedirs(f"{tmp_path}/s")
    pq.write_table(pa.table({"x": [1.0, 2.0], "label": ["cat", "dog"]}), f"{tmp_path}/s/a.parquet")
    with pytest.raises(ConfigError, match=r"column 'label' has type string, but a numeric column is needed"):
        read_parquet(f"{tmp_path}/s", ["x", "label"])
    assert read_parquet(f"{tmp_path}/s", ["x"])["x"].tolist() == [1.0, 2.0]  # projection skips the bad column


def test_empty_dataset_zero_rows(tmp_path: object) -> None:
    os.makedirs(f"{tmp_path}/e")
    pq.write_table(pa.table({"x": pa.array([], pa.float32())}), f"{tmp_path}/e/a.parquet")
    with pytest.raises(ConfigError, match=r"is empty \(0 rows\)"):
        read_parquet(f"{tmp_path}/e", ["x"])


def test_empty_folder_and_missing_path(tmp_path: object) -> None:
    os.makedirs(f"{tmp_path}/none")
    with pytest.raises(ConfigError, match="has no Parquet files; write one first"):
        read_parquet(f"{tmp_path}/none", ["x"])
    with pytest.raises(ConfigError, match="has no Parquet files"):
        read_parquet(f"{tmp_path}/does-not-exist", ["x"])
    with pytest.raises(ConfigError, match="has no Parquet files"):
        read_parquet(f"{tmp_path}/none/*.parquet", ["x"])


def test_not_parquet_is_a_config_error(tmp_path: object) -> None:
    os.makedirs(f"{tmp_path}/bad")
    with open(f"{tmp_path}/bad/a.parquet", "wb") as fh:
        fh.write(b"this is not parquet")
    with pytest.raises(ConfigError, match="not a readable Parquet"):
        read_parquet(f"{tmp_path}/bad", ["x"])
