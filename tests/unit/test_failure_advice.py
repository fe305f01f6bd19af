"""The message of a run that gives up says what a rerun does, from what storage holds: no checkpoint -> a
rerun starts from step 0 (nothing is "intact"); checkpoints -> the newest that verifies, by step. Real
checkpoints in the driver's storage; the worker group is the scripted one of the driver's unit tests."""

from __future__ import annotations

import pytest
import torch

from cluster.core.errors import Failure, TrainingFailedError
from cluster.inspect import resume_advice
from cluster.run.checkpoint import CheckpointStore, serialize, step_dir
from cluster.run.storage import Storage
from tests.support.fakes import make

pytestmark = pytest.mark.timeout(30)


def _gives_up(commits: dict[int, bool]) -> str:
    """The message of a run that fails for good (the same user error twice) after ``commits`` (step ->
    whether the checkpoint stays intact) were written to its storage."""
    err = Failure("user_error", 1, "user_error:boom")
    driver, _ = make({0: [err], 1: [err]}, ["failures.max_failures=10"])
    store = CheckpointStore(driver.storage)
    for step, intact in commits.items():
        store.commit(step, {"model.pt": serialize({"w": torch.zeros(2)})}, {"epoch": 0})
        if not intact:
            driver.storage.write_bytes(f"{step_dir(step)}/model.pt", b"torn")
    with pytest.raises(TrainingFailedError) as info:
        driver.run()
    return str(info.value)


def test_without_checkpoints_the_message_says_a_rerun_starts_from_step_0() -> None:
    text = _gives_up({})
    first = text.splitlines()[0]
    assert "happened twice" in first  # the reason, then the advice, on the first line
    assert "intact" not in text and "to resume" not in text, text
    assert "no checkpoint" in first and "from step 0" in first, first


def test_with_checkpoints_the_message_names_the_newest_that_verifies() -> None:
    first = _gives_up({2: True, 4: True, 5: False}).splitlines()[0]
    assert "intact" in first and "resume from step 4" in first, first  # step 5 is torn: not named


def test_the_advice_itself(tmp_path: object) -> None:
    run = Storage(f"{tmp_path}/run")
    assert "from step 0" in resume_advice(run) and "intact" not in resume_advice(run)
    store = CheckpointStore(run)
    store.commit(3, {"model.pt": serialize({"w": torch.zeros(2)})}, {"epoch": 0})
    assert "resume from step 3" in resume_advice(run) and "intact" in resume_advice(run)
    run.write_bytes(f"{step_dir(3)}/model.pt", b"torn")  # the only checkpoint no longer verifies
    advice = resume_advice(run)
    assert "from step 0" in advice and "intact" not in advice, advice
