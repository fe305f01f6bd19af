"""What a worker refuses at setup, before its first step (issue 31): a train state no checkpoint could hold
(also at ``--dry-run``), a checkpoint whose tensors or position do not fit this job's model and steps per
epoch (naming the config keys that changed since the run started); and what rollback and rewind keep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from cluster.api.dryrun import DryRunError, dry_run
from cluster.api.rewind import rewind
from cluster.core.errors import ConfigError
from cluster.data.pipeline import ResumableDistributedSampler
from cluster.inspect import read_events
from cluster.rank.rejoin import check_fits, resume, rollback_point
from cluster.rank.session import check_writable
from cluster.rank.train_state import RunPosition, TrainState, capture
from cluster.run.checkpoint import CheckpointStore, serialize
from cluster.run.storage import Storage
from cluster.spec.config import JobConfig
from cluster.spec.load import load_config

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUMPY_LR = r"train_state.pt\['optimizer'\]\['param_groups'\]\[0\]\['lr'\] is a numpy.float64"


def config(tmp_path: Any, *extra: str) -> JobConfig:
    return load_config(
        "jobs/configs/tiny_cpu.yaml", [f"storage={tmp_path}/runs", "task_args.d_model=32", *extra]
    )


# ------------------------------------------------------------------ a state no checkpoint could hold
def test_a_numpy_learning_rate_is_refused_naming_where_it_sits_and_the_fix(tmp_path: Any) -> None:
    cfg = config(tmp_path)
    model = nn.Linear(3, 2)
    bad = torch.optim.SGD(model.parameters(), lr=np.float64(0.1))
    with pytest.raises(
        ConfigError, match=rf"^my\.tasks:Lm's training state cannot be checkpointed: {NUMPY_LR}"
    ):
        check_writable(model, bad, None, RunPosition.start(cfg), 2, 0, "my.tasks:Lm")
    with pytest.raises(ConfigError, match=r"Store plain values instead \(float\(x\)"):
        check_writable(model, bad, None, RunPosition.start(cfg), 2, 0, "my.tasks:Lm")
    good = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    good.step()  # moments exist: tensors, which always load
    check_writable(model, good, None, RunPosition.start(cfg), 2, 0, "my.tasks:Lm")


class ExtraState(nn.Linear):
    def get_extra_state(self) -> Any:
        return {"scale": np.float32(2.0)}

    def set_extra_state(self, state: Any) -> None:
        pass


def test_a_model_state_the_safe_loader_refuses_is_named_in_model_pt(tmp_path: Any) -> None:
    model = ExtraState(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"model.pt\['_extra_state'\]\['scale'\] is a numpy.float32"):
        check_writable(model, opt, None, RunPosition.start(config(tmp_path)), 1, 0, "t:T")


@pytest.mark.multiprocess  # starts a process
def test_the_dry_run_refuses_it_too(tmp_path: Any) -> None:
    cfg = config(tmp_path, "task=tests.support.tasks:NumpyLRTask", "task_args={}")
    with pytest.raises(DryRunError, match=NUMPY_LR):
        dry_run(cfg, "cpu")
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "jobs.train", "--config", f"{REPO}/jobs/configs/tiny_cpu.yaml", "--dry-run"]
    cmd += ["--set", f"storage={tmp_path}/runs", "--set", "task=tests.support.tasks:NumpyLRTask"]
    out = subprocess.run(
        [*cmd, "--set", "task_args={}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dry run failed: tests.support.tasks:NumpyLRTask's")
    assert "['param_groups'][0]['lr'] is a numpy.float64" in lines[0]
    assert not os.path.exists(f"{tmp_path}/runs")


# ------------------------------------------------------------------ a checkpoint that does not fit
def run_with_checkpoint(tmp_path: Any, started: JobConfig) -> CheckpointStore:
    storage = Storage(f"{tmp_path}/runs/lm")
    storage.write_bytes("run.json", json.dumps({"config": started.to_dict()}).encode())
    return CheckpointStore(storage)


def test_a_checkpoint_of_other_shapes_names_the_tensor_and_the_changed_task_args(tmp_path: Any) -> None:
    store = run_with_checkpoint(tmp_path, config(tmp_path, "task_args.d_model=32"))
    weights = {"0.weight": torch.zeros(32, 4), "0.bias": torch.zeros(32)}
    model = nn.Sequential(nn.Linear(4, 48))
    state = TrainState(3, 0, 3, 1, 0, {}, None, 1)
    sampler = ResumableDistributedSampler(320, 32, 0, 1)
    cfg = config(tmp_path, "task_args.d_model=48")
    with pytest.raises(ConfigError) as err:
        check_fits(weights, state, model, sampler, cfg, store, "u/step_3")
    text = str(err.value)
    assert text.startswith(
        "u/step_3/model.pt does not fit this job's model (0.weight is (32, 4) there, (48, 4)"
    )
    assert "1 more tensors do not fit" in text
    assert "task_args.d_model=48 (the run's: 32) changed since the run started" in text
    assert "Keep the run's task_args, or choose a new run name" in text
    # the same task_args: the task's code builds another model now
    with pytest.raises(
        ConfigError, match=r"task_args are the run's, so .*build_model\(\) builds another model"
    ):
        check_fits(weights, state, model, sampler, config(tmp_path, "task_args.d_model=32"), store, "u")
    # a tensor the model lacks, or one the checkpoint lacks
    with pytest.raises(ConfigError, match=r"\(0.bias \(32,\) is missing from the checkpoint\)"):
        check_fits(
            {"0.weight": weights["0.weight"]},
            state,
            nn.Sequential(nn.Linear(4, 32)),
            sampler,
            cfg,
            store,
            "u",
        )
    extra = {**weights, "head.weight": torch.zeros(1)}
    with pytest.raises(ConfigError, match=r"\(head.weight is not in this model\)"):
        check_fits(extra, state, nn.Sequential(nn.Linear(4, 32)), sampler, cfg, store, "u")
    check_fits(weights, state, nn.Sequential(nn.Linear(4, 32)), sampler, cfg, store, "u")  # it fits


def test_a_checkpoint_off_this_job_s_steps_per_epoch_names_the_key_and_the_values(tmp_path: Any) -> None:
    store = run_with_checkpoint(tmp_path, config(tmp_path, "training.max_steps_per_epoch=4"))
    model = nn.Linear(2, 2)
    weights = dict(model.state_dict())
    cfg = config(tmp_path, "training.max_steps_per_epoch=3")
    sampler = ResumableDistributedSampler(320, 32, 0, 1, max_steps_per_epoch=3)  # 10 steps, at most 3
    at_epoch_2 = TrainState(9, 2, 1, 1, 0, {}, None, 1)  # written at 4 steps per epoch
    with pytest.raises(ConfigError) as err:
        check_fits(weights, at_epoch_2, model, sampler, cfg, store, "u/step_9")
    assert str(err.value).startswith(
        "u/step_9 is at step 9 (epoch 2, 1 steps into it, written at 4 steps per epoch), which does not fit "
        "this job's 3 steps per epoch (320 samples // training.global_batch_size=32, at most "
        "training.max_steps_per_epoch=3): training.max_steps_per_epoch=3 (the run's: 4) changed since the run"
    )
    mid_first = TrainState(3, 0, 3, 1, 0, {}, None, 1)  # past the end of this job's first epoch
    with pytest.raises(ConfigError, match=r"epoch 0, 3 steps into it\), which does not fit this job's 3"):
        check_fits(weights, mid_first, model, sampler, cfg, store, "u")
    # the same config: the data changed
    same = config(tmp_path, "training.max_steps_per_epoch=4")
    with pytest.raises(ConfigError, match=r"the dataset's size changed"):
        check_fits(weights, at_epoch_2, model, sampler, same, store, "u")
    check_fits(weights, TrainState(7, 2, 1, 1, 0, {}, None, 1), model, sampler, cfg, store, "u")  # it fits


# ------------------------------------------------------------------ rollback and rewind keep what verified
def commit(store: CheckpointStore, step: int, loss: float | None = None) -> None:
    files = {"model.pt": serialize({"w": torch.full((2,), float(step))}), "train_state.pt": serialize({})}
    meta: dict[str, Any] = {"epoch": 0}
    if loss is not None:
        meta["score"] = {"metric": "loss", "mode": "min", "value": loss}
    store.commit(step, files, meta)


def test_a_rollback_sets_aside_the_best_and_the_milestones_after_its_point(tmp_path: Any) -> None:
    store = CheckpointStore(Storage(f"{tmp_path}/run"))
    for step, loss in ((10, 3.0), (20, 1.0), (30, 2.0), (40, 2.5), (50, 2.6)):
        commit(store, step, loss)
    loaded, back = rollback_point(store, (35, 36), keep_every=40)  # NaN at step 35: back to step 30
    assert loaded is not None and loaded.info.step == 30
    assert back == {
        "window": [35, 36],
        "checkpoint_step": 30,
        "memory_step": None,
        "discarded": [50],
        "set_aside": [40],
    }
    assert store.steps_on_storage() == [10, 20, 30]
    loaded, back = rollback_point(store, (15, 16), keep_every=40)  # the best (20) is set aside
    assert back["set_aside"] == [20] and back["discarded"] == [30]


def test_a_rollback_takes_the_ranks_copy_in_memory_when_no_checkpoint_before_the_window_is_newer(
    tmp_path: Any,
) -> None:
    store, other = CheckpointStore(Storage(f"{tmp_path}/run")), CheckpointStore(Storage(f"{tmp_path}/other"))
    for step in (10, 20, 30, 40):
        commit(store, step)
        commit(other, step)
    r0, o0 = store.storage.reads, other.storage.reads
    loaded, back = rollback_point(store, (35, 36), in_memory=33)  # a copy at 33 beats checkpoint 30
    assert loaded is None and back["memory_step"] == 33 and back["checkpoint_step"] is None
    assert back["discarded"] == [40] and store.steps_on_storage() == [10, 20, 30]
    from_ckpt, _ = rollback_point(other, (35, 36))  # the same run without the copy reads checkpoint 30
    assert from_ckpt is not None and from_ckpt.info.step == 30
    # the checkpoint's files (and its manifest) are read only without the copy
    assert (other.storage.reads - o0) - (store.storage.reads - r0) >= 2
    loaded, back = rollback_point(store, (25, 26), in_memory=15)  # checkpoint 20 is newer than the copy
    assert loaded is not None and loaded.info.step == 20
    assert back["memory_step"] is None and back["checkpoint_step"] == 20 and back["discarded"] == [30]
    loaded, back = rollback_point(store, (12, 12), in_memory=10)  # as new as the checkpoint: no read
    assert loaded is None and back["memory_step"] == 10 and back["discarded"] == [20]


def test_rewind_records_what_it_deleted_and_what_it_set_aside(tmp_path: Any) -> None:
    run = f"{tmp_path}/runs/lm"
    storage = Storage(run)
    cfg = {"task": "my:Task", "checkpoint": {"keep_every_steps": 20}}
    storage.write_bytes("run.json", json.dumps({"config": cfg}).encode())
    store = CheckpointStore(storage)
    for step, loss in ((10, 2.0), (20, 3.0), (30, 1.0), (40, 1.5), (50, 1.6)):
        commit(store, step, loss)
    plan = rewind(run, 10, apply=True)
    assert plan.newer == [20, 30, 40, 50] and plan.set_aside == [20, 30, 40]
    (ev,) = [e for e in read_events(storage) if e["event"] == "rewound"]
    assert ev["deleted"] == [50] and ev["set_aside"] == [20, 30, 40]
    assert store.steps_on_storage() == [10]


# ------------------------------------------------------------------ a fresh start is at step 0
def test_a_fresh_start_after_a_release_is_at_step_0_with_the_skip_windows(tmp_path: Any) -> None:
    """A survivor released after a failure holds its old position; set up again without peers and with no
    checkpoint, it resumes at the run's start, keeping only the skip windows."""
    cfg = config(tmp_path, "training.skip_steps=[7]")
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    survivor = RunPosition.start(cfg)
    survivor.global_step, survivor.epoch, survivor.step_in_epoch = 12, 1, 2
    survivor.skips = [(7, 7), (11, 12)]
    survivor.best.state = {"value": 1.0, "step": 10}
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp_path}/pg", 1), rank=0, world_size=1)
    try:
        store = CheckpointStore(Storage(f"{tmp_path}/runs/lm"))
        sampler = ResumableDistributedSampler(320, 32, 0, 1)
        point, skipped, pos = resume(store, 0, cfg, model, opt, None, survivor, sampler)
    finally:
        dist.destroy_process_group()
    assert (point.global_step, point.epoch, point.step_in_epoch, point.source) == (0, 0, 0, "fresh")
    assert (pos.global_step, pos.epoch, pos.step_in_epoch) == (0, 0, 0)
    assert pos.skips == [(7, 7), (11, 12)] and pos.best.state is None and skipped == []
    assert capture(pos, 1, 0, opt, None).global_step == 0
