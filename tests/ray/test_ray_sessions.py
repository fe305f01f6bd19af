"""One Python process, two Ray sessions in turn: what ``cluster.train`` does when a script or notebook
calls it twice with the embedded Ray (each call starts and stops its own)."""

from __future__ import annotations

import time

import pytest
import ray

from cluster.api import local_ray
from cluster.worker_group.calls import read_later, read_settled

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


@ray.remote
def _never_answers() -> None:
    time.sleep(600)


def test_answers_left_unread_by_one_ray_session_do_not_fail_the_next() -> None:
    """A call left unread when a group failed (``read_later``) outlives its Ray session in this process:
    the next session's shutdown reads what it left and must not fail on it (it did: "a Ray object whose
    owner is unknown", the second run failed while recovering)."""
    assert not ray.is_initialized()
    local_ray.start(1)
    try:
        read_later([_never_answers.remote()])
        assert read_settled(0.1) == 1  # still open in its own session
    finally:
        local_ray.shutdown()
    local_ray.start(1)
    try:
        assert read_settled(0.1) == 0  # the earlier session's call is dropped, nothing raised
        read_later([_never_answers.remote()])
        assert read_settled(0.1) == 1
    finally:
        local_ray.shutdown()
    assert read_settled() == 0  # no Ray: nothing to wait on
