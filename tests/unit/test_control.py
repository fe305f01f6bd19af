"""The run's control files without a job: the driver's beat (``driver.json``) and what `list`, `show` and
the request commands make of it; stop, stacks and profile requests as files; `watch`; and how long the
survivors of a failure are waited for (``wait_released``, on a fake clock)."""

from __future__ import annotations

import json
import pathlib
import re
import time

import pytest

from cluster.__main__ import main
from cluster.driver.control import DriverBeat
from cluster.inspect import FINISHED, INTERRUPTED, RUNNING, UNFINISHED, format_show, live_status, report
from cluster.run.requests import (
    DRIVER_FILE,
    DRIVER_GONE_S,
    driver_seen,
    read_stop_request,
    write_stop_request,
)
from cluster.run.storage import Storage

pytestmark = pytest.mark.timeout(60)


def ev(event: str, **fields: object) -> dict[str, object]:
    return {"time": time.time(), "event": event, **fields}


def make_run(tmp_path: pathlib.Path, events: list[dict[str, object]]) -> Storage:
    run = Storage(str(tmp_path / "runs" / "r"))
    run.write_atomic("run.json", json.dumps({"name": "r", "config": {"training": {"epochs": 2}}}).encode())
    run.write_atomic("events/000001.jsonl", "".join(json.dumps(e) + "\n" for e in events).encode())
    return run


def test_the_beat_is_written_at_start_on_its_own_thread_and_marked_ended(tmp_path: pathlib.Path) -> None:
    run = Storage(str(tmp_path))
    state = {"state": "starting", "global_step": 0}
    beat = DriverBeat(run, lambda: dict(state), every_s=0.05)
    beat.start()
    first = driver_seen(run)
    assert first is not None and first["state"] == "starting" and first["ended"] is False
    state.update(state="running", global_step=7)
    deadline = time.monotonic() + 5
    while (driver_seen(run) or {}).get("global_step") != 7:  # the thread picks the new fields up
        assert time.monotonic() < deadline
        time.sleep(0.02)
    beat.stop()
    last = driver_seen(run)
    assert last is not None and last["ended"] is True and last["state"] == "running" and last["age_s"] < 5


def test_an_unfinished_run_is_running_or_interrupted_by_its_drivers_beat(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path, [ev("run_start"), ev("group_started", attempt=0)])
    events = [ev("run_start")]
    assert live_status(run, events) == UNFINISHED  # no beat: a run from before it
    beat = {"host": "h", "pid": 42, "state": "running", "global_step": 9, "ended": False}
    run.write_atomic(DRIVER_FILE, json.dumps({**beat, "time": time.time()}).encode())
    assert live_status(run, events) == RUNNING
    shown = format_show(report(run))
    # an absolute time (two `show` calls print the same text)
    assert re.search(r"driver on h, pid 42: running at step 9, last heard from 20\d\d-\d\d-\d\d ", shown), (
        shown
    )
    run.write_atomic(DRIVER_FILE, json.dumps({**beat, "time": time.time() - DRIVER_GONE_S - 1}).encode())
    assert live_status(run, events) == INTERRUPTED  # the driver died without a word
    assert live_status(run, [*events, ev("finished", global_step=9)]) == FINISHED  # the events decide first

    # the request commands refuse at once, naming the driver, and leave nothing behind
    code = main(["stop", run.root])
    assert code == 2 and read_stop_request(run) is None
    assert "is interrupted: its driver (h, pid 42) was last heard of" in capsys.readouterr().err
    run.write_atomic(DRIVER_FILE, json.dumps({**beat, "time": time.time(), "ended": True}).encode())
    assert live_status(run, events) == INTERRUPTED  # ended without a terminal event: killed mid-write


def test_requests_are_files_a_stale_one_is_recognisable(tmp_path: pathlib.Path) -> None:
    run = Storage(str(tmp_path))
    assert read_stop_request(run) is None
    req = write_stop_request(run, "because")
    got = read_stop_request(run)
    assert got == req and got.reason == "because" and got.requested_at <= time.time()
    run.write_atomic("control/stop.json", b"{not json")  # someone asked, in their own way
    assert read_stop_request(run) is not None


def test_watch_prints_events_as_they_land_until_the_run_ends(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading

    first = [ev("run_start"), ev("checkpoint", step=10, bytes=2048), ev("epoch_end", epoch=0, global_step=10)]
    run = make_run(tmp_path, first)
    beat = {
        "host": "h",
        "pid": 42,
        "state": "running",
        "global_step": 10,
        "ended": False,
        "time": time.time(),
    }
    run.write_atomic(DRIVER_FILE, json.dumps(beat).encode())
    later = [
        ev("failure", kind="worker_died", rank=1, step=12, message="rank 1's process died"),
        ev("decision", restart=True, reason="restart 1/3"),
        ev("evaluation", global_step=20, loss=1.5, metrics={"acc": 0.5}),
        ev("finished", global_step=20, loss=1.25),
    ]

    def go() -> None:  # the job goes on while `watch` looks
        time.sleep(0.3)
        lines = "".join(json.dumps(e) + "\n" for e in first + later)
        run.write_atomic("events/000001.jsonl", lines.encode())

    t = threading.Thread(target=go)
    t.start()
    code = main(["watch", run.root, "--interval", "0.1", "--backlog", "1"])
    t.join()
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert [line.split(" UTC ", 1)[1] for line in out[:-1]] == [
        "epoch 1 done: step 10, loss -, - samples/s",  # the backlog: the last one before (epochs from 1)
        "failure: worker_died on rank 1 at step 12: rank 1's process died",
        "decision: restart (restart 1/3)",
        "eval at step 20: loss 1.5000, acc 0.5000",
        "finished: 20 steps, loss 1.25",
    ]
    assert out[-1] == "the run is finished"


# ---------------------------------------------------------------- survivors leaving a failed collective
class Cascade:
    """Survivors that come out of a failed collective at given seconds (None: never); a fake clock."""

    def __init__(self, out_at: dict[str, float | None]) -> None:
        self.out_at, self.now = out_at, 0.0

    def clock(self) -> float:
        return self.now

    def wait(self, refs: list[str], n: int, timeout: float) -> list[str]:
        ready = sorted((t, r) for r in refs if (t := self.out_at[r]) is not None)
        if ready and ready[0][0] <= self.now + timeout:
            self.now = max(self.now, ready[0][0])
            return [ready[0][1]]
        self.now += timeout
        return []


def test_survivors_are_waited_for_while_they_keep_coming_out_and_not_longer() -> None:
    from cluster.worker_group import RELEASE_MAX_S, RELEASE_S, wait_released

    # a slow cascade: each survivor 6 s after the one before, 24 s in all (a fixed 10 s wait keeps 1)
    c = Cascade({"a": 6.0, "b": 12.0, "c": 18.0, "d": 24.0})
    assert wait_released(list(c.out_at), c.wait, c.clock) == ["a", "b", "c", "d"]
    # one really stuck: given up RELEASE_S after the last one came out
    c = Cascade({"a": 1.0, "b": 2.0, "stuck": None})
    assert wait_released(list(c.out_at), c.wait, c.clock) == ["a", "b"] and c.now == 2.0 + RELEASE_S
    # never past RELEASE_MAX_S, however steadily they come
    c = Cascade({f"r{i}": 9.0 * (i + 1) for i in range(8)})
    got = wait_released(list(c.out_at), c.wait, c.clock)
    assert len(got) == int(RELEASE_MAX_S // 9.0) and c.now <= RELEASE_MAX_S
    # none at all: the plain RELEASE_S
    c = Cascade({"x": None})
    assert wait_released(["x"], c.wait, c.clock) == [] and c.now == RELEASE_S
