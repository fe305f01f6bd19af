"""The driver's Parquet metrics writer: values round trip exactly, and writing does not import pandas."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from cluster.run.logs import SCHEMA, read_metrics, write_metrics
from cluster.run.storage import Storage

pytestmark = pytest.mark.timeout(60)


def _row(i: int, **over: object) -> dict[str, object]:
    row: dict[str, object] = {
        "kind": "step",
        "time": 1000.0 + i,
        "global_step": i,
        "epoch": i // 3,
        "step_in_epoch": i % 3,
        "loss": 2.0 / (i + 1),
        "lr": 1e-3,
        "grad_norm": 0.5 + i,
        "peak_mem_gib": 1.25,
        "step_time_s": 0.05,
        "input_wait_s": 0.001 * i,
        "samples_per_s": 1280.0,
        "checkpoint_stall_s": 0.0,
        "world_size": 2,
        "attempt": 0,
        "eval_samples": None,
    }
    row.update(over)
    return row


def test_rows_round_trip_with_nulls_nan_and_text(tmp_path) -> None:
    rows = [_row(i) for i in range(11)]  # more than 8 rows: the null bitmap spans two bytes
    rows[3] = _row(3, lr=None, loss=float("nan"))  # an epoch without a scheduler; a diverged loss
    rows[5] = _row(5, kind="eval", lr=None, grad_norm=None, checkpoint_stall_s=None, eval_samples=127)
    rows[9] = _row(9, kind="époch", global_step=2**40, world_size=None, attempt=-1)
    storage = Storage(str(tmp_path))
    write_metrics(storage, rows, epoch=0, attempt=0)
    table = read_metrics(storage)
    assert table.schema == SCHEMA
    got = table.to_pylist()
    assert len(got) == len(rows)
    for want, row in zip(rows, got, strict=True):
        for name in SCHEMA.names:
            w, g = want[name], row[name]
            if isinstance(w, float) and math.isnan(w):
                assert isinstance(g, float) and math.isnan(g), name
            else:
                assert g == w, (name, w, g)


@pytest.mark.multiprocess  # starts a process
def test_writing_metrics_does_not_import_pandas(tmp_path) -> None:
    # pa.array would import pandas in the driver at the first epoch end, while the workers train.
    code = (
        "import sys; from cluster.run.logs import write_metrics; from cluster.run.storage import Storage;"
        f"write_metrics(Storage({str(tmp_path)!r}), "
        "[{'kind': 'step', 'time': 1.0, 'global_step': 1}], 0, 0);"
        "print('pandas' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_extra_metric_columns_are_float64_and_files_with_other_columns_read_together(tmp_path) -> None:
    storage = Storage(str(tmp_path))
    write_metrics(storage, [_row(0, m_acc=0.5), _row(1)], epoch=0, attempt=0)  # a step without the metric
    write_metrics(storage, [_row(2, m_top5=0.9)], epoch=1, attempt=0)  # another task's metric
    table = read_metrics(storage)
    assert table.schema.names == [*SCHEMA.names, "m_acc", "m_top5"]
    assert str(table.schema.field("m_acc").type) == "double"
    rows = table.to_pylist()
    assert [(r["m_acc"], r["m_top5"]) for r in rows] == [(0.5, None), (None, None), (None, 0.9)]
