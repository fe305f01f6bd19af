"""One writer per run, with real jobs: ``python -m jobs.train`` twice on one run, on local storage and on S3
(moto on loopback). The second job exits 2 naming the first; the first, SIGSTOPped (a pause, a partition), is
taken over by a third once its lease's beat stands still; woken up, the first can no longer write (neither its
driver nor its workers' checkpoint commits) and ends with a clear error; the taken-over run finishes bitwise
equal to an undisturbed one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.run.checkpoint import step_dir
from cluster.run.lease import generations, read_holder
from cluster.run.storage import Storage
from tests.support.faults import EPOCHS, NO_SPARE, STEPS, assert_bitwise_equal, final_model, overrides
from tests.support.storage import MotoS3

pytestmark = [pytest.mark.timeout(600)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def job(
    storage: str, name: str, options: dict[str, Any] | None, *extra: str, log: str
) -> subprocess.Popen[str]:
    sets = overrides(storage, name, "task_args.step_sleep_s=0.1", NO_SPARE, *extra)
    if options is not None:
        sets.append(f"storage.options={json.dumps(options)}")
    cmd = [sys.executable, "-m", "jobs.train", "--config", "jobs/configs/tiny_cpu.yaml"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "CLUSTER_LEASE_BEAT_S": "1", "PYTHONPATH": REPO}
    out = open(log, "w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The undisturbed run's final weights (local storage; the same job on S3 trains the same numbers)."""
    root = str(tmp_path_factory.mktemp("ref"))
    p = job(f"{root}/runs", "ref", None, log=f"{root}/ref.log")
    assert p.wait(300) == 0, open(f"{root}/ref.log").read()[-3000:]
    return final_model(f"{root}/runs/ref")


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[str, dict[str, Any] | None]]:
    if request.param == "local":
        yield f"{tmp_path}/runs", None
        return
    moto = request.getfixturevalue("moto_s3")
    assert isinstance(moto, MotoS3)
    yield moto.url("runs"), moto.options


def test_a_second_job_is_refused_and_a_paused_one_is_taken_over_and_fenced(
    where: tuple[str, dict[str, Any] | None], reference: dict[str, Any], tmp_path: Any
) -> None:
    storage, options = where
    run = Storage(f"{storage}/shared", options)
    slow = "task_args.step_sleep_s=1.0"  # ~25 s left after its step-5 checkpoint: the second job sees it run
    first = job(storage, "shared", options, slow, log=f"{tmp_path}/first.log")
    try:
        wait_for(lambda: 5 in _committed(run), 240, "the first job's checkpoint at step 5")
        second = job(storage, "shared", options, log=f"{tmp_path}/second.log")
        assert second.wait(120) == 2
        refused = open(f"{tmp_path}/second.log").read()
        assert "another job is training" in refused and f"pid {first.pid}" in refused, refused[-2000:]
        assert generations(run) == [1]  # the refused job took nothing

        os.kill(first.pid, signal.SIGSTOP)  # a driver paused: its lease stops beating, its workers go on
        third = job(storage, "shared", options, log=f"{tmp_path}/third.log")  # (at the usual pace)
        assert third.wait(400) == 0, open(f"{tmp_path}/third.log").read()[-3000:]
        took = open(f"{tmp_path}/third.log").read()
        assert "watching its beat" in took
        holder = read_holder(run, 2)
        assert holder is not None and holder.released and holder.pid == third.pid
    finally:
        os.kill(first.pid, signal.SIGCONT)
    try:
        code = first.wait(180)
    except subprocess.TimeoutExpired:
        first.kill()
        raise
    woke = open(f"{tmp_path}/first.log").read()
    assert code == 1 and "was taken over by" in woke, woke[-3000:]
    assert generations(run) == [1, 2]
    assert_bitwise_equal(final_model(run.root if options is None else _local_copy(run, tmp_path)), reference)


def _committed(run: Storage) -> set[int]:
    try:
        names = run.listdir("checkpoints")
    except Exception:  # not there yet
        return set()
    return {
        int(n[5:]) for n in names if n.startswith("step_") and run.exists(f"checkpoints/{n}/manifest.json")
    }


def _local_copy(run: Storage, tmp_path: Any) -> str:
    """The S3 run's newest checkpoint, copied to a local run folder that ``final_model`` reads."""
    step = max(_committed(run))
    assert step == EPOCHS * STEPS
    dest = Storage(f"{tmp_path}/copy")
    for name in run.listdir(step_dir(step)):
        rel = f"{step_dir(step)}/{name}"
        dest.write_bytes(rel, run.read_bytes(rel))
    return dest.root
