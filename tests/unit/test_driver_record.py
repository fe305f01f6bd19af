"""The run's record through the driver: console lines and the live bar, events, metric rows and evaluations
(cluster.driver.record)."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import time
from typing import Any

import pytest

from cluster.core.errors import Failure
from cluster.run.logs import read_metrics
from cluster.seam.protocol import EpochResult, Heartbeat, SetupInfo
from cluster.spec.config import JobConfig
from tests.support.fakes import STEPS, ScriptedGroup, make, peer

pytestmark = pytest.mark.timeout(30)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("overrides", "terminal", "expected"),
    [
        ([], False, 3.0),  # a twentieth of the default 60 s hang timeout: fewer calls into training workers
        (
            ["failures.hang_timeout_s=600", "failures.process_group_timeout_s=900"],
            False,
            5.0,
        ),  # capped at 5 * poll_s
        (["failures.hang_timeout_s=4"], False, 1.0),  # never below poll_s
        ([], True, 1.0),  # a terminal's live bar refreshes every poll_s
    ],
)
def test_heartbeat_interval(overrides: list[str], terminal: bool, expected: float) -> None:
    driver, _ = make({0: ["busy", "busy", "busy"]}, overrides)
    driver.poll_s = 1.0
    if terminal:
        driver.out = _Terminal()
    assert driver.run().status == "finished"
    assert ScriptedGroup.instances[0].polls[:4] == [expected] * 4


def test_spare_ready_is_reported_once_per_group() -> None:
    driver, _ = make({0: ["busy", "busy", "busy"]})
    answers = iter([None, 1.25])
    original_factory = driver.group_factory

    def factory(cfg: JobConfig, url: str, attempt: int) -> Any:
        group = original_factory(cfg, url, attempt)
        group.spare_ready = lambda: next(answers, 9.0)  # type: ignore[method-assign]
        return group

    driver.group_factory = factory
    assert driver.run().status == "finished"
    ready = [e for e in driver.events.records() if e["event"] == "spare_ready"]
    # not while preparing, then once with its time; never again for the same group
    assert [(e["attempt"], e["prepare_s"]) for e in ready] == [(0, 1.25)]


def test_workers_left_at_rays_niceness_are_warned_about_once(monkeypatch: pytest.MonkeyPatch) -> None:
    note = (
        "15 (not permitted to set scaling.worker_niceness=0: start Ray with RAY_worker_niceness=0, "
        "or give the workers CAP_SYS_NICE)"
    )
    monkeypatch.setattr(ScriptedGroup, "niceness", note)
    driver, _ = make({})
    assert driver.run().status == "finished"
    out = driver.out.getvalue()  # type: ignore[attr-defined]
    assert out.count("warning: workers run at niceness 15") == 1  # one line for the group, not one per rank
    assert "RAY_worker_niceness=0" in out
    started = [e for e in driver.events.records() if e["event"] == "group_started"]
    assert started[0]["niceness"] == [note]


def test_no_niceness_warning_at_normal_priority() -> None:
    driver, _ = make({})
    assert driver.run().status == "finished"
    assert "niceness" not in driver.out.getvalue()  # type: ignore[attr-defined]


def test_extra_metrics_reach_the_parquet_and_the_result() -> None:
    driver, _ = make({})
    original_poll = ScriptedGroup.poll

    def poll(self: ScriptedGroup, timeout: float) -> list[EpochResult] | None:
        results = original_poll(self, timeout)
        for r in results or []:
            r.metrics = {"acc": 0.25 * (r.epoch + 1)}
            r.step_rows = [
                {
                    "time": 1.0 + r.epoch,
                    "global_step": r.global_step,
                    "epoch": r.epoch,
                    "loss": 1.0,
                    "lr": 0.1,
                    "m_acc": 0.5,
                }
            ]
        return results

    ScriptedGroup.poll = poll  # type: ignore[method-assign]
    try:
        result = driver.run()
    finally:
        ScriptedGroup.poll = original_poll  # type: ignore[method-assign]
    assert result.metrics["acc"] == 0.75
    rows = read_metrics(driver.storage).to_pylist()
    assert [r["m_acc"] for r in rows if r["kind"] == "epoch"] == [0.25, 0.5, 0.75]
    assert [r["m_acc"] for r in rows if r["kind"] == "step"] == [0.5] * 3


def _eval_row(step: int, loss: float) -> dict[str, Any]:
    return {
        "kind": "eval",
        "time": time.time(),
        "global_step": step,
        "epoch": (step - 1) // STEPS,
        "step_in_epoch": (step - 1) % STEPS + 1,
        "loss": loss,
        "step_time_s": 0.5,
        "samples_per_s": 100.0,
        "world_size": 2,
        "attempt": 0,
        "eval_samples": 50,
        "m_acc": 0.9,
    }


def test_an_evaluation_the_failure_took_is_asked_for_again_and_one_that_arrived_is_not() -> None:
    """Survivors at step 6 (an eval point of evaluation.every_steps=2): the eval rank 0 ran there never
    reached the driver, so the next group evaluates before its first step. One that did arrive (step 4)
    is recorded once, even when rank 0 hands it over again."""
    driver, _ = make(
        {0: ["ok", Failure("worker_died", 1, "worker_died:rank 1 died")]},
        ["evaluation.every_steps=2"],
        resume={1: 4},
    )
    ScriptedGroup.survivors = {0: peer(6), 2: peer(6)}
    ScriptedGroup.rows = [_eval_row(4, 0.7), _eval_row(4, 0.7), {"global_step": 5, "loss": 0.5}]
    result = driver.run()
    assert result.status == "finished"
    first, second = ScriptedGroup.instances
    assert not hasattr(first, "evaluate_first")  # a fresh start at step 0: nothing due
    assert second.calls[0] == "epoch1@2" and second.evaluate_first == [6]
    ev = [e for e in driver.events.records() if e["event"] == "evaluation"]
    assert [(e["global_step"], e["loss"], e["metrics"]) for e in ev] == [(4, 0.7, {"acc": 0.9})]
    assert result.evaluation == {"global_step": 4, "epoch": 0, "loss": 0.7, "acc": 0.9}
    rows = [r for r in read_metrics(driver.storage).to_pylist() if r["kind"] == "eval"]
    assert [(r["global_step"], r["eval_samples"]) for r in rows] == [(4, 50)]
    assert "eval at step 4 (epoch 1): loss 0.7000, acc 0.9 (50 samples, 0.5s)" in driver.out.getvalue()


def test_a_baseline_evaluation_is_asked_for_before_a_new_run_s_first_step_only() -> None:
    driver, _ = make({}, ["evaluation.at_start=true"])
    driver.run()
    (first,) = ScriptedGroup.instances
    assert first.evaluate_first == [0] and first.calls[0] == "epoch0@0"


def test_an_evaluation_recorded_by_an_earlier_submission_is_not_asked_for_again(tmp_path: Any) -> None:
    """A resubmission resuming at an eval point reads the run's events: the eval there was recorded."""
    url = f"{tmp_path}/runs"
    first, _ = make({}, ["evaluation.every_steps=2", "training.epochs=1", f"storage.url={url}", "name=r"])
    first._prepare_storage()
    first.record.evaluation(_eval_row(4, 0.7))
    again, _ = make({}, ["evaluation.every_steps=2", "training.epochs=2", f"storage.url={url}", "name=r"])
    again._prepare_storage()
    missing = functools.partial(again.record.eval_missing, steps_per_epoch=STEPS)
    assert not missing(4) and missing(6) and not missing(5)


def test_the_live_bar_shows_an_evaluations_progress_while_the_step_stands_still() -> None:
    class Evaluating(ScriptedGroup):  # step 1 stays, each rank evaluates two more batches per heartbeat
        def heartbeats(self, timeout: float = 2.0) -> list[Heartbeat | None]:
            self.rounds = getattr(self, "rounds", 0) + 1
            return [
                Heartbeat(r, 1, 0.0, 0.01, True, eval_batches=2 * self.rounds) for r in range(self.world_size)
            ]

    driver, _ = make({0: ["busy", "busy", "busy"]}, group_cls=Evaluating)
    driver.out = _Terminal()
    assert driver.run().status == "finished"
    text = driver.out.getvalue()
    # the first round sees step 1 arrive; then 2 ranks x 2 batches per round
    assert "step 1/12 evaluating: 4 eval batches done" in text
    assert "step 1/12 evaluating: 8 eval batches done" in text

    class OfTen(Evaluating):  # the ranks report an evaluation's size: the bar shows done/total
        def start(self, *args: Any, **kwargs: Any) -> list[SetupInfo]:
            return [dataclasses.replace(i, eval_batches=10) for i in super().start(*args, **kwargs)]

    driver, _ = make({0: ["busy", "busy", "busy"]}, group_cls=OfTen)
    driver.out = _Terminal()
    assert driver.run().status == "finished"
    assert "step 1/12 evaluating: 4/10 batches" in driver.out.getvalue()


def test_a_secret_quoted_by_a_failure_is_hidden_in_the_events_and_the_console() -> None:
    """A task's exception that quotes a credential of the job (here a ``scaling.env`` value) reaches the
    event log and the console with that value hidden, as every sink has it (cluster.core.redact)."""
    secret = "hf_S3cr3tT0k3nValue"
    driver, _ = make(
        {0: ["ok", Failure("worker_died", 1, f"worker_died:rank 1: login refused for token {secret}")]},
        [f"scaling.env={{HF_TOKEN: {secret}}}"],
        resume={1: 6},
    )
    assert driver.run().status == "finished"
    assert secret not in json.dumps(driver.events.records())
    assert secret not in driver.out.getvalue()  # type: ignore[attr-defined]
    (failure,) = [e for e in driver.events.records() if e["event"] == "failure"]
    assert "login refused for token" in failure["message"]
