"""``show``/``list``/``watch`` call a run ``interrupted`` as soon as its driver's process is gone from this
machine (the lease names the machine and the pid: ``cluster.run.lease.gone_here``), not only once its
``driver.json`` has aged past ``DRIVER_GONE_S``. A real driver-like process holds the lease and beats."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest

from cluster.__main__ import main
from cluster.inspect import INTERRUPTED, RUNNING, live_status
from cluster.run.storage import Storage

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Takes the run's lease and writes driver.json as a driver does, says so, then dies without releasing
# anything once its stdin closes (as a SIGKILLed driver would: nothing written at the end).
HOLDER = """
import os, sys
from cluster.driver.control import DriverBeat
from cluster.run.lease import Lease
from cluster.run.storage import Storage
run = Storage(sys.argv[1])
run.write_bytes("run.json", b'{"config": {}}')
Lease.take(run, "python pid %d" % os.getpid())
DriverBeat(run, lambda: {"state": "running", "global_step": 7}).start()
print("holding", flush=True)
sys.stdin.read()
os._exit(0)
"""


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def test_a_run_whose_driver_died_here_is_interrupted_at_once_zombie_or_reaped(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        run = Storage(url)
        assert live_status(run, []) == RUNNING  # alive: its driver.json is fresh and its process is here
        assert proc.stdin is not None
        proc.stdin.close()  # it dies; not waited for, so it stays a zombie
        deadline = time.monotonic() + 20
        while _state(proc.pid) != "Z":
            assert time.monotonic() < deadline, "the holder did not exit"
            time.sleep(0.05)
        assert live_status(run, []) == INTERRUPTED  # a zombie is gone, though kill -0 still succeeds
        proc.wait(10)
        assert live_status(run, []) == INTERRUPTED  # reaped: no such process
        capsys.readouterr()
        assert main(["stop", url]) == 2  # no job can answer a request: said, nothing written
        err = capsys.readouterr().err
        assert "is interrupted" in err and "gone from this machine" in err and "nothing to stop" in err, err
        assert not run.exists("control/stop.json") and not run.exists("stop.json")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
