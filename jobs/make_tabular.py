"""Write a synthetic, learnable tabular classification dataset as Parquet (local folder or any fsspec URL).

python -m jobs.make_tabular --out ./data/tabular --rows 20000
python -m jobs.make_tabular --out s3://bucket/tabular --rows 20000   # needs s3fs and credentials
"""

from __future__ import annotations

import argparse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def make_table(rows: int, features: int = 16, classes: int = 4, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 1.5, size=(classes, features))
    labels = rng.integers(0, classes, size=rows)
    x = centers[labels] + rng.normal(0, 1.0, size=(rows, features))
    cols: dict[str, np.ndarray] = {f"f{i}": x[:, i].astype(np.float32) for i in range(features)}
    cols["label"] = labels.astype(np.int64)
    cols["id"] = np.arange(rows, dtype=np.int64)
    return pa.table(cols)


def write(
    out: str,
    rows: int,
    files: int = 2,
    storage_options: dict | None = None,
    row_group_rows: int | None = None,
) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(out, **(storage_options or {}))
    fs.makedirs(path, exist_ok=True)
    table = make_table(rows)
    per = -(-rows // files)
    for i in range(files):
        with fs.open(f"{path.rstrip('/')}/part-{i:03d}.parquet", "wb") as fh:
            pq.write_table(table.slice(i * per, per), fh, row_group_size=row_group_rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder or URL to write part-*.parquet into")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--files", type=int, default=2)
    p.add_argument("--row-group-rows", type=int, help="rows per Parquet row group (default: pyarrow's)")
    args = p.parse_args()
    write(args.out, args.rows, args.files, row_group_rows=args.row_group_rows)
    print(f"wrote {args.rows} rows to {args.out}")


if __name__ == "__main__":
    main()
