"""The driver's state machine and failure policy through one seam: a scripted worker group, no workers."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import pytest
import torch

from cluster.core.errors import Failure, ResourcesUnavailableError, TrainingFailedError, WorkerError
from cluster.driver.driver import Driver, Failed, FailurePolicy, Running, Starting
from cluster.run.checkpoint import CheckpointStore, serialize, step_dir
from cluster.run.logs import read_metrics
from cluster.seam.peers import PeerPlan, PeerState
from cluster.seam.protocol import Heartbeat, SetupInfo
from cluster.spec.config import FailureConfig
from cluster.spec.load import load_config
from tests.support.fakes import STEPS, ScriptedGroup, kinds, make, peer, transitions

pytestmark = pytest.mark.timeout(30)


def test_clean_run_walks_the_states_and_finishes() -> None:
    driver, _ = make({})
    assert isinstance(driver.state, Starting)
    driver._prepare_storage()
    state = driver._step(driver._initial_state())
    assert isinstance(state, Running) and (state.epoch, state.start_step, state.dispatched_at) == (0, 0, None)
    driver, _ = make({})
    result = driver.run()
    assert result.status == "finished" and result.global_step == 3 * STEPS and result.attempts == 1
    assert ScriptedGroup.instances[0].calls == ["epoch0@0", "epoch1@0", "epoch2@0", "finish"]
    assert ScriptedGroup.instances[0].shut is True  # graceful at the end
    assert kinds(driver).count("epoch_end") == 3 and "finished" in kinds(driver)
    from cluster.run.requests import driver_seen

    beat = driver_seen(driver.storage)  # the driver's presence, last written as it ended
    assert beat is not None and beat["ended"] is True and beat["state"] == "finished"
    assert beat["global_step"] == 3 * STEPS


def test_failure_kills_restarts_and_resumes_from_checkpoint() -> None:
    driver, _ = make({0: ["ok", Failure("worker_died", 1, "worker_died:rank 1 died")]}, resume={1: 6})
    result = driver.run()
    assert result.status == "finished" and result.attempts == 2
    first, second = ScriptedGroup.instances
    assert first.shut is False  # killed at once, not gracefully
    assert second.calls[0] == "epoch1@2"  # resumed mid-epoch from the checkpoint at step 6
    ev = driver.events.records()
    fail = next(e for e in ev if e["event"] == "failure")
    assert fail["kind"] == "worker_died"
    assert next(e for e in ev if e["event"] == "decision")["restart"] is True
    assert any(e["event"] == "recovered" for e in ev)


def test_same_user_error_at_same_step_twice_fails_fast() -> None:
    err = Failure("user_error", 1, "user_error:boom")
    driver, _ = make({0: [err], 1: [err], 2: [err]}, ["failures.max_failures=10"])
    with pytest.raises(TrainingFailedError, match="happened twice at step 3"):
        driver.run()
    assert isinstance(driver.state, Failed) and isinstance(driver.state.error, TrainingFailedError)
    assert len(ScriptedGroup.instances) == 2


def test_budget_exhausted_and_unlimited() -> None:
    crash = Failure("worker_died", 0, "worker_died:x")
    driver, _ = make({0: [crash], 1: [crash]}, ["failures.max_failures=1"])
    with pytest.raises(TrainingFailedError, match="max_failures=1 exhausted"):
        driver.run()
    driver, _ = make({a: [crash] for a in range(6)}, ["failures.max_failures=-1"])
    assert driver.run().attempts == 7


def test_hang_detected_by_heartbeat() -> None:
    driver, _ = make({0: ["hang"]})
    driver.cfg.failures.hang_timeout_s = 0.2  # below what a real heartbeat measures (refused in a config)
    result = driver.run()
    assert result.failures[0]["kind"] == "hang"
    assert "no progress" in result.failures[0]["message"]
    # where the ranks stood, taken before the hung group was killed
    ev = driver.events.records()
    (dump,) = [e for e in ev if e["event"] == "stacks"]
    assert [e["event"] for e in ev].index("stacks") < [e["event"] for e in ev].index("failure")
    assert dump["kind"] == "hang" and dump["reason"].startswith("hang: no progress")
    assert dump["groups"] == [
        {"ranks": [0], "where": "all_reduce (torch/d.py:5) from _train_step (cluster/rank/worker.py:9)"},
        {"ranks": [1], "where": "compute_loss (r/mytask.py:7)"},
    ]
    assert driver.storage.read_bytes(dump["path"]).decode().startswith("# stacks of 2 rank(s): hang")
    assert "where the ranks are (hang: no progress" in driver.out.getvalue()  # type: ignore[attr-defined]
    from cluster.inspect import format_show, report

    shown = format_show(report(driver.storage))  # python -m cluster show
    assert (
        f"stacks (hang, step 1): {dump['path']}" in shown
        and "ranks [1]: compute_loss (r/mytask.py:7)" in shown
    )


def test_resources_never_appear_is_a_clear_error() -> None:
    driver, _ = make({}, capacity=0)
    with pytest.raises(ResourcesUnavailableError, match="no room"):
        driver.run()
    assert "failed" in kinds(driver)


def test_policy_backoff_doubles_and_is_capped() -> None:
    policy = FailurePolicy(FailureConfig(max_failures=-1, backoff_s=1.0, backoff_max_s=5.0))
    hist: list[Failure] = []
    delays = []
    for _ in range(5):
        hist.append(Failure("worker_died", 0, "x"))
        delays.append(policy.decide(hist[-1], hist).delay_s)
    assert delays == [0.0, 1.0, 2.0, 4.0, 5.0]
    # progress in between (an epoch completed) makes the next restart immediate again
    assert policy.decide(hist[-1], hist, streak=1).delay_s == 0.0


def test_every_transition_goes_through_one_place_and_states_carry_their_data(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="cluster.driver.driver")
    driver, _ = make({0: ["ok", Failure("worker_died", 1, "worker_died:rank 1 died")]}, resume={1: 6})
    assert driver.run().status == "finished"
    assert transitions(caplog) == [
        "starting -> starting",
        "starting -> running",
        "running -> running",  # epoch 0, then epoch 1 fails
        "running -> recovering",
        "recovering -> starting",
        "starting -> running",  # resumed at epoch 1 step 2
        "running -> running",
        "running -> finishing",
        "finishing -> finished",
    ]
    described = [r.getMessage() for r in caplog.records if "recovering from" in r.getMessage()]
    assert described and "worker_died (rank 1)" in described[0]  # the Recovering state holds its failure
    recovered = next(e for e in driver.events.records() if e["event"] == "recovered")
    assert recovered["kind"] == "worker_died" and recovered["lost_steps"] == 0


def _commit_final(driver: Driver, step: int, epoch: int, corrupt: bool = False) -> None:
    store = CheckpointStore(driver.storage)
    store.commit(step, {"model.pt": serialize({"w": torch.zeros(2)})}, {"epoch": epoch})
    if corrupt:
        driver.storage.write_bytes(f"{step_dir(step)}/model.pt", b"torn")


def test_already_complete_is_decided_once_before_any_worker_starts() -> None:
    driver, _ = make({})
    _commit_final(driver, 3 * STEPS, 3)
    result = driver.run()
    assert result.status == "finished" and result.global_step == 3 * STEPS and result.epochs_completed == 3
    assert ScriptedGroup.instances == []  # no group was ever created
    assert kinds(driver) == ["run_start", "already_complete"]


def test_a_final_checkpoint_that_does_not_verify_means_training_runs() -> None:
    driver, _ = make({})
    _commit_final(driver, 3 * STEPS, 3, corrupt=True)
    assert driver.run().status == "finished"
    assert len(ScriptedGroup.instances) == 1 and "already_complete" not in kinds(driver)


def test_survivors_agreeing_are_the_source_and_the_recovery_says_so() -> None:
    driver, _ = make({0: ["ok", Failure("worker_died", 1, "worker_died:rank 1 died")]}, resume={1: 4})
    ScriptedGroup.survivors = {0: peer(6), 2: peer(6)}
    ScriptedGroup.rows = [{"global_step": 5, "loss": 0.5}, {"global_step": 6, "loss": 0.4}]
    result = driver.run()
    assert result.status == "finished" and result.attempts == 2
    second = ScriptedGroup.instances[1]
    assert second.adopted.count == 2
    assert second.peers == PeerPlan(0, 6, 1, 2, "d1", 1000, (0, 2))  # not the checkpoint at step 4
    assert second.calls[0] == "epoch1@2"
    ev = driver.events.records()
    decision = next(e for e in ev if e["event"] == "decision")
    assert decision["source"] == "peers" and decision["peer_source"] == 0 and decision["peer_step"] == 6
    recovered = next(e for e in ev if e["event"] == "recovered")
    assert recovered["source"] == "peers" and recovered["resume_step"] == 6
    # rank 0's rows buffered before the failure reached the Parquet files
    steps = read_metrics(driver.storage).to_pydict()
    assert {5, 6} <= {g for g, k in zip(steps["global_step"], steps["kind"]) if k == "step"}


@pytest.mark.parametrize(
    ("survivors", "kind", "overrides", "why"),
    [
        ({0: ("6", "a"), 2: ("6", "b")}, "worker_died", [], "hold different states"),
        ({}, "worker_died", [], "no healthy survivor"),
        ({0: ("6", "a")}, "hang", [], "a hang"),
        ({0: ("6", "a")}, "worker_died", ["failures.recover_from_peers=false"], None),
        ({0: ("4", "a"), 2: ("6", "a")}, "worker_died", [], "more than one step apart"),
    ],
)
def test_each_fallback_resumes_from_the_checkpoint_and_says_why(
    survivors: dict[int, tuple[str, str]], kind: str, overrides: list[str], why: str | None
) -> None:
    driver, _ = make({0: ["ok", Failure(kind, 1, f"{kind}:x")]}, overrides, resume={1: 4})
    ScriptedGroup.survivors = {r: peer(int(step), digest) for r, (step, digest) in survivors.items()}
    result = driver.run()
    assert result.status == "finished"
    assert ScriptedGroup.instances[1].peers is None
    assert ScriptedGroup.instances[1].calls[0] == "epoch1@0"  # the checkpoint at step 4
    decision = next(e for e in driver.events.records() if e["event"] == "decision")
    assert decision["source"] == "checkpoint"
    if why is None:
        assert decision["fallback"] is None  # switched off: not a fallback
    else:
        assert why in decision["fallback"]


def test_a_lost_node_with_survivors_elsewhere_recovers_from_them() -> None:
    """A lost node takes its ranks' processes; the ranks on other nodes keep theirs and their state."""
    driver, _ = make({0: ["ok", Failure("node_lost", 1, "node_lost:gone")]}, resume={1: 4})
    ScriptedGroup.survivors = {0: peer(6, "a")}
    result = driver.run()
    assert result.status == "finished" and len(result.failures) == 1
    assert ScriptedGroup.instances[1].peers is not None
    decision = next(e for e in driver.events.records() if e["event"] == "decision")
    assert decision["source"] == "peers" and decision["fallback"] is None


def test_a_lost_node_with_nothing_kept_says_why() -> None:
    driver, _ = make({0: ["ok", Failure("node_lost", 1, "node_lost:gone")]}, resume={1: 4})
    ScriptedGroup.survivors = None  # salvage kept nothing (no room for the lost ranks in time)
    assert driver.run().status == "finished"
    decision = next(e for e in driver.events.records() if e["event"] == "decision")
    assert decision["source"] == "checkpoint" and "a node was lost" in decision["fallback"]


def test_the_automatic_hang_timeout_stays_below_the_process_group_timeout() -> None:
    """A slow step raises the automatic hang timeout (10x the slowest step), but never to the process-group
    timeout: a stuck collective must be reported as a hang, not as a dead worker when it times out."""
    from cluster.driver.policy import HangWatch

    cfg = load_config(overrides=["failures.process_group_timeout_s=100", "failures.hang_timeout_floor_s=20"])
    watch = HangWatch(cfg.failures, 0)
    assert watch.timeout() == 20
    watch.update([Heartbeat(0, 1, 0.0, 3.0, True)])  # a 3 s step: 30 s
    assert watch.timeout() == 30
    watch.update([Heartbeat(0, 2, 0.0, 50.0, True)])  # a 50 s step would make it 500 s
    assert watch.timeout() == 90


def test_an_evaluation_s_batches_are_progress_for_the_hang_watch() -> None:
    """No step advances while an evaluation runs: its batches keep the rank from being called hung, and a
    rank stuck inside one is still found."""
    from cluster.driver.policy import HangWatch

    # 0.2 s: below what a real heartbeat measures (refused in a config), set here for the watch alone
    watch = HangWatch(dataclasses.replace(load_config().failures, hang_timeout_s=0.2), 0)
    for batches in range(1, 5):  # 0.4 s at step 7, one eval batch every 0.1 s
        assert watch.update([Heartbeat(0, 7, 0.0, 0.01, True, eval_batches=batches)]) is None
        time.sleep(0.1)
    time.sleep(0.15)
    hung = watch.update([Heartbeat(0, 7, 0.0, 0.01, True, eval_batches=4)])
    assert hung is not None and hung[0] == 0 and "no progress" in hung[1]


class DivergingGroup(ScriptedGroup):
    """Rank 0 finds a NaN loss whose first step was 7 (``DivergedError``); a rolled-back start resumes from
    checkpoint 4, deleting checkpoint 6, as ``Worker._rollback_point`` reports it."""

    def classify(self, exc: BaseException, starting: bool = False) -> Failure:
        at = 7 + 10 * self.attempt  # each attempt diverges further on
        err = WorkerError(
            0, at + 1, "DivergedError", f"the loss is nan at step {at}", "Traceback", {"first_step": at}
        )
        return Failure("user_error", 0, str(exc), err)

    def start(
        self,
        world_size: int,
        peers: PeerPlan | None = None,
        skips: list[tuple[int, int]] | None = None,
        rollback: tuple[int, int] | None = None,
    ) -> list[SetupInfo]:
        infos = super().start(world_size, peers, skips, rollback)
        back = {"window": list(rollback), "checkpoint_step": 4, "discarded": [6]} if rollback else None
        rp = dataclasses.replace(infos[0].resume, rollback=back, skipped_steps=list(skips or []))
        return [dataclasses.replace(i, resume=rp) for i in infos]


def test_a_nan_loss_rolls_back_before_its_window_never_from_the_survivors_memory() -> None:
    nan = Failure("user_error", 0, "user_error:nan")
    driver, _ = make(
        {0: ["ok", nan]},
        ["failures.nan_skip_steps=3", 'training.skip_steps=["1-2"]'],
        resume={1: 4},
        group_cls=DivergingGroup,
    )
    ScriptedGroup.survivors = {r: PeerState(r, 8, 2, 0, "d", 10, "") for r in range(2)}  # poisoned memory
    result = driver.run()
    assert result.status == "finished" and result.attempts == 2
    assert result.skipped_steps == [(1, 2), (5, 7)]  # the config's and the rollback's
    first, second = ScriptedGroup.instances
    assert (first.skips, first.rollback) == ([(1, 2)], None)
    assert (second.skips, second.rollback, second.peers) == ([(1, 2), (5, 7)], (5, 7), None)
    assert second.calls[0] == "epoch1@0"  # from checkpoint step 4
    ev = driver.events.records()
    decision = next(e for e in ev if e["event"] == "decision")
    assert decision["restart"] and decision["source"] == "checkpoint"
    assert "not finite" in decision["fallback"]
    (rollback,) = [e for e in ev if e["event"] == "rollback"]
    assert rollback["window"] == [5, 7] and rollback["skipped"] == [5, 7]
    assert (rollback["checkpoint_step"], rollback["discarded"], rollback["resume_step"]) == (4, [6], 4)
    out = driver.out.getvalue()  # type: ignore[attr-defined]
    assert "rolled back to checkpoint step 4 after a loss that was not finite: the batches of steps 5-7" in (
        out
    )


def test_a_nan_loss_stops_the_run_without_nan_skip_steps_and_rollbacks_count_as_failures() -> None:
    nan = Failure("user_error", 0, "user_error:nan")
    driver, _ = make({0: [nan]}, group_cls=DivergingGroup)
    with pytest.raises(TrainingFailedError, match="training diverged"):
        driver.run()
    assert len(ScriptedGroup.instances) == 1
    twice = {0: [nan], 1: [nan]}
    driver, _ = make(
        twice, ["failures.nan_skip_steps=3", "failures.max_failures=1"], group_cls=DivergingGroup
    )
    with pytest.raises(TrainingFailedError, match="max_failures=1 exhausted"):
        driver.run()
    assert len(ScriptedGroup.instances) == 2


def test_the_skip_windows_a_checkpoint_holds_are_the_runs_from_the_first_start() -> None:
    """A resubmission after a rollback (the driver that rolled back is gone): the windows come back from the
    checkpoint the ranks resumed from, and every later start passes them on."""

    class Resumed(ScriptedGroup):
        def start(self, *args: Any, **kwargs: Any) -> list[SetupInfo]:
            infos = super().start(*args, **kwargs)
            rp = dataclasses.replace(infos[0].resume, skipped_steps=[(3, 4)])
            return [dataclasses.replace(i, resume=rp) for i in infos]

    crash = Failure("worker_died", 1, "worker_died:rank 1 died")
    driver, _ = make({0: ["ok", crash]}, resume={1: 6}, group_cls=Resumed)
    result = driver.run()
    assert result.status == "finished" and result.skipped_steps == [(3, 4)]
    assert ScriptedGroup.instances[1].skips == [(3, 4)]  # the restart is told them
