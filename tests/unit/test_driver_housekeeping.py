"""The driver's own housekeeping never fails a worker or crashes the driver (a malformed request, Ray not
answering a question about room), and a failure while finishing ends the run as failed with its real cause."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from cluster.core.errors import TrainingFailedError
from cluster.inspect import run_status
from cluster.run.checkpoint import CheckpointUnreadableError, CommitRecord
from cluster.run.requests import PROFILE_FILE
from cluster.seam.protocol import EpochResult, SetupInfo
from tests.support.fakes import STEPS, ScriptedGroup, kinds, make

pytestmark = [pytest.mark.timeout(60)]


class FinishFails(ScriptedGroup):
    def finish(self) -> list[CommitRecord]:
        raise RuntimeError("the actor of rank 1 died while flushing its checkpoint")


def test_a_failure_while_finishing_ends_the_run_failed_with_its_cause() -> None:
    driver, _ = make({}, ["training.epochs=1"], group_cls=FinishFails)
    with pytest.raises(TrainingFailedError) as err:
        driver.run()
    assert "RuntimeError while finishing" in str(err.value) and "rank 1 died" in str(err.value)
    (failed,) = [e for e in driver.events.records() if e["event"] == "run_failed"]
    assert "rank 1 died" in failed["error"]
    assert run_status(driver.events.records()) == "failed"  # not left looking interrupted
    assert ScriptedGroup.instances[0].shut is False  # the workers were killed, not left running


def test_a_malformed_profile_request_is_a_warning_and_the_run_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    driver, _ = make({0: ["busy", "busy"]})
    driver.storage.write_bytes(
        PROFILE_FILE, b'{"id": "p1", "steps": "many", "ranks": ["x", 1], "requested_at": 4102444800}'
    )
    with caplog.at_level(logging.WARNING, logger="cluster.driver.control"):
        result = driver.run()
    assert result.status == "finished" and not result.failures
    (asked,) = [e for e in driver.events.records() if e["event"] == "profile_requested"]
    assert asked["steps"] == 5 and asked["ranks"] == [1]
    assert "steps='many' is not a number" in caplog.text and "rank 'x' is not a rank" in caplog.text


def test_requested_at_that_is_not_a_time_is_a_stale_request_not_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    driver, _ = make({})
    driver.storage.write_bytes(PROFILE_FILE, b'{"id": "p1", "requested_at": null}')
    with caplog.at_level(logging.WARNING, logger="cluster.driver.control"):
        assert driver.run().status == "finished"
    assert "requested_at=None is not a time" in caplog.text
    assert "profile_requested" not in kinds(driver) and not driver.storage.exists(PROFILE_FILE)


class RayDoesNotAnswer(ScriptedGroup):
    def available_for(self, n: int) -> bool:
        raise ConnectionError("GCS unavailable")


def test_ray_not_answering_about_room_to_grow_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A smaller group (no room for 2) asks Ray for room at heartbeats and epoch ends; Ray failing to answer
    is logged once and training goes on at the smaller size."""
    driver, _ = make(
        {0: ["busy", "busy", "ok", "busy", "ok"]},
        ["scaling.min_workers=1", "scaling.resource_wait_s=0.1", "training.epochs=2"],
        capacity=1,
        group_cls=RayDoesNotAnswer,
    )
    with caplog.at_level(logging.WARNING, logger="cluster.driver.moves"):
        result = driver.run()
    assert result.status == "finished" and not result.failures and result.world_size == 1
    assert caplog.text.count("could not ask Ray for room to grow") == 1


class OutageAtStart(ScriptedGroup):
    """The first group's ranks cannot read the checkpoint (storage down past its retries)."""

    def start(self, world_size: int, *args: Any, **kwargs: Any) -> list[SetupInfo]:
        if self.attempt == 0:
            raise CheckpointUnreadableError("checkpoint at step 4: storage failed after 5 attempts: outage")
        return super().start(world_size, *args, **kwargs)


def test_a_checkpoint_unreadable_at_start_is_a_storage_failure_retried_never_a_fresh_start() -> None:
    driver, _ = make({}, ["training.epochs=1"], group_cls=OutageAtStart)
    result = driver.run()
    assert result.status == "finished" and [f["kind"] for f in result.failures] == ["storage"]
    assert "storage failed after 5 attempts" in result.failures[0]["message"]
    (decision,) = [e for e in driver.events.records() if e["event"] == "decision"]
    assert decision["restart"] is True


class CommitsFail(ScriptedGroup):
    """Every checkpoint the ranks ask for fails to commit (storage refusing writes)."""

    def poll(self, timeout: float) -> list[EpochResult] | None:
        results = super().poll(timeout)
        if results:
            step = results[0].global_step
            results[0].commits = [
                CommitRecord(step, results[0].epoch + 1, "", 0, 0.0, 0.1, "OSError: disk full")
            ]
        return results


def test_checkpoints_failing_in_a_row_stop_the_run_naming_the_last_good_one() -> None:
    driver, _ = make({}, ["training.epochs=6", "checkpoint.max_failed_commits=2"], group_cls=CommitsFail)
    with pytest.raises(TrainingFailedError) as err:
        driver.run()
    text = str(err.value)
    assert (
        "checkpoint.max_failed_commits=2" in text and "disk full" in text and "last good checkpoint" in text
    )
    assert [e["event"] for e in driver.events.records()].count("checkpoint_failed") == 2
    assert ScriptedGroup.instances[0].calls.count("epoch2@0") == 0  # no third epoch trained on


class FinalCommitFails(ScriptedGroup):
    def finish(self) -> list[CommitRecord]:
        step = 3 * STEPS
        return [CommitRecord(step, 3, "", 0, 0.0, 0.1, "OSError: quota exceeded")]


def test_a_final_checkpoint_that_does_not_commit_ends_the_run_failed() -> None:
    driver, _ = make({}, ["training.epochs=3"], group_cls=FinalCommitFails)
    with pytest.raises(TrainingFailedError) as err:
        driver.run()
    assert f"the final checkpoint at step {3 * STEPS} failed to commit" in str(err.value)
    assert "quota exceeded" in str(err.value)
    assert run_status(driver.events.records()) == "failed"
