"""Asking a running job, on a real local Ray: `python -m cluster stop` (a file in the run's storage) and
Ctrl-C (SIGINT to the driver) each stop every rank at a step with a checkpoint there, and the run resumed
twice ends bitwise where an uninterrupted run ends; `python -m cluster stacks` says where every rank is;
`python -m cluster profile` records steps of every rank with torch.profiler and changes no number."""

from __future__ import annotations

import gzip
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

from cluster import load_config, train
from cluster.inspect import STOPPED, read_events, run_status
from cluster.run.checkpoint import CheckpointStore
from cluster.run.requests import STOP_FILE
from cluster.run.storage import Storage
from cluster.spec.config import JobConfig
from tests.support.faults import assert_bitwise_equal

pytestmark = pytest.mark.timeout(300)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EPOCHS, STEPS = 3, 20


def config(storage: str, name: str, *extra: str) -> JobConfig:
    return load_config(
        "jobs/configs/tiny_cpu.yaml",
        [
            f"storage={storage}",
            f"name={name}",
            "task=tests.support.tasks:SlowCharLM",
            "task_args.max_chars=40000",
            "task_args.d_model=32",
            "task_args.n_layers=1",
            "task_args.context=32",
            "task_args.dropout=0.1",
            "training.global_batch_size=32",
            f"training.epochs={EPOCHS}",
            f"training.max_steps_per_epoch={STEPS}",
            "training.log_every_steps=1",
            "checkpoint.every_epochs=0",  # the only checkpoints are the stops' and the last
            "failures.hang_timeout_s=20",  # a heartbeat a second
            "failures.hot_spare=false",  # no rank dies: stops, Ctrl-C, profiles
            *extra,
        ],
    )


def events(run_url: str) -> list[dict[str, Any]]:
    try:
        return read_events(Storage(run_url))
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def final_weights(run_url: str) -> dict[str, torch.Tensor]:
    latest = CheckpointStore(Storage(run_url)).load_latest()
    assert latest is not None and latest.info.step == EPOCHS * STEPS
    return latest.files["model.pt"]


def when_training(run_url: str, groups_before: int, action: Any) -> threading.Thread:
    """Run ``action()`` a second after this submission's group started training."""

    def go() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if sum(e["event"] == "group_started" for e in events(run_url)) > groups_before:
                time.sleep(1.0)
                action()
                return
            time.sleep(0.05)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, "-m", "cluster", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def reference(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final weights of the job run once, uninterrupted and unobserved."""
    result = train(config(str(tmp_path_factory.mktemp("reference")), "reference"), out=io.StringIO())
    assert result.status == "finished"
    return final_weights(result.run_url)


def test_stopped_by_the_cli_then_by_ctrl_c_then_resumed_ends_bitwise_as_an_uninterrupted_run(
    reference: dict[str, torch.Tensor], tmp_path: Any
) -> None:
    slow = "task_args.step_sleep_s=0.25"  # time to act mid-run; sleeping changes no number
    cfg = config(str(tmp_path), "stopped", slow)
    run_url = f"{tmp_path}/stopped"

    # 1. `python -m cluster stacks RUN`, then `python -m cluster stop RUN --wait`, from other processes
    stopper: dict[str, subprocess.CompletedProcess[str]] = {}

    def ask() -> None:
        stacks = threading.Thread(
            target=lambda: stopper.setdefault("stacks", cli("stacks", run_url, "--summary"))
        )
        stacks.start()
        time.sleep(0.5)  # asked first: answered before the stop ends the job, at the latest in the same read
        stopper["out"] = cli("stop", run_url, "--wait", "90")
        stacks.join(60)

    when_training(run_url, 0, ask)
    first = train(cfg, out=io.StringIO())
    assert first.status == "stopped" and first.stop_reason is not None
    assert first.stop_reason.startswith("python -m cluster stop by ")
    assert 0 < first.global_step < EPOCHS * STEPS
    deadline = time.monotonic() + 30
    while "out" not in stopper:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    out = stopper["out"]
    assert out.returncode == 0, out.stderr
    stacks = stopper["stacks"]
    assert stacks.returncode == 0, stacks.stderr
    summary = [line for line in stacks.stdout.splitlines() if line.startswith("ranks [")]
    assert sorted(r for line in summary for r in json.loads(line.split(":")[0][len("ranks ") :])) == [0, 1]
    # each rank's line names a frame of the product's or the task's own code (tasks/charlm.py is what
    # tests.support.tasks:SlowCharLM runs when the rank is inside the model's forward)
    own = ("(cluster/", "(tasks/", "support/tasks.py:")
    assert all(any(o in line for o in own) for line in summary), stacks.stdout
    (answered,) = [e for e in events(run_url) if e["event"] == "stacks"]
    assert answered["kind"] == "request" and answered["path"].startswith("diagnostics/")
    assert f"stopped at step {first.global_step}; checkpoint at step {first.global_step}" in out.stdout
    assert not os.path.exists(f"{run_url}/{STOP_FILE}")  # acted on once: a resubmission is not stopped
    ev = events(run_url)
    assert run_status(ev) == STOPPED
    stopped = [e for e in ev if e["event"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["committed"] is True
    assert stopped[0]["checkpoint_step"] == first.global_step  # a checkpoint where every rank stopped
    assert CheckpointStore(Storage(run_url)).list()[-1].step == first.global_step
    again = cli("stop", run_url)  # nothing is training it now
    assert again.returncode == 2 and "is stopped: no job is training it" in again.stderr

    # 2. Ctrl-C: the first SIGINT to the driver stops cleanly (a stray one after the run is ignored here)
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        groups = sum(e["event"] == "group_started" for e in ev)
        when_training(run_url, groups, lambda: os.kill(os.getpid(), signal.SIGINT))
        second = train(cfg, out=io.StringIO())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert second.status == "stopped" and second.stop_reason == "SIGINT"
    assert first.global_step < second.global_step < EPOCHS * STEPS
    ev = events(run_url)
    starts = [e for e in ev if e["event"] == "group_started"]
    assert starts[-1]["resume_step"] == first.global_step  # from the first stop's checkpoint
    assert [e["checkpoint_step"] for e in ev if e["event"] == "stopped"] == [
        first.global_step,
        second.global_step,
    ]

    # 3. resubmitted once more: finishes, bitwise where the uninterrupted run ended
    third = train(cfg, out=io.StringIO())
    assert third.status == "finished" and third.global_step == EPOCHS * STEPS
    starts = [e for e in events(run_url) if e["event"] == "group_started"]
    assert starts[-1]["resume_step"] == second.global_step
    assert_bitwise_equal(reference, final_weights(run_url))


def test_profiling_a_running_job_writes_every_ranks_trace_and_changes_no_number(
    reference: dict[str, torch.Tensor], tmp_path: Any
) -> None:
    cfg = config(str(tmp_path), "profiled", "task_args.step_sleep_s=0.1")
    run_url = f"{tmp_path}/profiled"
    got: dict[str, subprocess.CompletedProcess[str]] = {}
    when_training(
        run_url, 0, lambda: got.setdefault("out", cli("profile", run_url, "--steps", "3", "--wait", "90"))
    )
    result = train(cfg, out=io.StringIO())
    assert result.status == "finished"
    deadline = time.monotonic() + 60
    while "out" not in got:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    out = got["out"]
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("rank 0: 3 step(s) recorded") and "Self CPU" in out.stdout
    (asked,) = [e for e in events(run_url) if e["event"] == "profile_requested"]
    assert asked["ranks"] == [0, 1] and asked["steps"] == 3
    for rank in (0, 1):
        assert f"{run_url}/{asked['folder']}/rank{rank}.pt.trace.json.gz" in out.stdout
        with open(f"{run_url}/{asked['folder']}/rank{rank}.pt.trace.json.gz", "rb") as fh:
            trace = json.loads(gzip.decompress(fh.read()))
        steps = {
            e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")
        }
        assert len(steps) == 3, steps
        names = {str(e.get("name", "")) for e in trace["traceEvents"]}
        assert any("allreduce" in n.lower() or "all_reduce" in n.lower() for n in names)  # DDP's gradients
    assert_bitwise_equal(reference, final_weights(run_url))  # observing it changed nothing
