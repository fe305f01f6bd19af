"""A driver SIGKILLed mid-epoch (``ray job stop`` past its wait, an OOM, a lost head): the step rows up to its
last flush (``metrics.flush_s``) are on storage, the rows of the steps its workers trained after it are beside
the checkpoint they committed, and the resubmission writes the rows of every step it trains: each step's row
once on the path the run took."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from cluster.inspect import read_events, run_metrics
from cluster.run.logs import COMMIT_ROWS, read_metric_parts, read_metrics
from cluster.run.storage import Storage
from tests.support.faults import EPOCHS, NO_SPARE, STEPS, overrides
from tests.support.goodput import account

pytestmark = [pytest.mark.timeout(400)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def job(storage: str, log: str, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "jobs.train", "--config", "jobs/configs/tiny_cpu.yaml"]
    for s in overrides(storage, "killed", "metrics.flush_s=0", NO_SPARE, *extra):
        cmd += ["--set", s]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "CLUSTER_LEASE_BEAT_S": "1", "PYTHONPATH": REPO}
    out = open(log, "w")
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def test_a_killed_driver_s_rows_are_on_storage_and_the_resubmission_completes_them(tmp_path: Any) -> None:
    storage = f"{tmp_path}/runs"
    run = Storage(f"{storage}/killed")
    began = time.monotonic()
    first = job(storage, f"{tmp_path}/first.log", "task_args.step_sleep_s=0.5")
    try:
        deadline = time.monotonic() + 240
        steps: list[int] = []
        while time.monotonic() < deadline:  # rows of the first epoch, before its end (no epoch_end yet)
            rows = read_metrics(run).to_pylist() if run.exists("metrics") else []
            steps = sorted(r["global_step"] for r in rows if r["kind"] == "step")
            if len(steps) >= 4 and not any(e["event"] == "epoch_end" for e in read_events(run)):
                break
            time.sleep(0.3)
        os.kill(first.pid, signal.SIGKILL)  # the driver, as an OOM kill or a lost head would
        first.wait(30)
    finally:
        _kill_group(first)  # and what its embedded Ray left behind (its own session: this test's alone)
    assert len(steps) >= 4 and steps[-1] < STEPS, steps  # streamed mid-epoch, before the epoch ended
    on_storage = sorted(r["global_step"] for r in read_metrics(run).to_pylist() if r["kind"] == "step")
    assert on_storage[: len(steps)] == steps  # what was flushed is still there

    again = job(storage, f"{tmp_path}/again.log")
    try:
        assert again.wait(300) == 0, open(f"{tmp_path}/again.log").read()[-3000:]
    finally:
        _kill_group(again)
    final = [r["global_step"] for r in run_metrics(run.root).to_pylist() if r["kind"] == "step"]
    (started,) = [e for e in read_events(run) if e["event"] == "group_started" and e["resume_step"] > 0]
    resumed = started["resume_step"]
    # Every step of the run has its row, once: the ones flushed before the kill, the ones the killed
    # driver's workers trained in the seconds before Ray ended them (rank 0 wrote them beside the checkpoint
    # the resubmission resumed from), and every one the resubmission trained.
    assert final[: len(steps)] == steps
    assert final == list(range(1, EPOCHS * STEPS + 1)), (resumed, steps, final)
    beside = read_metric_parts(run, COMMIT_ROWS)
    assert beside, "rank 0 wrote no rows beside its commits"
    # the goodput account goes on across the kill: the resubmission continued the killed driver's, the
    # gap between them is the driver's, and the whole account fits in the harness's clock
    g = account(run.root, time.monotonic() - began)
    assert g.seconds["driver_down"] > 0 and sorted({a.split(".")[0] for a in g.attempts}) == ["1", "2"]
    # every step the resubmission trained is counted (its first is its start's); of the killed driver's,
    # those up to its last event or beat (docs/goodput.md: what it does not see)
    assert EPOCHS * STEPS - resumed - 1 <= g.steps["productive"] <= EPOCHS * STEPS, g.steps


def _kill_group(p: subprocess.Popen[str]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone, with everything it started
        pass
    p.wait(30)
