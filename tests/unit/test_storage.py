"""Storage: paths never leave the root, retries cover an outage but not a missing file, secrets are redacted,
and the shared-storage probe tells a node-local folder from shared storage."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from cluster.core.errors import ConfigError, StorageError
from cluster.core.urls import check_relative
from cluster.run.storage import PROBE, Storage, check_probe, redact, write_probe
from cluster.spec.load import load_config

pytestmark = pytest.mark.timeout(60)

ESCAPES = ["../x", "/abs", "..", "a/../../b", "s3://x", "a/..", "..\\x", "a\x00b"]


@pytest.mark.parametrize("name", [*ESCAPES, "a/b", "", ".hidden", "-x", "x" * 129])
def test_config_refuses_run_names_that_are_not_one_folder(name: str) -> None:
    with pytest.raises(ConfigError, match="not a valid run name"):
        load_config(data={"name": name})


@pytest.mark.parametrize("name", ["run", "tiny-cpu", "exp_1.2", "A" * 128])
def test_config_accepts_plain_run_names(name: str) -> None:
    assert load_config(data={"name": name}).name == name


@pytest.mark.parametrize("rel", ESCAPES)
def test_storage_refuses_paths_outside_its_root(tmp_path: object, rel: str) -> None:
    root = f"{tmp_path}/root/run"
    st = Storage(root)
    with pytest.raises(StorageError, match="leave the run's folder"):
        st.write_bytes(rel, b"x")
    with pytest.raises(StorageError, match="leave the run's folder"):
        st.read_bytes(rel)
    with pytest.raises(StorageError, match="leave the run's folder"):
        st.rm(rel, recursive=True)
    with pytest.raises(StorageError):
        check_relative(rel)
    # nothing at all was written next to (or above) the root
    assert not os.path.exists(f"{tmp_path}/root/x")
    assert not os.path.exists(f"{tmp_path}/x")
    assert not os.path.exists("/abs")


def test_storage_writes_nested_paths_inside_root(tmp_path: object) -> None:
    st = Storage(f"{tmp_path}/run")
    st.write_atomic("a/b/c.json", b"{}")
    assert open(f"{tmp_path}/run/a/b/c.json", "rb").read() == b"{}"
    assert st.listdir("a") == ["b"]


class Flaky:
    def __init__(self, failures: int, exc: Exception) -> None:
        self.failures = failures
        self.calls = 0
        self.exc = exc

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        return "ok"


def test_retry_outlasts_an_outage_within_its_time_budget() -> None:
    st = Storage(f"memory://r-{uuid.uuid4().hex}", retries=1, backoff_s=0.05, retry_budget_s=10.0)
    t0 = time.monotonic()
    fn = Flaky(5, ConnectionError("endpoint down"))  # more failures than `retries`, fewer than the budget
    assert st.retry("writing x", fn) == "ok"
    assert fn.calls == 6
    assert time.monotonic() - t0 < 5


def test_retry_gives_up_after_budget_with_a_storage_error() -> None:
    st = Storage(f"memory://r-{uuid.uuid4().hex}", retries=2, backoff_s=0.05, retry_budget_s=0.3)
    fn = Flaky(10**6, ConnectionError("endpoint down"))
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"writing x failed after \d+ attempts over .*endpoint down"):
        st.retry("writing x", fn)
    assert 0.3 <= time.monotonic() - t0 < 3
    assert fn.calls >= 3


def test_missing_file_is_final_and_denied_fails_at_once() -> None:
    st = Storage(f"memory://r-{uuid.uuid4().hex}", retries=5, backoff_s=0.5, retry_budget_s=30)
    fn = Flaky(1, FileNotFoundError("nope"))
    with pytest.raises(FileNotFoundError):
        st.retry("reading x", fn)
    assert fn.calls == 1
    denied = Flaky(1, PermissionError("AccessDenied"))
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="credentials"):
        st.retry("reading x", denied)
    assert denied.calls == 1 and time.monotonic() - t0 < 1


def test_errors_never_carry_storage_option_values() -> None:
    secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCY"
    opts = {"key": "AKIAEXAMPLEKEY42", "secret": secret, "client_kwargs": {"endpoint_url": "http://h:1"}}
    st = Storage(f"memory://r-{uuid.uuid4().hex}", retries=0, backoff_s=0.01, retry_budget_s=0)
    st.options = opts
    fn = Flaky(10, RuntimeError(f"signature with {secret} and AKIAEXAMPLEKEY42 rejected; password=hunter22"))
    with pytest.raises(StorageError) as info:
        st.retry("writing x", fn)
    msg = str(info.value)
    assert secret not in msg and "AKIAEXAMPLEKEY42" not in msg and "hunter22" not in msg
    assert "***" in msg
    assert redact("token: abc123def", {}) == "token=***"


def test_probe_passes_on_the_same_storage(tmp_path: object) -> None:
    st = Storage(f"{tmp_path}/runs/r")
    token = write_probe(st)
    check_probe(Storage(f"{tmp_path}/runs/r"), token, node="node-b")  # another process, same folder
    body = json.loads(st.read_bytes(PROBE))
    assert body["token"] == token


def test_probe_fails_clearly_on_a_node_local_folder(tmp_path: object) -> None:
    driver_side = Storage(f"{tmp_path}/node-a/runs/r")
    token = write_probe(driver_side)
    worker_side = Storage(f"{tmp_path}/node-b/runs/r")  # same path string on another node: another disk
    with pytest.raises(StorageError) as info:
        check_probe(worker_side, token, node="node-b")
    msg = str(info.value)
    assert "not visible from node node-b" in msg
    assert "storage.url=" in msg and "s3://" in msg and "shared mount" in msg
    # a stale probe of an earlier run on the worker's disk does not pass either
    write_probe(worker_side)
    with pytest.raises(StorageError, match="different probe"):
        check_probe(worker_side, token, node="node-b")


def test_probe_on_memory_fs() -> None:
    st = Storage(f"memory://probe-{uuid.uuid4().hex}/r")
    check_probe(st, write_probe(st))
    with pytest.raises(StorageError, match="not visible"):
        check_probe(st, "0" * 32)
