"""Evaluation in one process: when it is due, how the eval set is cut, what it records and shows."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from cluster import Task, TensorBatchDataset, load_config
from cluster.core.errors import ConfigError
from cluster.driver.tracking import scalars
from cluster.inspect import eval_rows, format_evaluations
from cluster.rank.evaluate import _combine, eval_batch_size, evaluate
from cluster.rank.worker import _checked_eval_set
from cluster.spec.config import EvaluationConfig
from cluster.spec.schedule import eval_due

pytestmark = pytest.mark.timeout(30)


class Mean(Task):
    """The model outputs a constant; the loss of a batch is the mean of its targets: easy to check."""

    def build_model(self) -> nn.Module:
        return nn.Linear(1, 1)

    def build_eval_dataset(self) -> TensorBatchDataset:
        return TensorBatchDataset(torch.arange(10, dtype=torch.float64))

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        (y,) = batch
        self.seen = [*getattr(self, "seen", []), (len(y), model.training, torch.is_grad_enabled())]
        return y.mean(), {"max": y.max(), "one": 1.0}


@pytest.mark.parametrize(
    ("step", "every_epochs", "every_steps", "due"),
    [
        (0, 1, 0, False),  # nothing trained yet
        (4, 1, 0, True),  # end of epoch 1 (4 steps per epoch)
        (3, 1, 0, False),
        (8, 2, 0, True),  # every 2nd epoch
        (4, 2, 0, False),
        (12, 0, 0, True),  # the last epoch (3) always evaluates
        (12, 5, 0, True),
        (4, 0, 0, False),
        (6, 0, 3, True),  # every 3 steps
        (7, 0, 3, False),
        (2, 1, 2, True),
    ],
)
def test_when_an_evaluation_is_due(step: int, every_epochs: int, every_steps: int, due: bool) -> None:
    e = EvaluationConfig(every_epochs=every_epochs, every_steps=every_steps)
    assert eval_due(step, steps_per_epoch=4, epochs=3, e=e) is due


def test_a_baseline_before_the_first_step_only_when_asked() -> None:
    assert not eval_due(0, 4, 3, EvaluationConfig())
    assert eval_due(0, 4, 3, EvaluationConfig(at_start=True))
    assert not eval_due(1, 4, 3, EvaluationConfig(at_start=True))


def test_the_default_batch_is_the_training_micro_batch_at_the_configured_size() -> None:
    cfg = load_config(None, ["training.global_batch_size=64", "scaling.num_workers=4"])
    assert eval_batch_size(cfg) == 16
    cfg = load_config(None, ["training.global_batch_size=64", "training.grad_accum_steps=2"])
    assert eval_batch_size(cfg) == 16  # 2 workers x 2 micro-batches
    assert eval_batch_size(load_config(None, ["evaluation.batch_size=5"])) == 5


def test_every_sample_once_weighted_by_batch_size_in_eval_mode_without_grad() -> None:
    task = Mean()
    model = task.build_model()
    cfg = load_config(None, ["evaluation.batch_size=4"])  # batches of 4, 4 and 2 samples
    res = evaluate(task, model, task.build_eval_dataset(), cfg, 3, 0, 1, torch.device("cpu"))
    assert res.loss == 4.5  # the mean of 0..9, not the mean of the batches' means (1.5, 5.5, 8.5)
    assert res.metrics == {"max": (3 * 4 + 7 * 4 + 9 * 2) / 10, "one": 1.0}
    assert (res.samples, res.batches) == (10, 3)
    assert task.seen == [(4, False, False), (4, False, False), (2, False, False)]
    assert model.training  # put back

    capped = evaluate(
        task,
        model,
        task.build_eval_dataset(),
        load_config(None, ["evaluation.batch_size=4", "evaluation.max_batches=2"]),
        3,
        0,
        1,
        torch.device("cpu"),
    )
    assert (capped.samples, capped.loss) == (8, 3.5)


def test_a_metric_missing_from_one_batch_is_a_clear_error() -> None:
    class Flaky(Mean):
        def compute_eval(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            (y,) = batch
            return y.mean(), ({"a": 1.0} if y[0] == 0 else {})

    with pytest.raises(ConfigError, match=r"compute_eval returned metrics \[\] for eval batch 1 but \['a'\]"):
        evaluate(
            Flaky(),
            nn.Linear(1, 1),
            Mean().build_eval_dataset(),
            load_config(None, ["evaluation.batch_size=5"]),
            0,
            0,
            1,
            torch.device("cpu"),
        )


def test_the_ranks_shares_combine_in_batch_order_whatever_the_order_they_arrive() -> None:
    a = {"names": ["m"], "batches": [(0, 3, [0.1, 1.0]), (2, 1, [0.7, 3.0])]}
    b = {"names": ["m"], "batches": [(1, 3, [0.3, 2.0])]}
    idle = {"names": None, "batches": []}  # a rank with no batch (fewer batches than ranks)
    one, two = _combine([a, b, idle], 3, 0.0), _combine([idle, b, a], 3, 0.0)
    assert (one.loss, one.metrics) == (two.loss, two.metrics)
    assert one.loss == pytest.approx((0.3 + 0.9 + 0.7) / 7) and one.metrics["m"] == pytest.approx(12 / 7)
    with pytest.raises(ConfigError, match="different metric names"):
        _combine([a, {"names": ["x"], "batches": [(1, 3, [0.3, 2.0])]}], 3, 0.0)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("evaluation.every_epochs=-1", "evaluation.every_epochs=-1 must be 0"),
        ("evaluation.every_steps=-2", "evaluation.every_steps=-2 must be 0"),
        ("evaluation.batch_size=0", "evaluation.batch_size=0 must be positive"),
        ("evaluation.max_batches=0", "evaluation.max_batches=0 must be positive"),
        ("evaluation.every_step=3", "did you mean 'evaluation.every_steps'"),
        ("evaluation.patience=0", "evaluation.patience=0 must be positive"),
        ("evaluation.patience=3", "checkpoint.best_metric is null; set it"),
        ("checkpoint.best_metric=' '", "checkpoint.best_metric is empty"),
    ],
)
def test_bad_evaluation_settings_are_config_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_an_empty_eval_set_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="build_eval_dataset\\(\\) returned an empty dataset; return None"):
        _checked_eval_set(TensorBatchDataset(torch.zeros(0)), "my:Task")
    assert _checked_eval_set(None, "my:Task") is None


def test_an_eval_row_is_named_eval_in_tensorboard_and_mlflow() -> None:
    row = {
        "kind": "eval",
        "global_step": 4,
        "loss": 0.5,
        "step_time_s": 2.0,
        "lr": None,
        "m_acc": 0.9,
        "world_size": 2,
        "samples_per_s": 10.0,
    }
    assert dict(scalars(row)) == {"eval/loss": 0.5, "eval/seconds": 2.0, "eval/acc": 0.9}


def test_show_lists_each_step_once_and_names_the_lowest_loss() -> None:
    def row(step: int, loss: float) -> dict[str, Any]:
        return {
            "kind": "eval",
            "global_step": step,
            "epoch": step // 4,
            "loss": loss,
            "m_acc": 0.5,
            "eval_samples": 10,
            "step_time_s": 0.25,
            "world_size": 2,
        }

    rows = eval_rows(
        [row(8, 0.4), {"kind": "step", "global_step": 5}, row(4, 0.6), row(8, 0.9), row(12, 0.5)]
    )
    assert [(r["global_step"], r["loss"]) for r in rows] == [(4, 0.6), (8, 0.4), (12, 0.5)]
    text = "\n".join(format_evaluations(rows, last=2))
    assert "evaluations (3)" in text and "(1 earlier evaluations not shown)" in text
    assert "ACC" in text and "lowest eval loss: 0.4000 at step 8" in text


def test_a_float_loss_is_fine_and_a_non_scalar_one_is_a_clear_error() -> None:
    class FloatLoss(Mean):
        def compute_eval(self, model: nn.Module, batch: Any) -> tuple[Any, dict[str, Any]]:
            (y,) = batch
            return float(y.sum()) / len(y), {}

    class Vector(Mean):
        def compute_eval(self, model: nn.Module, batch: Any) -> tuple[Any, dict[str, Any]]:
            (y,) = batch
            return y, {}

    cfg = load_config(None, ["evaluation.batch_size=4"])
    ds = Mean().build_eval_dataset()
    assert evaluate(FloatLoss(), nn.Linear(1, 1), ds, cfg, 0, 0, 1, torch.device("cpu")).loss == 4.5
    with pytest.raises(
        ConfigError, match=r"a loss of shape \(4,\) for eval batch 0: return the batch's mean"
    ):
        evaluate(Vector(), nn.Linear(1, 1), ds, cfg, 0, 0, 1, torch.device("cpu"))


def test_the_best_counts_each_evaluation_once_and_stops_after_patience() -> None:
    from cluster.rank.evaluate import BestEval

    best = BestEval("acc", "max", patience=2)
    assert best.update(2, {"loss": 1.0, "acc": 0.5}) is True  # the first is the best
    assert best.update(4, {"loss": 0.9, "acc": 0.5}) is False  # a tie is not better
    assert best.update(4, {"loss": 0.9, "acc": 0.5}) is False  # the same evaluation again: not counted twice
    assert best.state == {"value": 0.5, "step": 2, "since": 1, "last": 4} and not best.stop_due(4)
    assert best.update(6, {"loss": 0.8, "acc": float("nan")}) is False  # NaN never wins
    assert best.stop_due(6) and not best.stop_due(8)  # due at the evaluation that reached patience only
    assert best.update(8, {"loss": 0.7, "acc": 0.6}) is True and best.state["since"] == 0
    assert best.update(8, {"loss": 0.7, "acc": 0.6}) is True  # the best evaluated again at its own step

    lowest = BestEval("loss", "min", patience=None)
    assert lowest.update(1, {"loss": 2.0}) and not lowest.update(2, {"loss": 2.5})
    assert lowest.update(3, {"loss": 1.5}) and not lowest.stop_due(3)
    assert BestEval(None, "min", None).update(1, {"loss": 1.0}) is False  # no best_metric: nothing kept
    with pytest.raises(
        ConfigError, match=r"best_metric='acc' is not among the evaluation's metrics \(loss\)"
    ):
        BestEval("acc", "max", None).update(1, {"loss": 1.0})


class ReadAhead(TensorBatchDataset):
    """Says its reads may run ahead in another thread; records where each ran."""

    read_ahead = True

    def __init__(self, *tensors: torch.Tensor, fail_at: int | None = None) -> None:
        super().__init__(*tensors)
        self.threads: list[str] = []
        self.fail_at = fail_at

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        import threading

        self.threads.append(threading.current_thread().name)
        if self.fail_at is not None and int(indices[0]) == self.fail_at:
            raise OSError("storage read failed")
        return super().get_batch(indices)


def test_a_read_ahead_dataset_is_read_in_a_background_thread_with_the_same_result() -> None:
    task, cfg = Mean(), load_config(None, ["evaluation.batch_size=3"])
    plain = evaluate(task, nn.Linear(1, 1), task.build_eval_dataset(), cfg, 0, 0, 1, torch.device("cpu"))
    ds = ReadAhead(torch.arange(10, dtype=torch.float64))
    ahead = evaluate(task, nn.Linear(1, 1), ds, cfg, 0, 0, 1, torch.device("cpu"))
    assert (ahead.loss, ahead.metrics, ahead.samples) == (plain.loss, plain.metrics, plain.samples)
    assert len(ds.threads) == 4 and all(t.startswith("cluster-eval-read") for t in ds.threads)
    broken = ReadAhead(torch.arange(10, dtype=torch.float64), fail_at=6)
    with pytest.raises(OSError, match="storage read failed"):  # the reading thread's error, in this one
        evaluate(task, nn.Linear(1, 1), broken, cfg, 0, 0, 1, torch.device("cpu"))
