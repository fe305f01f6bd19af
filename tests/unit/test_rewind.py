"""`python -m cluster rewind`: a run no job trains goes back to a verified checkpoint; the newer ones are
deleted only with --yes, and the event log says who did it."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from cluster.__main__ import main
from cluster.checkpoint import CheckpointStore, serialize
from cluster.control import DriverBeat
from cluster.inspect import format_show, read_events, report
from cluster.storage import Storage

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
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path)
    assert main(["rewind", run, "--to", "25", "--yes"]) == 2
    assert "cannot rewind to step 25: no checkpoint at step 25" in capsys.readouterr().err
    beat = DriverBeat(Storage(run), lambda: {"state": "running", "global_step": 41}, every_s=60)
    beat.start()
    try:
        assert main(["rewind", run, "--to", "20", "--yes"]) == 2
        assert "a job is training" in capsys.readouterr().err
    finally:
        beat.stop()
    assert CheckpointStore(Storage(run)).steps_on_storage() == [10, 20, 30, 40]
