"""cluster.load_checkpoint / load_model on a run folder written by the real CheckpointStore (no Ray)."""

from __future__ import annotations

import json
import logging
import pathlib

import pytest
import torch

from cluster import Checkpoint, load_checkpoint, load_model
from cluster.core.errors import CheckpointError, ConfigError
from cluster.run.checkpoint import CheckpointStore, serialize, step_dir
from cluster.run.storage import Storage
from tests.support.tasks import AuditTask

pytestmark = pytest.mark.timeout(60)


def make_run(root: pathlib.Path, steps: list[int]) -> tuple[str, dict[int, dict[str, torch.Tensor]]]:
    """A run with one checkpoint per step: a distinct model state each, as the worker writes them."""
    run = str(root / "runs" / "r1")
    storage = Storage(run)
    args = {"audit_dir": "x", "features": 4}
    config = {"name": "r1", "task": "tests.support.tasks:AuditTask", "task_args": args}
    storage.write_atomic("run.json", json.dumps({"name": "r1", "config": config}).encode())
    store = CheckpointStore(storage)
    states = {}
    for i, step in enumerate(steps):
        torch.manual_seed(i)
        state = AuditTask(features=4).build_model().state_dict()
        train_state = {"global_step": step, "epoch": i, "optimizer": {"state": {}, "param_groups": []}}
        store.commit(
            step,
            {"model.pt": serialize(state), "train_state.pt": serialize(train_state)},
            {"epoch": i, "world_size": 2},
        )
        states[step] = state
    return run, states


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_latest_a_given_step_and_a_checkpoint_url(tmp_path: pathlib.Path) -> None:
    run, states = make_run(tmp_path, [10, 20, 30])
    latest = load_checkpoint(run)
    assert isinstance(latest, Checkpoint)
    assert (latest.step, latest.epoch, latest.skipped) == (30, 2, [])
    assert same(latest.model, states[30]) and latest.train_state["global_step"] == 30
    assert latest.url.endswith(step_dir(30)) and latest.manifest["world_size"] == 2
    assert same(load_checkpoint(run, step=10).model, states[10])
    by_url = load_checkpoint(f"{run}/{step_dir(20)}")
    assert by_url.step == 20 and same(by_url.model, states[20]) and by_url.run_url == run


def test_load_model_builds_the_runs_task(tmp_path: pathlib.Path) -> None:
    run, states = make_run(tmp_path, [10, 20])
    model = load_model(run)
    assert isinstance(model, torch.nn.Sequential) and model[0].in_features == 4  # task_args from run.json
    assert same(model.state_dict(), states[20])
    assert same(load_model(run, step=10).state_dict(), states[10])


def test_corrupt_and_torn_checkpoints_are_skipped_with_the_reason(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    run, states = make_run(tmp_path, [10, 20, 30])
    ckpts = pathlib.Path(run) / "checkpoints"
    model_30 = ckpts / "step_000000030" / "model.pt"
    model_30.write_bytes(model_30.read_bytes()[:-7] + b"garbage")  # same size, wrong checksum
    (ckpts / "step_000000040").mkdir()  # torn: files but never a manifest
    (ckpts / "step_000000040" / "model.pt").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="cluster.api.load"):
        latest = load_checkpoint(run)
    assert latest.step == 20 and same(latest.model, states[20])
    reasons = dict(latest.skipped)
    assert set(reasons) == {30, 40}
    assert "fails its checksum" in reasons[30] and "never committed" in reasons[40]
    assert "step 30" in caplog.text and "step 40" in caplog.text
    with pytest.raises(CheckpointError, match="fails its checksum"):
        load_checkpoint(run, step=30)  # an explicit step is never silently replaced
    with pytest.raises(CheckpointError, match=r"no checkpoint at step 40.*committed steps: \[10, 20, 30\]"):
        load_checkpoint(run, step=40)


def test_clear_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(CheckpointError, match="is not a run"):
        load_checkpoint(str(tmp_path / "nothing-here"))
    run, _ = make_run(tmp_path, [])
    with pytest.raises(CheckpointError, match="has no verified checkpoint"):
        load_checkpoint(run)
    with pytest.raises(ConfigError, match="'s3:' must be followed by '//'"):
        load_checkpoint("s3:/bucket/runs/r1")


# ------------------------------------------------------------------ training.init_from
def test_init_from_is_checked_before_anything_starts(tmp_path: pathlib.Path) -> None:
    from cluster.run.restore import check_init_from

    run, _ = make_run(tmp_path, [10, 20, 30])
    assert check_init_from(run, None, None) == 30  # the latest
    assert check_init_from(run, 20, None) == 20
    assert check_init_from(f"{run}/checkpoints/step_000000010", None, None) == 10  # a checkpoint folder
    with pytest.raises(ConfigError, match=r"no committed checkpoint at step 25; its steps: \[10, 20, 30\]"):
        check_init_from(run, 25, None)
    with pytest.raises(ConfigError, match="none of its 3 checkpoints carries an evaluation score"):
        check_init_from(run, "best", None)
    with pytest.raises(ConfigError, match=r"names one checkpoint folder, and training\.init_from_step=20"):
        check_init_from(f"{run}/checkpoints/step_000000010", 20, None)
    with pytest.raises(ConfigError, match=r"training.init_from='.*nowhere'.*is not a run"):
        check_init_from(str(tmp_path / "nowhere"), None, None)


def test_init_weights_load_all_or_name_what_does_not_fit() -> None:
    from cluster.run.restore import init_weights

    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    same = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    report = init_weights(same, src.state_dict(), strict=True, source="s")
    assert report == {"loaded": 4, "kept_init": []}
    assert all(torch.equal(a, b) for a, b in zip(same.state_dict().values(), src.state_dict().values()))

    new_head = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5))  # 5 classes
    before = {k: v.clone() for k, v in new_head.state_dict().items()}
    with pytest.raises(ConfigError, match=r"other shapes: 2.weight \(2, 8\) -> \(5, 8\).*init_strict=false"):
        init_weights(new_head, src.state_dict(), strict=True, source="s")
    assert all(torch.equal(v, before[k]) for k, v in new_head.state_dict().items())  # untouched
    report = init_weights(new_head, src.state_dict(), strict=False, source="s")
    assert report == {"loaded": 2, "kept_init": ["2.weight", "2.bias"]}
    assert torch.equal(new_head[0].weight, src[0].weight) and torch.equal(
        new_head[2].weight, before["2.weight"]
    )

    other = torch.nn.Linear(3, 3)
    with pytest.raises(ConfigError, match="Nothing matches"):
        init_weights(other, src.state_dict(), strict=False, source="s")
