"""``python -m jobs.train --dry-run``: the task tried in this process, its mistakes reported as the one
call that failed, before Ray or storage is touched."""

from __future__ import annotations

import os
from typing import Any

import pytest

from cluster import dry_run, load_config
from cluster.api.dryrun import DryRunError
from cluster.run.checkpoint import serialize
from cluster.spec.task import build_task
from jobs.train import main

pytestmark = pytest.mark.timeout(120)


def cfg(tmp_path: Any, mode: str, *extra: str) -> Any:
    return load_config(
        data={"task": "tests.support.tasks:Broken", "storage": {"url": f"{tmp_path}/runs"}},
        overrides=[f"task_args.mode={mode}", "training.global_batch_size=8", "training.epochs=3", *extra],
    )


def test_a_good_task_reports_what_the_run_will_be(tmp_path: Any) -> None:
    r = dry_run(cfg(tmp_path, "ok", "workers=2", "training.grad_accum_steps=2", "checkpoint.best_metric=acc"))
    assert (r.train_samples, r.steps_per_epoch, r.total_steps) == (64, 8, 24)
    assert (r.per_rank_batch, r.micro_batch, r.device) == (4, 2, "cpu")
    model = build_task("tests.support.tasks:Broken", {"mode": "ok"}).build_model()
    assert r.parameters == r.trainable == sum(p.numel() for p in model.parameters())
    assert r.loss > 0 and r.grad_norm > 0 and set(r.metrics) == {"acc"} and r.step_s > 0
    # weights plus Adam's two moments and its step counts: more than the weights alone
    assert r.checkpoint_bytes > 2 * len(serialize(model.state_dict()))
    assert (r.eval_samples, r.eval_batches) == (20, 10)  # eval batches of one micro-batch, 2 samples
    assert r.eval_loss is not None and set(r.eval_metrics) == {"acc"}
    assert r.no_grad == [] and r.peak_memory_gib > 0


@pytest.mark.parametrize(
    ("mode", "extra", "message"),
    [
        (
            "raise",
            [],
            r"tests.support.tasks:Broken.compute_loss\(model, batch\) raised ValueError: "
            r"labels out of range: 1 \(at .*tests/support/tasks.py:\d+, in compute_loss\)",
        ),
        ("detached", [], "returned a loss that does not require grad"),
        ("wrong_shape", [], r"returned a loss of \(4,\); return its mean, a scalar tensor"),
        ("unpicklable", ["training.loader_workers=1"], "Unpicklable cannot be pickled .*holds an open file"),
        (
            "eval_metrics",
            ["checkpoint.best_metric=acc"],
            r"best_metric='acc' is not an evaluation metric.*f1",
        ),
    ],
)
def test_a_broken_task_is_one_error_naming_the_call(
    tmp_path: Any, mode: str, extra: list[str], message: str
) -> None:
    with pytest.raises(DryRunError, match=message):
        dry_run(cfg(tmp_path, mode, *extra))


def test_unused_parameters_are_named_and_fixed_buckets_false_is_warned_of(tmp_path: Any) -> None:
    r = dry_run(cfg(tmp_path, "unused"))
    assert r.no_grad == ["head2.weight", "head2.bias"] and not r.notes
    r = dry_run(cfg(tmp_path, "unused", "training.fixed_buckets=false"))
    assert "Expected to have finished reduction" in r.notes[0]


def test_the_cli_prints_the_report_and_writes_nothing(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    args = ["--config", "jobs/configs/tiny_cpu.yaml", "--set", f"storage={tmp_path}/runs", "--dry-run"]
    args += ["--set", "task_args.max_chars=20000", "--set", "task_args.n_layers=1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "dry run of jobs.tasks.charlm:CharLMTask on cpu: the task builds, trains and evaluates" in out
    assert "steps per epoch x 3 epochs" in out and "checkpoint" in out
    assert not os.path.exists(f"{tmp_path}/runs")  # nothing written, no Ray started
    bad = ["--config", "jobs/configs/tiny_cpu.yaml", "--set", f"storage={tmp_path}/runs", "--dry-run"]
    bad += ["--set", "task=tests.support.tasks:Broken", "--set", "task_args={mode: raise}"]
    assert main(bad) == 2
    assert "dry run failed: tests.support.tasks:Broken.compute_loss(model, batch) raised ValueError" in (
        capsys.readouterr().err
    )


def test_a_task_class_is_tried_as_train_takes_it(tmp_path: Any) -> None:
    from tests.support.tasks import Broken

    c = load_config(data={"task": "nowhere:Missing", "storage": {"url": f"{tmp_path}/runs"}})
    r = dry_run(c, task_cls=Broken)  # the class, not the config's path, is built
    assert r.steps_per_epoch == 1 and r.loss > 0
