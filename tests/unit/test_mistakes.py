"""Every mistake of the table (``tests/support/mistakes.py``) that can be refused before anything starts is:
exit status 2, exactly one line on stderr naming the key (or option) and the fix, no traceback, nothing
written to storage. And the failure policy's side of set-up errors: the same error on every rank stops the
run at once whatever ``failures.max_failures`` says; one rank's is retried."""

from __future__ import annotations

import pytest

from cluster.core.errors import Failure, WorkerError
from cluster.driver.policy import FailurePolicy
from cluster.rank.worker import user_frame
from cluster.spec.load import load_config
from cluster.worker_group.classify import setup_failure
from tests.support.mistakes import MISTAKES, SETUP_MISTAKES, closed_port, fill, run

pytestmark = pytest.mark.timeout(120)


def test_the_table_is_at_least_forty_mistakes_across_keys_files_and_the_command_line() -> None:
    kinds = {m.kind for m in MISTAKES + SETUP_MISTAKES}
    assert len(MISTAKES) + len(SETUP_MISTAKES) >= 40
    assert {"config key", "config file", "command line", "environment", "set-up"} <= kinds
    assert len({m.what for m in MISTAKES + SETUP_MISTAKES}) == len(MISTAKES + SETUP_MISTAKES)


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.what for m in MISTAKES])
def test_a_mistake_is_refused_up_front_in_one_line(mistake: object, tmp_path: object) -> None:
    from tests.support.mistakes import Mistake

    assert isinstance(mistake, Mistake)
    port = closed_port()
    got = run(mistake, str(tmp_path), port)
    assert got.traceback is None, got.traceback
    assert got.code == mistake.code, got.lines
    assert len(got.lines) == 1, got.lines
    assert fill(mistake.expect, str(tmp_path), port) in got.lines[0]
    assert not got.wrote, "a refused job wrote to its storage"


def _setup_error(rank: int, every_rank: bool) -> Failure:
    err = WorkerError(
        rank,
        0,
        "ValueError",
        "bad\nvalue",
        "Traceback ...",
        {"phase": "setup", "where": "mytask.py:12", "every_rank": every_rank},
    )
    return setup_failure(err)


@pytest.mark.parametrize("max_failures", [3, -1])
def test_a_set_up_error_of_every_rank_is_not_retried(max_failures: int) -> None:
    failure = _setup_error(0, every_rank=True)
    assert failure.kind == "user_error"
    assert failure.message.splitlines()[0] == "ValueError in set-up at mytask.py:12 on every rank: bad value"
    policy = FailurePolicy(load_config(overrides=[f"failures.max_failures={max_failures}"]).failures)
    decision = policy.decide(failure, [failure])
    assert not decision.restart
    assert decision.reason.startswith("ValueError at mytask.py:12: bad value, raised in set-up on every rank")


def test_a_set_up_error_of_one_rank_is_retried_then_found_twice() -> None:
    policy = FailurePolicy(load_config(overrides=["failures.max_failures=-1"]).failures)
    first, again = _setup_error(1, every_rank=False), _setup_error(1, every_rank=False)
    assert first.message.startswith("ValueError in set-up at mytask.py:12 on rank 1: bad value")
    assert policy.decide(first, [first]).restart
    assert not policy.decide(again, [first, again]).restart


def test_user_frame_names_the_task_s_line_not_torch_s() -> None:
    import torch

    def build_model() -> None:
        torch.nn.Linear(-1, 2)  # torch raises inside itself

    try:
        build_model()
    except Exception as exc:
        where = user_frame(exc)
    line = build_model.__code__.co_firstlineno + 1
    assert where == f"tests/unit/test_mistakes.py:{line}"
