"""A driver of an embedded Ray (``python -m jobs.train`` on this machine) SIGKILLed mid-run leaves no process
of its Ray behind (Ray's DashboardAgent and RuntimeEnvAgent outlive their raylet, under PID 1, and ignore
SIGTERM): none within seconds, and none after the next start even when the driver's watcher died with it.
``python -m cluster show``/``list`` call the run interrupted at once, not only once driver.json is old.

Every process a test starts carries a marker of the test's own in its environment
(``tests.support.procs``): found by it, killed by PID in a ``finally``."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support.procs import MARK, children, cmdline, kill_marked, marked, new_mark, state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.timeout(300)

AGENTS = {"DashboardAgent": "dashboard/agent.py", "RuntimeEnvAgent": "runtime_env/agent/main.py"}
"""Ray's agents: their title once they have renamed themselves (``ray::DashboardAgent``), their script
before."""
GONE_WITHIN_S = 15.0
"""Ray's agents, left alone, give up on their dead raylet's GCS after about a minute."""


@dataclass
class Started:
    proc: subprocess.Popen[str]
    mark: str
    run_url: str
    storage: str
    ray_tmp: str
    stdout: pathlib.Path


def _env(mark: str, ray_tmp: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmp, MARK: mark}
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture
def driver(tmp_path: pathlib.Path, tiny_overrides: list[str]) -> Iterator[Started]:
    """``python -m jobs.train`` on the tiny job (long enough not to end first), training: its first epoch
    is done."""
    ray_tmp = tempfile.mkdtemp(prefix="rk", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    mark = new_mark()
    job = [*tiny_overrides, "name=killed", "training.epochs=500", "failures.hot_spare=auto"]  # its spare too
    sets = [a for o in job for a in ("--set", o)]
    out = tmp_path / "driver.out"
    with open(out, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jobs.train", "--config", "jobs/configs/tiny_cpu.yaml", *sets],
            cwd=REPO,
            env=_env(mark, ray_tmp),
            stdout=fh,
            stderr=subprocess.STDOUT,
            text=True,
        )
    started = Started(proc, mark, f"{tmp_path}/runs/killed", f"{tmp_path}/runs", ray_tmp, out)
    try:
        deadline = time.monotonic() + 180
        while "epoch 1/" not in out.read_text():
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        yield started
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        kill_marked(mark)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "cluster", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=90)


def agents_up(mark: str) -> bool:
    cmds = [cmdline(p) for p in marked(mark)]
    return all(any(title in c or script in c for c in cmds) for title, script in AGENTS.items())


def wait_gone(mark: str, within_s: float) -> dict[int, str]:
    """The marked processes still alive after ``within_s`` (empty once all are gone)."""
    deadline = time.monotonic() + within_s
    left = marked(mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = marked(mark)
    return left


def test_a_killed_driver_leaves_no_process_of_its_ray_and_the_run_is_interrupted_at_once(
    driver: Started,
) -> None:
    deadline = time.monotonic() + 120  # Ray's agents, the processes that outlive a killed driver, are up
    while not agents_up(driver.mark):
        assert time.monotonic() < deadline, {p: cmdline(p)[:80] for p in marked(driver.mark)}
        time.sleep(0.25)
    driver.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    # not waited for yet: the driver is a zombie, and the run already counts as interrupted
    while state(driver.proc.pid) != "Z":
        time.sleep(0.05)
    show = cli("show", driver.run_url)
    assert show.returncode == 0, show.stderr
    assert "status     interrupted" in show.stdout, show.stdout[:400]
    listed = cli("list", driver.storage)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split()[:2] == ["killed", "interrupted"], listed.stdout
    assert time.monotonic() - killed_at < 60  # well before driver.json would have aged
    left = wait_gone(driver.mark, GONE_WITHIN_S - (time.monotonic() - killed_at))
    assert not left, (
        f"processes of the killed driver's Ray still alive {GONE_WITHIN_S:g}s on: {left}; "
        f"the driver's output (its watcher's warnings included) ends: {driver.stdout.read_text()[-2000:]}"
    )


def test_the_next_start_stops_what_a_killed_driver_left_when_its_watcher_died_too(driver: Started) -> None:
    """The driver and whatever of ours watches it (a child running cluster/api/local_ray.py) SIGKILLed
    together: the next embedded Ray started on this machine stops the dead driver's Ray processes before it
    starts, and only those (its own and a live driver's are kept)."""
    watchers = [p for p in children(driver.proc.pid) if "local_ray" in cmdline(p)]
    for pid in [driver.proc.pid, *watchers]:
        os.kill(pid, signal.SIGKILL)
    driver.proc.wait(30)
    assert marked(driver.mark), "nothing of the killed driver's Ray was left to stop: the test proves nothing"
    ray_tmp = tempfile.mkdtemp(prefix="rn", dir="/tmp")
    mark = new_mark()
    code = (
        "from cluster.api import local_ray; local_ray.start(1); print('started', flush=True); "
        "import sys; sys.stdin.read(); local_ray.shutdown()"
    )
    nxt = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=_env(mark, ray_tmp),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert nxt.stdout is not None and nxt.stdout.readline().strip() == "started"
        left = marked(driver.mark)
        assert not left, f"the next start left the killed driver's Ray processes alive: {left}"
        assert marked(mark), "the next start's own Ray is not running"
        assert nxt.stdin is not None
        nxt.stdin.close()
        assert nxt.wait(60) == 0
    finally:
        if nxt.poll() is None:
            nxt.kill()
            nxt.wait(30)
        kill_marked(mark)
        shutil.rmtree(ray_tmp, ignore_errors=True)
