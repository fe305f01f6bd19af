"""`ray job submit` against a real Ray head started with `ray start --head`, as a user runs the product:
the job trains and checkpoints, a resubmit resumes, `ray job stop` stops it at a step with a checkpoint
there and shuts the workers down, a bad config
fails the job with a message naming the field, the workers run the shipped --working-dir code, and token
authentication works end to end.

    pytest tests/cluster/test_job_submit.py -m cluster
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from cluster.inspect import read_events
from cluster.run.checkpoint import CheckpointStore
from cluster.run.storage import Storage
from tests.cluster.rayproc import EXCLUDES, REPO, Head, owned_pids

RUNTIME_ENV = json.dumps({"excludes": EXCLUDES})


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    """A real head (4 CPUs, dashboard on loopback), token auth off, a HOME and temp dir of its own."""
    temp = tempfile.mkdtemp(prefix="hj", dir="/tmp")  # short: Ray's socket paths must stay under 108 bytes
    home = tempfile.mkdtemp(prefix="hjhome", dir="/tmp")
    h = Head(temp, home)
    try:
        h.start()
        yield h
    finally:
        try:
            h.stop()
            assert owned_pids([temp]) == [], "processes of the test's Ray head are still alive"
        finally:
            shutil.rmtree(temp, ignore_errors=True)
            shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def storage_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="hjruns", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def small(storage: str, name: str, *extra: str) -> list[str]:
    """The tiny char-LM job at test size (the tiny_overrides of tests/conftest.py), as `--set` arguments."""
    overrides = [
        f"storage={storage}",
        f"name={name}",
        "task_args.max_chars=40000",
        "task_args.d_model=32",
        "task_args.n_layers=1",
        "task_args.context=32",
        "training.global_batch_size=32",
        "training.log_every_steps=1",
        "failures.hang_timeout_floor_s=60",
        "failures.hot_spare=false",
        "training.epochs=1",
        "checkpoint.every_steps=10",
        *extra,
    ]
    return [a for o in overrides for a in ("--set", o)]


def submit(
    h: Head,
    *job_args: str,
    options: tuple[str, ...] = (),
    timeout: float = 240,
    env: dict[str, str] | None = None,
    env_vars: dict[str, str] | None = None,
):  # type: ignore[no-untyped-def]
    runtime_env = json.dumps({"excludes": EXCLUDES, "env_vars": env_vars}) if env_vars else RUNTIME_ENV
    return h.job(
        "submit",
        "--working-dir",
        REPO,
        "--runtime-env-json",
        runtime_env,
        *options,
        "--",
        "python",
        "-m",
        "jobs.train",
        "--config",
        "jobs/configs/tiny_cpu.yaml",
        *job_args,
        timeout=timeout,
        env=env,
    )


def events(storage: str, name: str) -> list[dict]:  # type: ignore[type-arg]
    return read_events(Storage(os.path.join(storage, name)))


def status(h: Head, job_id: str) -> str:
    from ray.job_submission import JobSubmissionClient

    return str(JobSubmissionClient(h.address).get_job_status(job_id).value)


@pytest.mark.timeout(240)
def test_submit_trains_and_checkpoints(head: Head, storage_dir: str) -> None:
    proc = submit(head, *small(storage_dir, "submit"))
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "result: status=finished" in proc.stdout, proc.stdout[-6000:]
    latest = CheckpointStore(Storage(os.path.join(storage_dir, "submit"))).load_latest()
    assert latest is not None and latest.info.step > 0
    assert [e["event"] for e in events(storage_dir, "submit")][-1] == "finished"


@pytest.mark.timeout(240)
def test_resubmit_resumes(head: Head, storage_dir: str) -> None:
    store = CheckpointStore(Storage(os.path.join(storage_dir, "submit")))
    before = store.load_latest()
    assert before is not None, "test_submit_trains_and_checkpoints must run first"
    proc = submit(head, *small(storage_dir, "submit", "training.epochs=2"))
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert f"starting from step {before.info.step}" in proc.stdout, proc.stdout[-6000:]
    starts = [e for e in events(storage_dir, "submit") if e["event"] == "group_started"]
    assert starts[-1]["resume_step"] == before.info.step > 0
    after = store.load_latest()
    assert after is not None and after.info.step > before.info.step


@pytest.mark.timeout(240)
def test_job_stop_stops_at_a_step_with_a_checkpoint_there_and_shuts_workers_down(
    head: Head, storage_dir: str
) -> None:
    job_id = f"stop-{secrets.token_hex(3)}"
    proc = submit(
        head,
        *small(storage_dir, "stopped", "training.epochs=50"),
        options=("--no-wait", "--submission-id", job_id),
        timeout=120,
        env_vars={"RAY_JOB_STOP_WAIT_TIME_S": "60"},  # the time `ray job stop` gives before SIGKILL
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    store = CheckpointStore(Storage(os.path.join(storage_dir, "stopped")))
    deadline = time.monotonic() + 150
    while not store.list():
        assert time.monotonic() < deadline, head.job("logs", job_id, timeout=60).stdout[-6000:]
        assert status(head, job_id) in ("PENDING", "RUNNING"), head.job("logs", job_id, timeout=60).stdout[
            -6000:
        ]
        time.sleep(0.5)
    stop = head.job("stop", job_id, timeout=90)
    assert stop.returncode == 0, stop.stdout[-4000:]
    assert status(head, job_id) == "STOPPED"
    # The worker actors (processes titled ray::_WorkerActor...) are gone, not left training.
    deadline = time.monotonic() + 20
    while workers_alive(head):
        assert time.monotonic() < deadline, (
            f"worker actors still alive after `ray job stop`: {workers_alive(head)}"
        )
        time.sleep(0.5)
    logs = head.job("logs", job_id, timeout=60).stdout
    assert "stopping (SIGTERM): every rank stops after step" in logs, logs[-6000:]
    assert "kills this driver 60s after its SIGTERM" in logs, logs[-6000:]  # how long it has, said
    assert "result: status=stopped" in logs, logs[-6000:]
    ev = events(storage_dir, "stopped")
    (stopped,) = [e for e in ev if e["event"] == "stopped"]
    assert stopped["reason"] == "SIGTERM" and stopped["committed"] is True
    assert stopped["checkpoint_step"] == stopped["global_step"]  # nothing trained since is lost
    latest = store.load_latest()
    assert latest is not None and latest.info.step == stopped["global_step"] > 0
    assert all(e["event"] != "finished" for e in ev)


def workers_alive(h: Head) -> list[int]:
    found = []
    for pid in owned_pids([h.temp_dir]):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if fh.read().startswith(b"ray::_WorkerActor"):
                    found.append(pid)
        except OSError:
            pass
    return found


@pytest.mark.timeout(120)
def test_bad_config_fails_the_job_with_the_field_named(head: Head, storage_dir: str) -> None:
    job_id = f"bad-{secrets.token_hex(3)}"
    proc = submit(head, *small(storage_dir, "bad", "training.epochs=0"), options=("--submission-id", job_id))
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert status(head, job_id) == "FAILED"
    logs = head.job("logs", job_id, timeout=60).stdout
    assert "config error: training.epochs=0 must be at least 1" in logs, logs[-4000:]
    assert not os.path.exists(os.path.join(storage_dir, "bad")), "a bad config must write nothing"


@pytest.mark.timeout(240)
def test_workers_run_the_shipped_code_or_refuse(head: Head, storage_dir: str, tmp_path: object) -> None:
    """The job's code, not the node's editable install of this repo, is what the workers run: a
    --working-dir copy that differs from the installed package trains (the worker group compares the
    workers' `cluster` sources with the driver's and refuses a mismatch); the same modified copy reaching
    only the driver (PYTHONPATH, no --working-dir) is refused before training, with the fix named."""
    copy = os.path.join(str(tmp_path), "repo")
    for pkg in ("cluster", "jobs"):
        shutil.copytree(
            os.path.join(REPO, pkg), os.path.join(copy, pkg), ignore=shutil.ignore_patterns("__pycache__")
        )
    with open(os.path.join(copy, "cluster", "rank", "worker.py"), "a") as fh:
        fh.write("\n# a local change that the installed package does not have\n")

    shipped = head.job(
        "submit",
        "--working-dir",
        copy,
        "--",
        "python",
        "-m",
        "jobs.train",
        "--config",
        "jobs/configs/tiny_cpu.yaml",
        *small(storage_dir, "shipped"),
        timeout=200,
    )
    assert shipped.returncode == 0, shipped.stdout[-6000:]
    assert CheckpointStore(Storage(os.path.join(storage_dir, "shipped"))).load_latest() is not None

    script = (
        f"cd {tmp_path} && PYTHONPATH={copy} python -m jobs.train --config {copy}/jobs/configs/tiny_cpu.yaml "
        + " ".join(small(storage_dir, "mixed"))
    )
    mixed = head.job("submit", "--", "bash", "-c", script, timeout=200)
    assert mixed.returncode != 0, mixed.stdout[-6000:]
    assert f"imports the cluster package from {REPO}/cluster" in mixed.stdout, mixed.stdout[-6000:]
    assert f"driver runs {copy}/cluster" in mixed.stdout and "--working-dir" in mixed.stdout
    assert CheckpointStore(Storage(os.path.join(storage_dir, "mixed"))).list() == []


@pytest.mark.timeout(180)
def test_token_auth(tmp_path: object) -> None:
    token = secrets.token_hex(32)
    temp = tempfile.mkdtemp(prefix="ha", dir="/tmp")
    home = tempfile.mkdtemp(prefix="hahome", dir="/tmp")
    h = Head(temp, home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    try:
        h.start()
        storage = os.path.join(str(tmp_path), "runs")
        ok = submit(h, *small(storage, "auth", "checkpoint.every_steps=0"), env=h.env)
        assert ok.returncode == 0, ok.stdout[-6000:]
        assert CheckpointStore(Storage(os.path.join(storage, "auth"))).load_latest() is not None

        # A client that sends no token: the head answers 401.
        anonymous = dict(h.env, HOME=str(tmp_path), RAY_AUTH_MODE="disabled")
        anonymous.pop("RAY_AUTH_TOKEN")
        denied = submit(h, *small(storage, "denied"), env=anonymous, timeout=60)
        assert denied.returncode != 0
        assert "Unauthorized: Missing authentication token" in denied.stdout, denied.stdout[-4000:]
        # Token mode on the client but no token anywhere: refused before anything is sent.
        tokenless = dict(anonymous, RAY_AUTH_MODE="token")
        missing = submit(h, *small(storage, "denied"), env=tokenless, timeout=60)
        assert missing.returncode != 0
        assert "couldn't find an authentication token" in missing.stdout, missing.stdout[-4000:]
        # A wrong token: the head answers 403.
        wrong = dict(h.env, RAY_AUTH_TOKEN=secrets.token_hex(32))
        refused = submit(h, *small(storage, "denied"), env=wrong, timeout=60)
        assert refused.returncode != 0
        assert "Forbidden: Invalid authentication token" in refused.stdout, refused.stdout[-4000:]
        assert not os.path.exists(os.path.join(storage, "denied"))
    finally:
        try:
            h.stop()
        finally:
            shutil.rmtree(temp, ignore_errors=True)
            shutil.rmtree(home, ignore_errors=True)


@pytest.mark.timeout(420)
def test_the_python_api_submits_follows_and_stops_a_job(head: Head, storage_dir: str) -> None:
    """`cluster.submit`: a config mistake is refused here, before a job exists; a config file with overrides
    runs to its end on the head, followed through storage; a JobConfig is stopped through the API, every
    rank at a step with a checkpoint there (the job was given time to: RAY_JOB_STOP_WAIT_TIME_S)."""
    import io

    from ray.job_submission import JobSubmissionClient

    from cluster import load_config
    from cluster import submit as api_submit
    from cluster.core.errors import ConfigError

    config = os.path.join(REPO, "jobs/configs/tiny_cpu.yaml")
    client = JobSubmissionClient(head.address)
    before = len(client.list_jobs())
    with pytest.raises(ConfigError, match="unknown key 'trainig'"):
        api_submit(config, ["trainig.epochs=2"], address=head.address, working_dir=REPO)
    with pytest.raises(ConfigError, match="is outside working_dir"):
        api_submit(config, [f"storage={storage_dir}"], address=head.address, working_dir=f"{REPO}/cluster")
    assert len(client.list_jobs()) == before  # nothing was submitted

    overrides = small(storage_dir, "api", "training.max_steps_per_epoch=6")[1::2]
    job = api_submit(config, overrides, address=head.address, working_dir=REPO)
    out = io.StringIO()
    assert job.wait(timeout_s=240, out=out, every_s=1) == "SUCCEEDED", job.logs()[-4000:]
    assert "finished:" in out.getvalue() and job.run_status() == "finished"
    assert "result: status=finished" in job.logs()

    cfg = load_config(config, small(storage_dir, "api-stop", "training.epochs=50")[1::2])
    job = api_submit(cfg, address=head.address, working_dir=REPO)
    store = CheckpointStore(Storage(os.path.join(storage_dir, "api-stop")))
    deadline = time.monotonic() + 150
    while not store.list():
        assert time.monotonic() < deadline and job.status() in ("PENDING", "RUNNING"), job.logs()[-4000:]
        time.sleep(0.5)
    job.stop()
    assert job.wait(timeout_s=120, every_s=1) == "STOPPED"
    (stopped,) = [e for e in events(storage_dir, "api-stop") if e["event"] == "stopped"]
    assert stopped["reason"] == "SIGTERM" and stopped["committed"] is True
    assert job.run_status() == "stopped"
