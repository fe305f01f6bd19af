"""`python -m cluster rewind`: a run no job trains goes back to a verified checkpoint; the newer ones are
deleted only with --yes, and the event log says who did it."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch

from cluster.__main__ import main
from cluster.inspect import format_show, read_events, report
from cluster.run.checkpoint import CheckpointStore, serialize
from cluster.run.lease import FencedError, Lease
from cluster.run.storage import Storage

pytestmark = pytest.mark.timeout(60)


def make_run(tmp_path: Any) -> str:
    run = f"{tmp_path}/runs/lm"
    storage = Storage(run)
    storage.write_bytes("run.json", json.dumps({"config": {"task": "my:Task"}}).encode())
    store = CheckpointStore(storage)
    for step in (10, 20, 30, 40):
        files = {"model.pt": serialize({"w": torch.full((2,), float(step))}), "train_state.pt": serialize({})}
        store.commit(step, files, {"epoch": 0})
    return run


def test_rewind_lists_then_deletes_the_newer_checkpoints(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path)
    store = CheckpointStore(Storage(run))
    assert main(["rewind", run, "--to", "20"]) == 2  # without --yes: says what it would delete
    assert "would delete the checkpoints after step 20 of" in capsys.readouterr().err
    assert store.steps_on_storage() == [10, 20, 30, 40]
    assert main(["rewind", run, "--to", "20", "--yes"]) == 0
    assert "deleted the checkpoints [30, 40]" in capsys.readouterr().out
    assert store.steps_on_storage() == [10, 20]
    loaded = store.load_latest()
    assert loaded is not None and loaded.info.step == 20  # what the next submission resumes from
    (ev,) = [e for e in read_events(Storage(run)) if e["event"] == "rewound"]
    assert ev["to_step"] == 20 and ev["deleted"] == [30, 40] and "@" in ev["by"]
    assert "rewound to step 20 by" in format_show(report(Storage(run)))
    assert main(["rewind", run, "--to", "20", "--yes"]) == 0
    assert "already its newest checkpoint" in capsys.readouterr().out


def test_rewind_refuses_a_missing_step_and_a_run_a_job_trains(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path)
    assert main(["rewind", run, "--to", "25", "--yes"]) == 2
    assert "cannot rewind to step 25: no checkpoint at step 25" in capsys.readouterr().err
    monkeypatch.setenv("CLUSTER_LEASE_BEAT_S", "1")  # watched 2.5 s: a busy machine still beats in that
    job = Lease.take(Storage(run), "the training job")  # a live job: its lease beats
    job.start()
    try:
        assert main(["rewind", run, "--to", "20", "--yes"]) == 2
        err = capsys.readouterr().err
        assert "another job is training" in err and "the training job" in err and "Stop it first" in err
    finally:
        job.release()
    assert CheckpointStore(Storage(run)).steps_on_storage() == [10, 20, 30, 40]
    assert main(["rewind", run, "--to", "20", "--yes"]) == 0  # released: rewound at once


def test_rewind_takes_a_run_whose_job_is_gone_whatever_the_clocks_say(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job killed with its lease unreleased: its beat stands still, so rewind takes the run after watching
    it for a few beats on this machine's clock, even when the job's host clock was hours ahead (its
    ``since`` in the future) or behind."""
    run = make_run(tmp_path)
    monkeypatch.setenv("CLUSTER_LEASE_BEAT_S", "0.2")
    gone = Lease.take(Storage(run), "a killed job")
    gone.since = time.time() + 3 * 3600  # its clock was three hours ahead: irrelevant
    Storage(run).write_bytes("lease/gen_000001.json", gone._body(released=False))
    assert main(["rewind", run, "--to", "20", "--yes"]) == 0
    assert "watching its beat" in capsys.readouterr().out
    assert CheckpointStore(Storage(run)).steps_on_storage() == [10, 20]
    with pytest.raises(FencedError):
        gone.check()  # the killed job, were it to wake up, can no longer write
