"""Whole jobs on a local Ray with real storage: S3 (moto_server) for a run, its resume, and a Parquet dataset;
a corrupted latest checkpoint skipped on resume; storage options never written anywhere."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from cluster import load_config, train
from cluster.inspect import read_events
from cluster.run.checkpoint import CheckpointStore, step_dir
from cluster.run.logs import read_metrics
from cluster.run.storage import Storage
from jobs.make_tabular import write
from tests.support.storage import MotoS3

SECRET = "s3cr3t-Do-Not-Leak-7f3a9c"


def s3_options(moto: MotoS3) -> dict[str, Any]:
    # moto does not check credentials: any secret works, so we can check it never leaks
    return {**moto.options, "secret": SECRET}


def events(st: Storage) -> list[dict[str, Any]]:
    return read_events(st)


@pytest.mark.timeout(240)
def test_tiny_job_on_s3_then_resume_from_s3(
    ray_local: None, tiny_overrides: list[str], moto_s3: MotoS3
) -> None:
    over = [*tiny_overrides, f"storage={moto_s3.url('runs')}", "name=s3run", "checkpoint.every_steps=10"]
    cfg = load_config("jobs/configs/tiny_cpu.yaml", [*over, "epochs=1"])
    cfg.storage.options = s3_options(moto_s3)
    first = train(cfg)
    assert first.status == "finished" and first.run_url == "s3://bucket/runs/s3run"
    steps1 = first.global_step
    assert first.latest_checkpoint == f"s3://bucket/runs/s3run/{step_dir(steps1)}"

    st = Storage("s3://bucket/runs/s3run", s3_options(moto_s3))
    store = CheckpointStore(st)
    assert store.list()[-1].step == steps1
    store.read_verified(store.list()[-1])  # checksums hold on S3

    cfg2 = load_config("jobs/configs/tiny_cpu.yaml", [*over, "epochs=2"])
    cfg2.storage.options = s3_options(moto_s3)
    second = train(cfg2)
    assert second.status == "finished"
    assert second.global_step == 2 * steps1
    started = [e for e in events(st) if e["event"] == "group_started"]
    assert started[-1]["resume_step"] == steps1 and started[-1]["resume_epoch"] == 1
    assert store.list()[-1].step == 2 * steps1
    assert st.listdir("metrics")

    # storage.options values appear nowhere the run wrote
    for rel in ("run.json", *(f"events/{n}" for n in st.listdir("events"))):
        assert SECRET not in st.read_bytes(rel).decode()
    assert json.loads(st.read_bytes("run.json"))["config"]["storage"]["options"]["secret"] == "***"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("lazy", [False, True], ids=["in-memory", "lazy"])
def test_tabular_task_reads_parquet_from_s3(
    ray_local: None, tmp_path: Any, moto_s3: MotoS3, lazy: bool
) -> None:
    data, held_out = moto_s3.url("data/tabular"), moto_s3.url("data/tabular-eval")
    write(data, rows=2000, files=2, storage_options=moto_s3.options, row_group_rows=125 if lazy else None)
    # an eval set on S3 too (lazy: read one batch ahead of each forward, ParquetDataset.read_ahead)
    write(held_out, rows=600, files=2, storage_options=moto_s3.options, row_group_rows=50 if lazy else None)
    # lazy: ParquetDataset, 16 row groups read from S3 on demand, shuffled in windows of 2
    extra = ["task_args.cache_mb=0.1", "task_args.window=2"] if lazy else []
    cfg = load_config(
        "jobs/configs/tabular_cpu.yaml",
        [
            f"storage={tmp_path}/runs",
            f"task_args.dataset={data}",
            f"task_args.eval_dataset={held_out}",
            "epochs=2",
            "task_args.hidden=32",
            "task_args.lr=0.01",
            "training.log_every_steps=1",
            *extra,
        ],
    )
    cfg.task_args["storage_options"] = moto_s3.options
    result = train(cfg)
    assert result.status == "finished"
    assert result.global_step == 2 * (2000 // 256)
    assert result.global_step == 14  # 2000 rows read from S3: 7 steps of 256 per epoch
    assert result.metrics["loss"] < 1.3  # learnable data: below chance, ln(4)=1.386
    # the task's extra metric (compute_loss's dict) is recorded: per step, and as each epoch's mean of its
    # steps
    rows = read_metrics(Storage(result.run_url)).to_pylist()
    for epoch in (0, 1):
        steps = [r["m_acc"] for r in rows if r["kind"] == "step" and r["epoch"] == epoch]
        (mean,) = [r["m_acc"] for r in rows if r["kind"] == "epoch" and r["epoch"] == epoch]
        assert len(steps) == 7 and all(0.0 <= a <= 1.0 for a in steps)
        assert mean == pytest.approx(sum(steps) / len(steps), rel=1e-9)
    assert result.metrics["acc"] == mean and mean > 0.25  # above chance for 4 classes
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [(r["global_step"], r["eval_samples"]) for r in evals] == [(7, 600), (14, 600)]  # every row once
    assert evals[-1]["m_acc"] > 0.25 and result.evaluation is not None
    assert result.evaluation["loss"] == evals[-1]["loss"]


@pytest.mark.timeout(240)
def test_corrupted_latest_is_skipped_on_resume(
    ray_local: None, tiny_overrides: list[str], tmp_path: Any
) -> None:
    over = [*tiny_overrides, "name=corrupt", "checkpoint.every_steps=10"]
    first = train(load_config("jobs/configs/tiny_cpu.yaml", [*over, "epochs=1"]))
    latest = first.global_step
    root = f"{tmp_path}/runs/corrupt"
    store = CheckpointStore(Storage(root))
    previous = store.list()[-2].step
    model = f"{root}/{step_dir(latest)}/model.pt"
    data = bytearray(open(model, "rb").read())
    data[len(data) // 2] ^= 0xFF
    with open(model, "wb") as fh:
        fh.write(bytes(data))

    second = train(load_config("jobs/configs/tiny_cpu.yaml", [*over, "epochs=2"]))
    assert second.status == "finished" and second.global_step == 2 * latest
    evs = events(Storage(root))
    skipped = [e for e in evs if e["event"] == "checkpoint_skipped"]
    assert [e["step"] for e in skipped] == [latest]
    assert "checksum" in skipped[0]["reason"]
    started = [e for e in evs if e["event"] == "group_started"]
    assert started[-1]["resume_step"] == previous


@pytest.mark.timeout(120)
def test_storage_only_visible_to_driver_fails_with_clear_error(
    ray_local: None, tiny_overrides: list[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that cannot see the driver's probe refuses to train and names the setting to change."""
    import cluster.driver.driver as driver_mod
    from cluster.run import storage as storage_mod

    # the driver writes its probe into one folder; workers are pointed at another (a node-local disk)
    real = storage_mod.write_probe

    def probe_elsewhere(st: Storage) -> str:
        return real(Storage(f"{tmp_path}/driver-only-disk"))

    monkeypatch.setattr(driver_mod, "write_probe", probe_elsewhere)
    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml", [*tiny_overrides, "name=probe"]
    )  # default max_failures: must not retry
    with pytest.raises(Exception, match=r"storage.url=.* is not visible from node .*shared mount"):
        train(cfg)
    assert not os.path.exists(f"{tmp_path}/runs/probe/checkpoints")


@pytest.mark.timeout(120)
def test_a_lazy_dataset_with_schema_drift_fails_before_training(ray_local: None, tmp_path: Any) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cluster import ConfigError

    data = f"{tmp_path}/drift"
    write(data, rows=400, files=2)
    drifted = pq.read_table(f"{data}/part-001.parquet")
    drifted = drifted.set_column(0, "f0", pa.array(np.zeros(drifted.num_rows, dtype=np.int32)))
    pq.write_table(drifted, f"{data}/part-001.parquet")
    cfg = load_config(
        "jobs/configs/tabular_cpu.yaml",
        [f"storage={tmp_path}/runs", f"task_args.dataset={data}", "task_args.cache_mb=16"],
    )
    with pytest.raises(
        ConfigError, match=r"column 'f0' is float.* in .*part-000.parquet but int32 in .*part-001"
    ) as e:
        train(cfg)
    assert "Traceback" not in str(e.value)
    started = [
        e
        for e in read_events(Storage(f"{tmp_path}/runs/tabular-cpu"))
        if e["event"] in ("group_started", "epoch_end")
    ]
    assert not started  # no rank got past set-up
