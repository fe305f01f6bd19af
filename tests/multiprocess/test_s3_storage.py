"""Storage, checkpoints, the probe and Parquet reads against a real S3 API (moto_server on loopback),
including an outage: the server is killed and restarted while a write is retrying."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from cluster.core.errors import ConfigError
from cluster.data.pipeline import read_parquet
from cluster.run.checkpoint import CheckpointStore, CheckpointWriter
from cluster.run.storage import Storage, check_probe, write_probe
from jobs.make_tabular import make_table, write
from tests.support.storage import MotoS3

pytestmark = pytest.mark.timeout(120)


def test_storage_round_trip_on_s3(moto_s3: MotoS3) -> None:
    st = Storage(moto_s3.url("runs/r1"), moto_s3.options)
    assert st.root == "s3://bucket/runs/r1"
    st.write_atomic("run.json", b'{"a": 1}')
    st.write_bytes("metrics/m.parquet", b"x" * 1000)
    assert st.read_bytes("run.json") == b'{"a": 1}'
    assert st.exists("run.json") and not st.exists("nope.json")
    assert st.listdir() == ["metrics", "run.json"]
    assert st.size("metrics/m.parquet") == 1000
    with pytest.raises(FileNotFoundError):
        st.read_bytes("nope.json")
    st.rm("metrics", recursive=True)
    assert st.listdir() == ["run.json"]


def test_checkpoints_and_probe_on_s3(moto_s3: MotoS3) -> None:
    st = Storage(moto_s3.url("runs/r2"), moto_s3.options)
    store = CheckpointStore(st)
    writer = CheckpointWriter(store, keep_last=2)
    w = torch.randn(256, 256)
    for step in (10, 20, 30):
        writer.save(
            step, 0, {"world_size": 1}, {"model.pt": {"w": w * step}, "train_state.pt": {"step": step}}
        )
    writer.close()
    assert [r.error for r in writer.drain()] == [None, None, None]
    assert [i.step for i in store.list()] == [20, 30]
    loaded = CheckpointStore(Storage(moto_s3.url("runs/r2"), moto_s3.options)).load_latest()
    assert loaded is not None and loaded.info.step == 30
    torch.testing.assert_close(loaded.files["model.pt"]["w"], w * 30)
    check_probe(Storage(moto_s3.url("runs/r2"), moto_s3.options), write_probe(st), node="n1")


def test_write_survives_a_storage_outage(moto_s3: MotoS3) -> None:
    """The server dies; a write retries with backoff; the server returns; the write lands whole."""
    st = Storage(moto_s3.url("runs/r3"), moto_s3.options, retries=3, retry_budget_s=60)
    st.write_bytes("before.bin", b"1")
    moto_s3.stop()
    outcome: list[BaseException | None] = []

    def write_during_outage() -> None:
        try:
            st.write_atomic("during.bin", b"z" * 100_000)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    t0 = time.monotonic()
    th = threading.Thread(target=write_during_outage)
    th.start()
    time.sleep(4.0)
    assert not outcome, "the write returned while the server was down"
    moto_s3.start()  # an empty server (moto keeps data in memory): bucket created again
    th.join(timeout=90)
    assert outcome == [None]
    assert time.monotonic() - t0 >= 4.0
    assert st.read_bytes("during.bin") == b"z" * 100_000


def test_read_parquet_from_s3_with_projection(moto_s3: MotoS3) -> None:
    url = moto_s3.url("data/tabular")
    write(url, rows=1000, files=3, storage_options=moto_s3.options)
    cols = read_parquet(url, ["f0", "label"], moto_s3.options)
    expect = make_table(1000)
    assert set(cols) == {"f0", "label"}
    np.testing.assert_array_equal(cols["label"], expect.column("label").to_numpy())
    np.testing.assert_allclose(cols["f0"], expect.column("f0").to_numpy())
    one = read_parquet(url + "/part-001.parquet", ["id"], moto_s3.options)["id"]
    glob = read_parquet(url + "/part-00[01].parquet", ["id"], moto_s3.options)["id"]
    assert len(one) == 334 and len(glob) == 668
    with pytest.raises(ConfigError, match="has no Parquet files"):
        read_parquet(moto_s3.url("data/missing"), ["f0"], moto_s3.options)
    with pytest.raises(ConfigError, match="no column 'f99'"):
        read_parquet(url, ["f99"], moto_s3.options)


@pytest.mark.slow  # > 10 s on 2 cores: full suite only
def test_checkpoint_whose_upload_failed_is_reported_and_never_used(moto_s3: MotoS3) -> None:
    st = Storage(moto_s3.url("runs/r4"), moto_s3.options, retries=1, backoff_s=0.1, retry_budget_s=1.0)
    store = CheckpointStore(st)
    writer = CheckpointWriter(store, keep_last=3)
    writer.save(1, 0, {}, {"model.pt": {"w": torch.ones(10)}, "train_state.pt": {"step": 1}})
    writer.wait()
    moto_s3.stop()
    writer.save(2, 0, {}, {"model.pt": {"w": torch.ones(10) * 2}, "train_state.pt": {"step": 2}})
    writer.wait()  # retries exhausted while the server is down
    records = writer.drain()
    assert [r.step for r in records] == [1, 2]
    assert records[0].error is None
    assert (
        records[1].error is not None
        and "StorageError" in records[1].error
        and "testing" not in records[1].error
    )
    moto_s3.start()  # empty again; put step 1 back as if it had survived
    writer.save(1, 0, {}, {"model.pt": {"w": torch.ones(10)}, "train_state.pt": {"step": 1}})
    writer.close()
    assert [i.step for i in store.list()] == [1]
    loaded = store.load_latest()
    assert loaded is not None and loaded.info.step == 1


def test_failing_storage_error_never_shows_secrets(moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver whose storage is down fails with a StorageError that names the URL but no option value."""
    from cluster import load_config
    from cluster.core.errors import StorageError
    from cluster.driver.driver import Driver
    from cluster.run import storage

    secret = "s3cr3t-Do-Not-Leak-1b2c"
    # the endpoint itself carries a credential (userinfo), as some proxies' URLs do; botocore echoes it
    endpoint = f"http://admin:{secret}@127.0.0.1:{moto_s3.port}"
    opts = {"key": "AKIA-LEAK-CHECK", "secret": secret, "client_kwargs": {"endpoint_url": endpoint}}
    moto_s3.stop()
    monkeypatch.setattr(storage, "RETRY_BUDGET_S", 0.5)
    monkeypatch.setattr(storage, "RETRIES", 1)
    cfg = load_config("jobs/configs/tiny_cpu.yaml", [f"storage={moto_s3.url('runs')}", "name=leak"])
    cfg.storage.options = opts
    with pytest.raises(StorageError) as info:
        Driver(cfg, group_factory=lambda *a: pytest.fail("nothing may start")).run()  # type: ignore[arg-type]
    msg = str(info.value)
    assert "s3://bucket/runs/leak" in msg
    assert secret not in msg and "AKIA-LEAK-CHECK" not in msg


def test_a_file_another_client_created_after_a_listing_is_read_and_seen(moto_s3: MotoS3) -> None:
    """s3fs answers "missing" from a listing it cached, for a file another process created since: the
    storage looks again past the cache (a lease's newer generation, a manifest written by rank 0)."""
    import s3fs

    run = Storage(moto_s3.url("runs/cache"), moto_s3.options)
    run.write_bytes("lease/gen_000001.json", b"1")
    assert run.listdir("lease") == ["gen_000001.json"]  # the listing is cached now
    other = s3fs.S3FileSystem(skip_instance_cache=True, **moto_s3.options)
    other.pipe_file("bucket/runs/cache/lease/gen_000002.json", b"2")
    assert run.exists("lease/gen_000002.json")
    assert run.read_bytes("lease/gen_000002.json") == b"2"
