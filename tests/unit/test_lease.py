"""One writer per run (cluster.run.lease): a live job refuses a second one, a gone one is taken over after its
beat stood still on the reader's own clock, and a job that was taken over can no longer write."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from cluster.driver.control import DriverBeat
from cluster.run.lease import (
    FencedError,
    Holder,
    Lease,
    LeaseHeldError,
    current,
    generations,
    gone_here,
    this_machine,
)
from cluster.run.logs import EventLog
from cluster.run.requests import DRIVER_FILE
from cluster.run.storage import Storage

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def run(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Storage:
    # A live job beats every second and is watched for 2.5 s: a busy machine still runs its beat thread
    # in that time. (A job that does not beat is taken over after the same 2.5 s.)
    monkeypatch.setenv("CLUSTER_LEASE_BEAT_S", "1")
    return Storage(str(tmp_path / "run"))


def test_a_live_job_refuses_a_second_naming_itself_and_a_released_one_lets_it_in(run: Storage) -> None:
    first = Lease.take(run, "raysubmit_first")
    first.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(LeaseHeldError) as err:
            Lease.take(run, "raysubmit_second")
        assert time.monotonic() - t0 < 10  # a couple of beats watched, no more
        text = str(err.value)
        assert "raysubmit_first" in text and "generation 1" in text and "--takeover" in text
        assert generations(run) == [1]  # the refused job wrote nothing
    finally:
        first.release()
    holder = current(run)
    assert holder is not None and holder.released
    second = Lease.take(run, "raysubmit_second")  # at once: released
    assert second.generation == 2 and second.took_over is None
    second.release()


def test_a_job_whose_beat_stands_still_is_taken_over_and_fenced_out(run: Storage) -> None:
    """A killed driver (or a SIGSTOPped one) leaves its lease unreleased and no longer beats: the next job
    watches a few beats, takes the run, and the old one's writes are refused from then on, also after it
    wakes up."""
    old = Lease.take(run, "old")  # never started: it does not beat, like a process that was stopped
    new = Lease.take(run, "new")
    assert new.generation == 2 and new.took_over is not None and new.took_over.job == "old"
    new.check()  # the holder may write
    with pytest.raises(FencedError, match="taken over by job new"):
        old.check()
    log = EventLog(run)
    log.fence = old.check
    with pytest.raises(FencedError):
        log.append("checkpoint", step=9)
    assert not any(r["event"] == "checkpoint" for r in EventLog(run).records())  # nothing written
    old._beat()  # the old beat thread waking up: it stops, and writes nothing
    assert old._stop.is_set() and current(run).job == "new"  # type: ignore[union-attr]
    old.release()  # not ours any more: the new holder's lease stays as it is
    assert not current(run).released  # type: ignore[union-attr]
    new.release()


def test_takeover_does_not_wait_and_fences_even_a_live_job(run: Storage) -> None:
    live = Lease.take(run, "live")
    live.start()
    try:
        t0 = time.monotonic()
        taker = Lease.take(run, "taker", takeover=True)
        assert time.monotonic() - t0 < 5 and taker.generation == 2  # no watching of the beat (2.5 s)
        wait = time.monotonic() + 10
        while live.fenced_by is None and time.monotonic() < wait:
            time.sleep(0.1)  # the live job's next beat sees the newer generation
        assert live.fenced_by is not None and live.fenced_by.job == "taker"
        with pytest.raises(FencedError):
            live.check()
        taker.release()
    finally:
        live.release()


def test_two_jobs_racing_for_a_run_get_different_generations(run: Storage) -> None:
    """Each generation's file is created exclusively: of two jobs starting together, one holds generation 1
    and the other is refused (it sees the first beat) or holds generation 2, never both generation 1."""
    won: list[int] = []
    refused: list[str] = []

    def start(job: str) -> None:
        try:
            lease = Lease.take(run, job)
            lease.start()
            won.append(lease.generation)
            time.sleep(2)
            lease.release()
        except LeaseHeldError as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=start, args=(f"job{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(won) == len(set(won)) and won  # never one generation twice
    assert len(won) + len(refused) == 2


def test_a_driver_that_was_taken_over_no_longer_says_it_runs_the_job(run: Storage) -> None:
    old = Lease.take(run, "old")
    beat = DriverBeat(run, lambda: {"state": "running"}, every_s=60, fence=old.check)
    beat.start()
    assert run.exists(DRIVER_FILE)
    run.rm(DRIVER_FILE)
    Lease.take(run, "new", takeover=True)
    beat.stop()  # its last write is refused
    assert not run.exists(DRIVER_FILE)


def test_a_taken_over_worker_commits_and_deletes_nothing(run: Storage) -> None:
    """Rank 0 of a job that was taken over (its workers train on while its driver is paused): its commit is
    refused before any file of the step is written, and its retention deletes nothing."""
    import torch

    from cluster.run.checkpoint import CheckpointStore, serialize
    from cluster.run.lease import Fence

    files = {"model.pt": serialize({"w": torch.ones(2)}), "train_state.pt": serialize({})}
    old = Lease.take(run, "old")
    store = CheckpointStore(run)
    store.fence = Fence(run, old.generation).check
    store.commit(5, files, {"epoch": 0})
    store.commit(10, files, {"epoch": 0})
    Lease.take(run, "new", takeover=True)
    with pytest.raises(FencedError):
        store.commit(15, files, {"epoch": 0})
    assert store.steps_on_storage() == [5, 10]  # not even the step's folder
    with pytest.raises(FencedError):
        store.retain(keep_last=1)
    assert store.steps_on_storage() == [5, 10]


def test_stop_goes_through_the_lease(run: Storage, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m cluster stop`` names the job it asks (the lease's holder), and says when no job holds
    the run, whatever ``driver.json``'s clock says."""
    from cluster.__main__ import main
    from cluster.run.requests import STOP_FILE

    run.write_bytes("run.json", b'{"name": "run", "config": {}}')
    job = Lease.take(run, "raysubmit_x")
    assert main(["stop", run.root, "--wait", "0"]) == 0
    assert ": job raysubmit_x" in capsys.readouterr().out and run.exists(STOP_FILE)
    run.rm(STOP_FILE)
    job.release()
    assert main(["stop", run.root, "--wait", "0"]) == 2
    assert "no job is training it (the last, job raysubmit_x" in capsys.readouterr().err
    assert not run.exists(STOP_FILE)


HOLD = """
import sys, time
from cluster.run.lease import Lease
from cluster.run.storage import Storage
lease = Lease.take(Storage(sys.argv[1]), "crashed")
lease.start()
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.multiprocess  # starts a process
@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_holder_whose_process_is_gone_from_this_machine_is_taken_over_without_watching(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, reaped: bool
) -> None:
    """A driver SIGKILLed on this machine: its resubmission takes the run at once instead of watching the
    beat stand still for 2.5 intervals (here 2.5 x 30 s: the watch alone would outlast the test's timeout)."""
    import signal
    import subprocess
    import sys

    monkeypatch.setenv("CLUSTER_LEASE_BEAT_S", "30")
    run = Storage(str(tmp_path / "run"))
    child = subprocess.Popen([sys.executable, "-c", HOLD, run.root], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        holder = current(run)
        assert holder is not None and holder.pid == child.pid and holder.machine == this_machine() != ""
        assert not gone_here(holder)  # alive: watched as before
        os.kill(child.pid, signal.SIGKILL)
        if reaped:
            child.wait(timeout=30)
        else:  # killed, not yet reaped by its parent: a zombie, still gone
            deadline = time.monotonic() + 30
            while not gone_here(holder) and time.monotonic() < deadline:
                time.sleep(0.05)
        said: list[str] = []
        t0 = time.monotonic()
        new = Lease.take(run, "resubmitted", say=said.append)
        assert time.monotonic() - t0 < 20  # the watch would take 75 s
        assert new.generation == 2 and new.took_over is not None and new.took_over.job == "crashed"
        assert said and "whose process is gone from this machine" in said[0]
        new.release()
    finally:
        child.kill()
        child.wait(timeout=30)


def test_a_holder_elsewhere_or_alive_is_watched_not_assumed_gone() -> None:
    def holder(pid: int, machine: str) -> Holder:
        return Holder(1, "j", "h", pid, 0.0, 0, 1.0, False, machine)

    mine, no_such_pid = this_machine(), 2**22 + 12345
    assert not gone_here(holder(os.getppid(), mine))  # alive
    assert not gone_here(holder(no_such_pid, "another-boot:1"))  # pids there are not ours to look up
    assert not gone_here(holder(no_such_pid, ""))  # written by an older version: watched
    assert not gone_here(holder(os.getpid(), mine))
    assert gone_here(holder(no_such_pid, mine))
