"""Real jobs on a local Ray that a worker refuses at setup, once, with no retry (issue 31): a task whose
train state no checkpoint could load back (``python -m jobs.train`` exits 2, nothing but the run's files and
its lease written), and a resubmission whose ``task_args`` change the model's shapes or whose
``training.max_steps_per_epoch`` changes the run's steps per epoch."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from typing import Any

import pytest

from cluster import train
from cluster.core.errors import ConfigError
from cluster.inspect import read_events
from cluster.run.checkpoint import CheckpointStore
from cluster.run.storage import Storage
from cluster.spec.load import load_config

pytestmark = pytest.mark.timeout(600)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_task_whose_state_cannot_be_checkpointed_exits_2_at_once_writing_no_checkpoint(
    tmp_path: Any,
) -> None:
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "jobs.train", "--config", "jobs/configs/tiny_cpu.yaml"]
    for s in (
        f"storage={tmp_path}/runs",
        "name=numpy-lr",
        "task=tests.support.tasks:NumpyLRTask",
        "task_args={}",
        "training.epochs=1",
    ):
        cmd += ["--set", s]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert "tests.support.tasks:NumpyLRTask's training state cannot be checkpointed: " in errors[0]
    assert "train_state.pt['optimizer']['param_groups'][0]['lr'] is a numpy.float64" in errors[0]
    assert "Store plain values instead (float(x)" in errors[0]
    run = Storage(f"{tmp_path}/runs/numpy-lr")
    assert not run.exists("checkpoints") and CheckpointStore(run).steps_on_storage() == []
    run_files = {"run.json", "driver.json", "submissions", "events", "lease", ".storage-probe.json"}
    assert set(os.listdir(run.root)) <= run_files, os.listdir(run.root)
    kinds = [e["event"] for e in read_events(run)]
    assert "group_started" not in kinds and "failure" not in kinds, kinds


def test_a_resubmission_that_changes_the_model_or_the_steps_per_epoch_is_one_error(
    ray_local: None, tiny_overrides: list[str]
) -> None:
    base = [*tiny_overrides, "name=changed", "training.max_steps_per_epoch=2"]

    def job(*extra: str) -> Any:
        return train(load_config("jobs/configs/tiny_cpu.yaml", [*base, *extra]), out=io.StringIO())

    assert job("training.epochs=1").status == "finished"  # a checkpoint at step 2, epoch 1
    run = Storage(f"{tiny_overrides[0].split('=', 1)[1]}/changed")
    before = [e for e in read_events(run) if e["event"] == "group_started"]

    with pytest.raises(ConfigError) as err:
        job("training.epochs=2", "task_args.d_model=48")
    text = str(err.value)
    assert type(err.value) is ConfigError and "ray::" not in text
    assert (
        "/model.pt does not fit this job's model (tok.weight is (256, 32) there, (256, 48) in this " in text
    )
    assert "task_args.d_model=48 (the run's: 32) changed since the run started" in text

    with pytest.raises(ConfigError) as err:
        job("training.epochs=2", "training.max_steps_per_epoch=3")
    text = str(err.value)
    assert (
        "is at step 2 (epoch 1, 0 steps into it, written at 2 steps per epoch), which does not fit this "
        in text
    )
    assert "job's 3 steps per epoch (" in text and "at most training.max_steps_per_epoch=3" in text
    assert "training.max_steps_per_epoch=3 (the run's: 2) changed since the run started" in text

    # neither refused start was retried, and the run goes on as it was
    assert [e for e in read_events(run) if e["event"] == "group_started"] == before
    assert job("training.epochs=2").status == "finished"
