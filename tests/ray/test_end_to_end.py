"""The tiny job end to end on a real local Ray: trains, checkpoints, resumes, says when it is done."""

from __future__ import annotations

import io
import time

import pytest
import torch

from cluster import load_checkpoint, load_config, load_model, train
from cluster.inspect import read_events
from cluster.run.checkpoint import CheckpointStore
from cluster.run.storage import Storage
from jobs.tasks.charlm import CharLMTask
from tests.support.goodput import account

pytestmark = pytest.mark.timeout(300)


def events(run_url: str) -> list[dict]:
    return read_events(Storage(run_url))


def test_tiny_job_trains_checkpoints_and_resumes(ray_local: None, tiny_overrides: list[str]) -> None:
    overrides = [*tiny_overrides, "name=e2e", "training.epochs=2", "checkpoint.every_steps=10"]
    overrides.append("failures.hot_spare=auto")  # the default, which tiny_overrides turns off
    out = io.StringIO()
    t0 = time.monotonic()
    first = train(load_config("jobs/configs/tiny_cpu.yaml", overrides), out=out)
    harness_s = time.monotonic() - t0
    assert first.status == "finished"
    # the goodput account of a run without faults: starting, training, stalls; nothing lost or recovered
    g = account(first.run_url, harness_s)
    assert first.goodput is not None and first.goodput.to_dict()["seconds"] == g.to_dict()["seconds"]
    assert g.steps == {"productive": first.global_step - 1, "recomputed": 0}  # the 1st: the start's
    assert [k for k in ("recomputed", "detection", "recovery", "moves", "driver_down") if g.seconds[k]] == []
    assert g.seconds["starting"] > 0 and g.seconds["productive"] > 0 and g.seconds["checkpoint_stall"] > 0
    steps_per_epoch = first.global_step // 2
    assert first.global_step == 2 * steps_per_epoch > 0
    text = out.getvalue()
    assert "epoch 1/2" in text and "epoch 2/2" in text and "samples/s" in text and "ETA" in text

    # loss fell, as recorded in the run's own metrics
    ev = events(first.run_url)
    losses = [e["loss"] for e in ev if e["event"] == "epoch_end"]
    assert len(losses) == 2 and losses[1] < losses[0]

    # a verified checkpoint at the last step, loadable for inference with weights_only=True
    store = CheckpointStore(Storage(first.run_url))
    latest = store.load_latest()
    assert latest is not None and latest.info.step == first.global_step
    assert latest.info.manifest["world_size"] == 2
    assert first.latest_checkpoint == latest.info.url
    task = CharLMTask(**load_config("jobs/configs/tiny_cpu.yaml", overrides).task_args)
    model = task.build_model()
    state = torch.load(f"{latest.info.url}/model.pt", weights_only=True)
    model.load_state_dict(state)
    assert torch.equal(model.state_dict()["head.weight"], latest.files["model.pt"]["head.weight"])
    # ... and in one call: the run's own task builds the model, the latest verified weights are loaded
    loaded = load_model(first.run_url)
    assert type(loaded) is type(model)
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())
    assert load_checkpoint(first.run_url).train_state["global_step"] == first.global_step

    # same name and storage, more epochs: resumes and trains only the new epoch
    second = train(
        load_config("jobs/configs/tiny_cpu.yaml", [*overrides, "training.epochs=3"]), out=io.StringIO()
    )
    assert second.global_step == 3 * steps_per_epoch
    g2 = account(first.run_url)  # continued: the gap between the two submissions is the driver's
    assert g2.wall_s > g.wall_s + 1 and g2.seconds["driver_down"] > 0
    assert g2.steps == {"productive": second.global_step - 2, "recomputed": 0}
    assert sorted(g2.attempts) == ["1.0", "2.0"]
    ev = events(first.run_url)
    started = [e for e in ev if e["event"] == "group_started"]
    assert started[-1]["resume_step"] == first.global_step
    # failures.hot_spare=auto: this Ray has 4 CPUs and the job uses 2, so a spare is kept
    assert all(e["hot_spare"] == "preparing" for e in started)
    assert all(
        e["allocator"] == ["tuned"] for e in started
    )  # scaling.tune_allocator took effect in every rank
    assert all(e["niceness"] == ["0"] for e in started)  # not Ray's 15, and no privilege needed for it
    assert [e["epoch"] for e in ev if e["event"] == "epoch_end"] == [0, 1, 2]

    # everything done: says so, trains nothing
    out = io.StringIO()
    third = train(load_config("jobs/configs/tiny_cpu.yaml", [*overrides, "training.epochs=3"]), out=out)
    assert third.status == "finished" and third.global_step == second.global_step
    assert "already done" in out.getvalue()

    # metrics readable with one pyarrow call
    import pyarrow.parquet as pq

    table = pq.read_table(f"{first.run_url}/metrics")
    kinds = table.column("kind").to_pylist()
    assert kinds.count("epoch") == 3 and kinds.count("step") >= 3 * steps_per_epoch


def test_auto_hot_spare_stays_off_when_it_would_take_cpu_from_training(
    ray_local: None, tiny_overrides: list[str]
) -> None:
    # 2 workers x 2 CPUs fill this 4-CPU Ray: preparing a spare would slow the workers down
    overrides = [
        *tiny_overrides,
        "name=nospare",
        "training.epochs=1",
        "training.max_steps_per_epoch=2",
        "scaling.cpus_per_worker=2",
        "failures.hot_spare=auto",  # the default, which tiny_overrides turns off
    ]
    result = train(load_config("jobs/configs/tiny_cpu.yaml", overrides), out=io.StringIO())
    assert result.status == "finished"
    (started,) = [e for e in events(result.run_url) if e["event"] == "group_started"]
    assert started["hot_spare"].startswith("off: no node of the job has a free CPU share")


def test_changed_task_or_batch_on_resume_is_refused(ray_local: None, tiny_overrides: list[str]) -> None:
    from cluster.core.errors import ConfigError

    overrides = [*tiny_overrides, "name=compat", "training.epochs=1", "training.max_steps_per_epoch=2"]
    train(load_config("jobs/configs/tiny_cpu.yaml", overrides), out=io.StringIO())
    run = Storage(f"{tiny_overrides[0].split('=', 1)[1]}/compat")
    before = read_events(run)
    with pytest.raises(ConfigError, match=r"training\.global_batch_size=64 differs"):
        train(load_config("jobs/configs/tiny_cpu.yaml", [*overrides, "training.global_batch_size=64"]))
    # nothing already written was changed by the refused start
    assert read_events(run) == before
