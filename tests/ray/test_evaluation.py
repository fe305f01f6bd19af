"""Evaluation in real jobs on a real local Ray: what it records, that it leaves training bitwise unchanged,
and that an evaluation a SIGKILLed rank cut short runs again, once, with the same result."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from cluster import evaluate_checkpoint, load_checkpoint, load_config, load_model, train
from cluster.core.errors import ConfigError, TrainingFailedError
from cluster.inspect import format_show, report
from cluster.rank.evaluate import evaluate
from cluster.run.checkpoint import CheckpointStore
from cluster.run.logs import read_metrics
from cluster.run.storage import Storage
from cluster.spec.config import JobConfig
from cluster.spec.task import build_task
from tests.support.faults import EPOCHS, NO_SPARE, STEPS, assert_bitwise_equal, events, final_model, overrides

pytestmark = pytest.mark.timeout(180)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EVAL = ["task_args.eval_chars=4096", "evaluation.every_steps=10"]  # at 10, 15 (epoch end), 20 and 30
EVAL_STEPS = [10, 15, 20, 30]


def config(storage: str, name: str, *extra: str) -> JobConfig:
    """The fault tests' job; without a hot spare where no rank dies (``NO_SPARE``)."""
    spare = [] if any(e.startswith("failures.inject=") for e in extra) else [NO_SPARE]
    return load_config("jobs/configs/tiny_cpu.yaml", overrides(storage, name, *spare, *extra))


@pytest.fixture(scope="module")
def plain(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final weights of the same job without an eval set."""
    root = tmp_path_factory.mktemp("plain")
    result = train(config(str(root), "plain"), out=io.StringIO())
    assert result.status == "finished" and result.attempts == 1
    return final_model(result.run_url)


@pytest.fixture(scope="module")
def evaluated(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str, JobConfig]:
    root = tmp_path_factory.mktemp("evaluated")
    cfg = config(str(root), "evaluated", *EVAL)
    out = io.StringIO()
    result = train(cfg, out=out)
    assert result.status == "finished" and result.attempts == 1
    return result, out.getvalue(), cfg


def evaluation_events(run_url: str) -> list[tuple[int, float, dict[str, float]]]:
    return [(e["global_step"], e["loss"], e["metrics"]) for e in events(run_url, "evaluation")]


def test_evaluations_record_the_saved_model_s_loss_and_leave_training_unchanged(
    plain: dict[str, torch.Tensor], evaluated: tuple[Any, str, JobConfig]
) -> None:
    result, console, _ = evaluated
    # dropout is on in training (task_args.dropout=0.1): the eval's own random draws and its eval mode
    # changed nothing in the steps after it
    assert_bitwise_equal(final_model(result.run_url), plain)

    recorded = evaluation_events(result.run_url)
    assert [step for step, _, _ in recorded] == EVAL_STEPS
    assert all(set(metrics) == {"acc", "bits_per_char"} for _, _, metrics in recorded)
    assert recorded[-1][1] < recorded[0][1]  # it learns
    rows = [r for r in read_metrics(Storage(result.run_url)).to_pylist() if r["kind"] == "eval"]
    assert [(r["global_step"], r["loss"], r["eval_samples"]) for r in rows] == [
        (step, loss, 127)
        for step, loss, _ in recorded  # 4096 chars: 127 sequences of 32 (+1)
    ]
    assert result.evaluation["global_step"] == EPOCHS * STEPS and result.evaluation["loss"] == recorded[-1][1]
    assert f"eval at step {EPOCHS * STEPS} (epoch {EPOCHS}): loss {recorded[-1][1]:.4f}" in console

    # the last evaluation is the final checkpoint's loss on the held-out text, computed here in one process
    torch.set_num_threads(1)  # as each worker (scaling.cpus_per_worker=1)
    here = evaluate_checkpoint(result.run_url)
    assert (here.step, here.loss, here.metrics) == (EPOCHS * STEPS, recorded[-1][1], recorded[-1][2])
    # and from the command line (one thread too)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "cluster", "eval", result.run_url]
    cli = subprocess.run([*run, "--json"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["loss"] == recorded[-1][1]
    bad = subprocess.run(
        [*run, "--task-arg", "eval_chars=0"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "build_eval_dataset() returned no data" in bad.stderr, bad.stderr

    text = format_show(report(Storage(result.run_url)))
    assert "evaluations (4)" in text and "BITS_PER_CHAR" in text


def test_eval_loader_processes_record_the_same_evaluations_and_weights(
    plain: dict[str, torch.Tensor], evaluated: tuple[Any, str, JobConfig], tmp_path: object
) -> None:
    """``evaluation.loader_workers=1``: each rank reads its eval batches in a loader process of its own
    (started at the first evaluation, kept for the next), with the same results as reading in turn."""
    cfg = config(f"{tmp_path}/runs", "eval-loaders", *EVAL, "evaluation.loader_workers=1")
    result = train(cfg, out=io.StringIO())
    assert result.status == "finished"
    assert evaluation_events(result.run_url) == evaluation_events(evaluated[0].run_url)
    assert_bitwise_equal(final_model(result.run_url), plain)


def test_an_evaluation_cut_short_by_a_killed_rank_runs_again_once_with_the_same_result(
    plain: dict[str, torch.Tensor], evaluated: tuple[Any, str, JobConfig], tmp_path: object
) -> None:
    storage = f"{tmp_path}/runs"
    crash = "failures.inject=[{rank: 1, step: 10, kind: crash_in_eval}]"
    # scored too: the survivors' best so far travels with their state, and they must agree on it
    result = train(config(storage, "cut", *EVAL, crash, "checkpoint.best_metric=loss"), out=io.StringIO())
    assert result.status == "finished" and result.attempts == 2, result.failures
    assert result.failures[0]["kind"] == "worker_died"
    (recovered,) = events(result.run_url, "recovered")
    assert recovered["source"] == "peers" and recovered["resume_step"] == 10  # the survivors' step
    # every evaluation once, bitwise what the run without the failure recorded
    assert evaluation_events(result.run_url) == evaluation_events(evaluated[0].run_url)
    assert_bitwise_equal(final_model(result.run_url), plain)
    best = min(evaluation_events(result.run_url), key=lambda e: e[1])
    assert load_checkpoint(result.run_url, step="best").step == best[0]


def test_the_best_evaluation_s_checkpoint_outlives_keep_last_and_loads_as_best(
    evaluated: tuple[Any, str, JobConfig], tmp_path: object
) -> None:
    """Scored by the lowest accuracy (so the best is an early one, not the last): with keep_last=1 and no
    step checkpoints, the best evaluation's step is checkpointed and kept, and loads as ``step="best"``.
    Resubmitted for one more epoch, the resumed run knows its best and checkpoints no worse evaluation."""
    storage = f"{tmp_path}/runs"
    best = ["checkpoint.best_metric=acc", "checkpoint.best_mode=min", "checkpoint.keep_last=1"]
    cfg = config(storage, "best", *EVAL, *best, "checkpoint.every_steps=0")
    result = train(cfg, out=io.StringIO())
    assert result.status == "finished"
    recorded = evaluation_events(result.run_url)
    assert recorded == evaluation_events(evaluated[0].run_url)  # scoring changes no evaluation
    step, _, metrics = min(recorded, key=lambda e: (e[2]["acc"], e[0]))
    assert step < EPOCHS * STEPS
    kept = [c.step for c in CheckpointStore(Storage(result.run_url)).list()]
    assert kept == [step, EPOCHS * STEPS]  # the best, and keep_last's newest

    ckpt = load_checkpoint(result.run_url, step="best")
    assert ckpt.step == step and ckpt.manifest["score"] == {
        "metric": "acc",
        "mode": "min",
        "value": metrics["acc"],
    }
    torch.set_num_threads(1)
    task = build_task(cfg.task, cfg.task_args)
    here = evaluate(
        task,
        load_model(result.run_url, step="best"),
        task.build_eval_dataset(),
        cfg,
        step,
        0,
        1,
        torch.device("cpu"),
    )
    assert here.metrics == metrics
    assert "(best)" in format_show(report(Storage(result.run_url)))

    more = train(
        config(storage, "best", *EVAL, *best, "checkpoint.every_steps=0", "training.epochs=3"),
        out=io.StringIO(),
    )
    assert more.status == "finished" and more.global_step == 3 * STEPS
    later = [e for e in evaluation_events(result.run_url) if e[0] > EPOCHS * STEPS]
    assert later and all(e[2]["acc"] > metrics["acc"] for e in later)  # none better: none checkpointed
    assert [c.step for c in CheckpointStore(Storage(result.run_url)).list()] == [step, 3 * STEPS]


def test_a_best_metric_the_evaluation_lacks_fails_once_with_the_names_it_has(
    ray_local: None, tmp_path: object
) -> None:
    cfg = config(f"{tmp_path}/runs", "nope", *EVAL, "checkpoint.best_metric=accuracy")
    with pytest.raises(TrainingFailedError) as err:
        train(cfg, out=io.StringIO())
    text = str(err.value)
    assert (
        "checkpoint.best_metric='accuracy' is not among the evaluation's metrics (acc, bits_per_char, loss)"
        in text
    )
    assert "Retrying cannot help" in text
    assert len(events(f"{tmp_path}/runs/nope", "group_started")) == 1  # not retried


def test_a_best_metric_without_an_eval_set_is_a_config_error_before_training(
    ray_local: None, tmp_path: object
) -> None:
    cfg = config(f"{tmp_path}/runs", "noeval", "checkpoint.best_metric=loss")
    with pytest.raises(
        ConfigError, match=r"checkpoint.best_metric='loss' needs an eval set, but .*returned None"
    ):
        train(cfg, out=io.StringIO())


def test_early_stopping_ends_the_run_keeps_the_best_and_a_resubmission_without_it_trains_on_exactly(
    plain: dict[str, torch.Tensor], tmp_path: object
) -> None:
    """Scored by the lowest accuracy, which only rises: the first evaluation (step 10) stays the best, and
    with evaluation.patience=2 the run ends at the second one after it (step 20, mid-epoch 2), checkpointed
    there. The same job again has nothing to train; without patience it trains on from step 20, and its
    final weights are bitwise those of the run that never stopped."""
    storage = f"{tmp_path}/runs"
    early = [
        *EVAL,
        "checkpoint.best_metric=acc",
        "checkpoint.best_mode=min",
        "checkpoint.every_steps=0",
        "checkpoint.keep_last=1",
    ]
    out = io.StringIO()
    result = train(config(storage, "early", *early, "evaluation.patience=2"), out=out)
    assert result.status == "finished" and result.stopped_early and result.global_step == 20
    assert [e[0] for e in evaluation_events(result.run_url)] == [10, 15, 20]
    (stop,) = events(result.run_url, "early_stopped")
    assert (stop["global_step"], stop["best_step"], stop["evaluations_since_best"], stop["patience"]) == (
        20,
        10,
        2,
        2,
    )
    assert "stopping early at step 20: acc has not improved for 2 evaluations" in out.getvalue()
    infos = CheckpointStore(Storage(result.run_url)).list()
    assert [i.step for i in infos] == [10, 20]  # the best (step 10) and the run's end
    assert infos[-1].manifest["early_stopped"]["step"] == 10
    assert load_checkpoint(result.run_url, step="best").step == 10
    assert "early_stopped:" in format_show(report(Storage(result.run_url)))

    again = train(config(storage, "early", *early, "evaluation.patience=2"), out=io.StringIO())
    assert again.stopped_early and again.global_step == 20 and again.attempts == 1
    assert events(result.run_url, "already_complete")[-1]["early_stopped"] is True

    on = train(config(storage, "early", *early), out=io.StringIO())
    assert not on.stopped_early and on.global_step == EPOCHS * STEPS
    assert [e[0] for e in evaluation_events(result.run_url)] == [10, 15, 20, 30]  # 20 not evaluated twice
    assert_bitwise_equal(final_model(result.run_url), plain)


def test_a_baseline_evaluation_before_the_first_step_is_checkpointed_and_changes_no_weight(
    plain: dict[str, torch.Tensor], tmp_path: object
) -> None:
    storage = f"{tmp_path}/runs"
    extra = ["evaluation.at_start=true", "checkpoint.best_metric=loss", "checkpoint.keep_last=10"]
    result = train(config(storage, "baseline", *EVAL, *extra), out=io.StringIO())
    assert result.status == "finished"
    recorded = evaluation_events(result.run_url)
    assert [e[0] for e in recorded] == [0, *EVAL_STEPS]
    assert recorded[0][1] > recorded[1][1]  # the untrained model is worse
    # the baseline was the first best: checkpointed at step 0, where it evaluates the same again
    assert 0 in [i.step for i in CheckpointStore(Storage(result.run_url)).list()]
    torch.set_num_threads(1)
    assert evaluate_checkpoint(result.run_url, step=0).loss == recorded[0][1]
    assert_bitwise_equal(final_model(result.run_url), plain)
