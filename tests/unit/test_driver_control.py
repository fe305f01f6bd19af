"""The driver's requests through the scripted group: a stop (signal, stop file, time limit), stacks and
profiles asked for while the ranks train (cluster.driver.control)."""

from __future__ import annotations

import time
from collections.abc import Collection

import pytest

from cluster.core.errors import Failure
from cluster.run.checkpoint import CommitRecord
from cluster.seam.peers import PeerState
from cluster.seam.protocol import Salvage
from tests.support.fakes import STEPS, ScriptedGroup, kinds, make

pytestmark = pytest.mark.timeout(30)


def test_stacks_asked_for_while_training_are_answered_once_with_the_request_id() -> None:
    from cluster.run.requests import STACKS_FILE, write_stacks_request

    driver, _ = make(
        {0: ["busy", "busy"]},
        capacity=3,
        overrides=["scaling.num_workers=3", "training.global_batch_size=48"],
    )
    req = write_stacks_request(driver.storage)
    driver.control.started_at = 0.0  # the request is newer than this driver: not removed as stale
    assert driver.run().status == "finished"
    (dump,) = [e for e in driver.events.records() if e["event"] == "stacks"]
    assert dump["request"] == req and dump["kind"] == "request" and dump["silent"] == [2]
    assert not driver.storage.exists(STACKS_FILE)
    text = driver.storage.read_bytes(dump["path"]).decode()
    assert "ranks 2: no answer" in text and "=== rank 2 on h\n(no answer)" in text


class CommittingGroup(ScriptedGroup):
    """Rank 0 commits the checkpoint a stop asks for; its flush (``finish``) reports it."""

    def finish(self) -> list[CommitRecord]:
        super().finish()
        step = getattr(self, "stop_step", None)
        return [CommitRecord(step, self.epoch, f"mem://{step}", 10, 0.0, 0.01)] if step is not None else []


def test_a_stop_asked_for_stops_every_rank_at_a_step_with_a_checkpoint_and_ends_stopped() -> None:
    driver, _ = make({0: ["busy", "busy"]}, group_cls=CommittingGroup)
    driver.request_stop("SIGTERM")  # as the signal handler does: only a field is set
    result = driver.run()
    assert result.status == "stopped" and result.stop_reason == "SIGTERM"
    assert result.global_step == 1 and result.attempts == 1 and result.failures == []
    (group,) = ScriptedGroup.instances
    assert group.calls == ["epoch0@0", "stop(checkpoint=True)", "finish"]  # stopped, flushed, then gone
    assert group.shut is True  # gracefully: the checkpoint was flushed first
    ev = driver.events.records()
    asked = next(e for e in ev if e["event"] == "stop_requested")
    assert asked["reason"] == "SIGTERM" and asked["stop_step"] == 1
    stopped = next(e for e in ev if e["event"] == "stopped")
    assert stopped["global_step"] == 1 and stopped["committed"] is True and stopped["reason"] == "SIGTERM"
    assert [e["event"] for e in ev if e["event"] == "checkpoint"] == ["checkpoint"]
    assert "finished" not in kinds(driver)
    text = driver.out.getvalue()  # type: ignore[attr-defined]
    assert "stopping (SIGTERM): every rank stops after step 1" in text
    assert "stopped at step 1 (SIGTERM)" in text and "Resubmit the same job to resume" in text


def test_a_stop_file_is_read_while_training_acted_on_once_and_removed() -> None:
    from cluster.run.requests import STOP_FILE, read_stop_request, request_stop

    driver, _ = make({0: ["busy", "busy"]}, group_cls=CommittingGroup)
    request_stop(driver.run_url, reason="python -m cluster stop by me@here")  # after the driver started
    result = driver.run()
    assert result.status == "stopped" and result.stop_reason == "python -m cluster stop by me@here"
    assert not driver.storage.exists(STOP_FILE) and read_stop_request(driver.storage) is None
    assert kinds(driver).count("stopped") == 1


def test_a_stop_request_older_than_the_driver_is_removed_unread(caplog: pytest.LogCaptureFixture) -> None:
    from cluster.run.requests import STOP_FILE, write_stop_request
    from cluster.run.storage import Storage

    driver, _ = make({})
    write_stop_request(Storage(driver.run_url), reason="a stop that found no job")
    driver.control.started_at = time.time() + 1  # the request predates this driver
    result = driver.run()
    assert result.status == "finished" and result.global_step == 3 * STEPS
    assert not driver.storage.exists(STOP_FILE)
    assert any("before this job started" in r.getMessage() for r in caplog.records)


def test_a_failure_while_stopping_ends_the_run_stopped_without_a_restart() -> None:
    driver, _ = make({0: ["busy", Failure("worker_died", 1, "worker_died:rank 1 died")]})
    driver.request_stop("SIGINT")
    result = driver.run()
    assert result.status == "stopped" and len(ScriptedGroup.instances) == 1  # no recovery
    assert ScriptedGroup.instances[0].shut is False
    stopped = next(e for e in driver.events.records() if e["event"] == "stopped")
    assert stopped["committed"] is False and "worker_died, rank 1" in stopped["note"]
    assert "decision" not in kinds(driver)


def test_a_stop_reached_by_the_epoch_end_keeps_that_epoch_and_a_last_epoch_finishes() -> None:
    class EpochFirst(CommittingGroup):  # every epoch ends before the step the stop named
        def stop(self, checkpoint: bool) -> int:
            step = super().stop(checkpoint)
            self.stop_step = None
            return step

    driver, _ = make({0: ["busy", "busy"]}, group_cls=EpochFirst)
    driver.request_stop("SIGINT")
    result = driver.run()
    assert result.status == "stopped" and result.global_step == STEPS and result.epochs_completed == 1
    assert kinds(driver).count("epoch_end") == 1
    # the stop's checkpoint was taken at the epoch's end; no next epoch is dispatched
    assert ScriptedGroup.instances[0].calls == ["epoch0@0", "stop(checkpoint=True)", "finish"]

    driver, _ = make({0: ["busy", "busy"]}, ["training.epochs=1"], group_cls=EpochFirst)
    driver.request_stop("SIGINT")
    assert driver.run().status == "finished"  # the stop came with the last epoch's end: nothing to stop


def test_signals_stop_cleanly_once_then_at_once_and_the_old_handlers_come_back() -> None:
    import signal

    from cluster.api.train import stop_on_signals

    driver, _ = make({})
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals(driver):
        signal.raise_signal(signal.SIGTERM)  # the handler runs before raise_signal returns
        assert driver.control.stop is not None and driver.control.stop.reason == "SIGTERM"
        with pytest.raises(KeyboardInterrupt, match="SIGINT again"):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_profile_asked_for_reaches_the_named_ranks_and_is_recorded() -> None:
    from cluster.run.requests import PROFILE_FILE, write_profile_request

    driver, _ = make({0: ["busy", "busy"]})
    req = write_profile_request(driver.storage, steps=500, ranks=[1, 7])  # 7: no such rank; 500: too many
    driver.control.started_at = 0.0
    assert driver.run().status == "finished"
    (asked,) = [e for e in driver.events.records() if e["event"] == "profile_requested"]
    assert asked["request"] == req and asked["ranks"] == [1] and asked["steps"] == 100
    assert asked["folder"].startswith("profiles/") and asked["folder"].endswith(req)
    assert f"profile({req}, 100, [1])" in ScriptedGroup.instances[0].calls
    assert not driver.storage.exists(PROFILE_FILE)

    driver, _ = make({0: ["busy"]})
    write_profile_request(driver.storage, steps=3, ranks=None)  # every rank
    driver.control.started_at = 0.0
    driver.run()
    (asked,) = [e for e in driver.events.records() if e["event"] == "profile_requested"]
    assert asked["ranks"] == [0, 1] and asked["steps"] == 3


def test_requests_left_from_before_the_job_are_removed_unanswered() -> None:
    from cluster.run.requests import PROFILE_FILE, STACKS_FILE, write_profile_request, write_stacks_request

    driver, _ = make({0: ["busy"]})
    write_profile_request(driver.storage, 3, None)
    write_stacks_request(driver.storage)
    driver.control.started_at = time.time() + 1
    assert driver.run().status == "finished"
    assert not driver.storage.exists(PROFILE_FILE) and not driver.storage.exists(STACKS_FILE)
    assert not {"stacks", "profile_requested"} & set(kinds(driver))


def test_a_time_limit_stops_the_run_cleanly_and_one_not_reached_does_nothing() -> None:
    driver, _ = make({0: ["busy", "busy"]}, ["training.time_limit_s=30"], group_cls=CommittingGroup)
    driver.control.started_at -= 31  # this submission has run for 31 s
    result = driver.run()
    assert result.status == "stopped" and result.stop_reason == "training.time_limit_s=30 reached"
    assert result.global_step == 1 and ScriptedGroup.instances[0].calls[:2] == [
        "epoch0@0",
        "stop(checkpoint=True)",
    ]
    stopped = next(e for e in driver.events.records() if e["event"] == "stopped")
    assert stopped["committed"] is True

    driver, _ = make({0: ["busy", "busy"]}, ["training.time_limit_s=3600"])
    assert driver.run().status == "finished"


class NoRoomAfterFailure(ScriptedGroup):
    """The failed rank's node is gone and no other has room: the replacement waits."""

    def salvage(
        self,
        failure: Failure | None,
        attempt: int,
        *,
        leaving: Collection[int] = (),
        keep_state: bool | None = None,
    ) -> Salvage | None:
        self.capacity[0] = 0
        return super().salvage(failure, attempt, leaving=leaving, keep_state=keep_state)


def test_a_stop_while_waiting_for_resources_ends_the_run_at_once_and_says_what_is_lost() -> None:
    import threading

    driver, _ = make({}, ["scaling.resource_wait_s=30"], capacity=0)  # no room: reserve waits (10 s here)
    ScriptedGroup.max_wait_s = 10.0  # far beyond the stop's 0.1 s, however busy the machine
    threading.Timer(0.1, driver.request_stop, ["SIGINT"]).start()
    t0 = time.monotonic()
    try:
        result = driver.run()
    finally:
        ScriptedGroup.max_wait_s = 0.5
    assert result.status == "stopped" and result.stop_reason == "SIGINT"
    assert time.monotonic() - t0 < 5  # not the whole wait
    (stopped,) = [e for e in driver.events.records() if e["event"] == "stopped"]
    assert stopped["committed"] is False and "nothing trained since the newest checkpoint" in stopped["note"]
    assert ScriptedGroup.instances[0].shut is False

    # after a failure, survivors that hold step 6 wait for a replacement that finds no room: stopping loses
    # what only they hold, and says so
    crash = Failure("worker_died", 1, "worker_died:rank 1 died")
    driver, _ = make({0: ["ok", crash]}, ["scaling.resource_wait_s=30"], group_cls=NoRoomAfterFailure)
    ScriptedGroup.survivors = {0: PeerState(0, 6, 1, 2, "d", 10, "")}
    ScriptedGroup.max_wait_s = 10.0
    threading.Timer(0.5, driver.request_stop, ["SIGTERM"]).start()
    try:
        result = driver.run()
    finally:
        ScriptedGroup.max_wait_s = 0.5
    assert result.status == "stopped"
    (stopped,) = [e for e in driver.events.records() if e["event"] == "stopped"]
    assert "the survivors of the failure held step 6, which is lost (steps 1-6)" in stopped["note"]
    assert ScriptedGroup.instances[-1].shut is False  # the adopted survivors were killed with it
