"""A lazy Parquet dataset (ParquetDataset, windowed order) resumed mid-epoch after a rank fails: the run
ends bitwise equal to an uninterrupted one, over real gloo process groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobs.make_tabular import write
from tests.multiprocess.mp_helpers import run_workers, tiny_config

pytestmark = pytest.mark.timeout(240)


def _overrides(data: str, *extra: str) -> list[str]:
    return [
        "task=jobs.tasks.tabular:TabularTask",
        f"task_args.dataset={data}",
        "task_args.cache_mb=0.1",
        "task_args.window=2",
        "task_args.hidden=16",
        "workers=2",
        "training.global_batch_size=128",
        "training.epochs=2",
        "checkpoint.every_steps=4",
        *extra,
    ]


@pytest.mark.slow  # > 10 s on 2 cores: full suite only
def test_a_mid_epoch_resume_of_a_lazy_dataset_is_bitwise(tmp_path: Path) -> None:
    data = f"{tmp_path}/data"
    write(data, rows=2000, files=2, row_group_rows=125)  # 16 row groups, shuffled in windows of 2
    whole_out, first_out, resumed_out = (tmp_path / n for n in ("whole", "first", "resumed"))
    for out in (whole_out, first_out, resumed_out):
        out.mkdir()
    whole = run_workers(
        2,
        tiny_config(f"{tmp_path}/a", _overrides(data)),
        f"{tmp_path}/a/run",
        [(0, 0), (1, 0)],
        str(whole_out),
    )

    failing = tiny_config(
        f"{tmp_path}/b", _overrides(data, "failures.inject=[{rank: 1, step: 7, kind: raise}]")
    )
    with pytest.raises(RuntimeError, match=r"rank [01] failed"):  # rank 0 fails with it (peer closed)
        run_workers(2, failing, f"{tmp_path}/b/run", [(0, 0), (1, 0)], str(first_out))
    assert "injected fault on rank 1 at step 7" in (first_out / "rank1.err").read_text()
    again = tiny_config(f"{tmp_path}/b", _overrides(data))
    resumed = run_workers(2, again, f"{tmp_path}/b/run", [(-1, -1), (1, 0)], str(resumed_out), attempt=1)
    assert (resumed[0]["resume"].epoch, resumed[0]["resume"].step_in_epoch) == (0, 4)  # mid-epoch
    for name, value in whole[0]["params"].items():
        torch.testing.assert_close(resumed[0]["params"][name], value, rtol=0, atol=0, msg=name)
