"""The driver's state machine and failure policy through one seam: a scripted worker group, no workers."""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import time
from collections.abc import Collection
from typing import Any

import pytest
import torch

from cluster.checkpoint import CheckpointStore, CommitRecord, serialize, step_dir
from cluster.config import FailureConfig, JobConfig, load_config
from cluster.driver import Driver, Failed, FailurePolicy, Running, Starting
from cluster.errors import Failure, ResourcesUnavailableError, TrainingFailedError, WorkerError
from cluster.group import EpochResult, Heartbeat, Salvage, SetupInfo
from cluster.metrics import read_metrics
from cluster.peer import PeerPlan, PeerState
from cluster.preemption import DrainNotice
from tests.support.fakes import STEPS, ScriptedGroup, kinds, make

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
    from cluster.control import driver_seen

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
    driver, _ = make({0: ["hang"]}, ["failures.hang_timeout_s=0.2"])
    result = driver.run()
    assert result.failures[0]["kind"] == "hang"
    assert "no progress" in result.failures[0]["message"]
    # where the ranks stood, taken before the hung group was killed
    ev = driver.events.records()
    (dump,) = [e for e in ev if e["event"] == "stacks"]
    assert [e["event"] for e in ev].index("stacks") < [e["event"] for e in ev].index("failure")
    assert dump["kind"] == "hang" and dump["reason"].startswith("hang: no progress")
    assert dump["groups"] == [
        {"ranks": [0], "where": "all_reduce (torch/d.py:5) from _train_step (cluster/worker.py:9)"},
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


def test_stacks_asked_for_while_training_are_answered_once_with_the_request_id() -> None:
    from cluster.control import STACKS_FILE, write_stacks_request

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


def test_shrinks_to_min_workers_then_grows_back_at_epoch_boundary() -> None:
    driver, cap = make(
        {0: [Failure("node_lost", 1, "node_lost:gone")]}, ["scaling.min_workers=1"], resume={1: 0}
    )
    original_factory = driver.group_factory

    def factory(cfg: JobConfig, url: str, attempt: int) -> Any:
        if attempt == 1:
            cap[0] = 1  # the lost node did not come back
        if attempt == 2:
            cap[0] = 2
        group = original_factory(cfg, url, attempt)
        if attempt == 1:
            group.available_for = lambda n: True  # type: ignore[method-assign]  # resources return
        return group

    driver.group_factory = factory
    result = driver.run()
    assert result.status == "finished"
    sizes = [g.world_size for g in ScriptedGroup.instances]
    assert sizes == [2, 1, 2]
    resizes = [e for e in driver.events.records() if e["event"] == "resize"]
    assert [(e["old"], e["new"]) for e in resizes] == [(2, 1), (1, 2)]
    assert all(e["reason"] for e in resizes)


def test_a_smaller_group_grows_back_mid_epoch_at_a_step_checkpoint() -> None:
    """Room returns while the smaller group is in the middle of an epoch: it stops at the next step
    boundary with a checkpoint there, and the full group starts from it (no waiting for the epoch end)."""
    driver, cap = make(
        {0: [Failure("node_lost", 1, "node_lost:gone")], 1: ["busy", "busy"]},
        ["scaling.min_workers=1"],
        resume={1: 0, 2: 1},
    )
    original_factory = driver.group_factory

    def factory(cfg: JobConfig, url: str, attempt: int) -> Any:
        cap[0] = 1 if attempt == 1 else 2
        group = original_factory(cfg, url, attempt)
        if attempt == 1:
            group.available_for = lambda n: True  # type: ignore[method-assign]  # the node is back
        return group

    driver.group_factory = factory
    result = driver.run()
    assert result.status == "finished"
    small = ScriptedGroup.instances[1]
    assert small.world_size == 1 and "stop(checkpoint=True)" in small.calls
    assert small.calls.index("stop(checkpoint=True)") < small.calls.index("finish")  # stop, flush, resize
    assert ScriptedGroup.instances[2].world_size == 2
    resizes = [e for e in driver.events.records() if e["event"] == "resize"]
    assert [(e["old"], e["new"]) for e in resizes] == [(2, 1), (1, 2)]
    assert resizes[1]["at_step"] == 1  # one step into the epoch, not at its end


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


def transitions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage().split(" (")[0].removeprefix("state ")
        for r in caplog.records
        if r.name == "cluster.driver" and r.getMessage().startswith("state ")
    ]


def test_every_transition_goes_through_one_place_and_states_carry_their_data(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="cluster.driver")
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


def test_growing_back_is_a_transition_of_its_own(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="cluster.driver")
    driver, cap = make({}, ["scaling.min_workers=1"], capacity=1, resume={1: STEPS})
    original_factory = driver.group_factory

    def factory(cfg: JobConfig, url: str, attempt: int) -> Any:
        group = original_factory(cfg, url, attempt)
        if attempt == 0:

            def joined(n: int) -> bool:  # a node joins while the first epoch trains
                cap[0] = 2
                return True

            group.available_for = joined  # type: ignore[method-assign]
        return group

    driver.group_factory = factory
    assert driver.run().status == "finished"
    assert "running -> resizing" in transitions(caplog) and "resizing -> starting" in transitions(caplog)
    first, second = ScriptedGroup.instances
    assert first.calls == ["epoch0@0", "finish"] and first.shut is True  # flushed, then stopped gracefully
    assert second.world_size == 2 and second.calls[0] == "epoch1@0"


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


def _peer(step: int, digest: str = "d1") -> PeerState:
    return PeerState(0, step, step // STEPS, step % STEPS, digest, 1000)


def test_survivors_agreeing_are_the_source_and_the_recovery_says_so() -> None:
    driver, _ = make({0: ["ok", Failure("worker_died", 1, "worker_died:rank 1 died")]}, resume={1: 4})
    ScriptedGroup.survivors = {0: _peer(6), 2: _peer(6)}
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
    ScriptedGroup.survivors = {0: _peer(6), 2: _peer(6)}
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
    ScriptedGroup.survivors = {r: _peer(int(step), digest) for r, (step, digest) in survivors.items()}
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
    ScriptedGroup.survivors = {0: _peer(6, "a")}
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


# ------------------------------------------------------------------------------------------- preemption
def _notice(seconds_left: float | None, ranks: tuple[int, ...] = (1,)) -> DrainNotice:
    return DrainNotice("node-b", ranks, None if seconds_left is None else time.time() + seconds_left)


def test_drain_notice_moves_the_ranks_between_two_steps_from_peers() -> None:
    """Notice -> replacements placed and prepared -> stop at a step -> retire the draining rank -> the next
    group takes the state from a healthy rank: no failure, no step lost, before the deadline."""
    driver, _ = make({0: ["busy"] * 6}, ["training.epochs=2"])
    ScriptedGroup.drains = [_notice(60)]
    ScriptedGroup.move_script = ["placing", "preparing", "ready"]
    result = driver.run()
    assert result.status == "finished" and not result.failures
    first, second = ScriptedGroup.instances
    assert "prepare_move[1]" in first.calls
    assert "stop(checkpoint=False)" in first.calls  # the state moves from a peer: no checkpoint needed
    assert "salvage leaving [1] keep_state=True" in first.calls
    assert second.peers is not None and second.peers.global_step == 1  # resumed where the stop was
    assert second.calls[0] == "epoch0@1"
    ev = driver.events.records()
    (notice,) = [e for e in ev if e["event"] == "preemption_notice"]
    assert notice["ranks"] == [1] and 50 < notice["seconds_left"] <= 60
    (move,) = [e for e in ev if e["event"] == "preemption_move"]
    assert move["lost_steps"] == 0 and move["source"] == "peers" and move["seconds_before_deadline"] > 0
    assert not [e for e in ev if e["event"] in ("failure", "recovered")]
    assert not [e for e in ev if e["event"] == "preemption_notice"][1:]  # acted on once


def test_drain_notice_without_peer_recovery_moves_through_a_checkpoint_at_the_stop() -> None:
    driver, _ = make({0: ["busy", "busy"]}, ["training.epochs=2", "failures.recover_from_peers=false"])
    ScriptedGroup.drains = [_notice(60)]
    driver.run()
    first, second = ScriptedGroup.instances
    assert "stop(checkpoint=True)" in first.calls and "salvage leaving [1] keep_state=False" in first.calls
    assert second.peers is None


def test_notice_shorter_than_the_margin_checkpoints_at_once_and_shrinks_when_allowed() -> None:
    driver, _ = make({0: ["busy", "busy"]}, ["training.epochs=2", "scaling.min_workers=1"])
    ScriptedGroup.drains = [_notice(5)]  # under the default 10 s margin
    ScriptedGroup.move_script = ["placing"]
    result = driver.run()
    first, second = ScriptedGroup.instances[:2]
    assert not any(c.startswith("prepare_move") for c in first.calls)  # no time to place anything
    assert "stop(checkpoint=True)" in first.calls and "salvage leaving [1] keep_state=False" in first.calls
    assert second.world_size == 1 and result.status == "finished"
    ev = driver.events.records()
    (ck,) = [e for e in ev if e["event"] == "preemption_checkpoint"]
    assert ck["step"] == 1 and "preemption_margin_s" in ck["reason"]
    resizes = [e for e in ev if e["event"] == "resize"]
    assert (resizes[0]["old"], resizes[0]["new"]) == (2, 1) and "preemption" in resizes[0]["reason"]


def test_no_room_and_min_workers_rule_out_shrinking_so_the_same_ranks_go_on() -> None:
    """Replacements never placed and the deadline margin passes: checkpoint at the stop, then continue on
    the same group from that step (the node's loss, when it comes, is an ordinary lost node)."""
    driver, _ = make({0: ["busy", "busy", "busy"]}, ["training.epochs=2", "scaling.resource_wait_s=0.005"])
    ScriptedGroup.drains = [_notice(None)]  # a drain without a deadline waits scaling.resource_wait_s
    ScriptedGroup.move_script = ["placing"]
    result = driver.run()
    assert result.status == "finished" and len(ScriptedGroup.instances) == 1
    (group,) = ScriptedGroup.instances
    assert "prepare_move[1]" in group.calls and "cancel_move" in group.calls
    assert "stop(checkpoint=True)" in group.calls
    i = group.calls.index("stop(checkpoint=True)")
    assert "epoch0@1" in group.calls[i:]  # the same ranks go on from the stop step
    (ck,) = [e for e in driver.events.records() if e["event"] == "preemption_checkpoint"]
    assert "no room" in ck["reason"]


def test_preemption_off_never_reads_drains() -> None:
    driver, _ = make({0: ["busy"]}, ["failures.preemption=false"])
    ScriptedGroup.drains = [_notice(60)]
    driver.run()
    assert not hasattr(ScriptedGroup.instances[0], "drain_reads")


def test_the_automatic_hang_timeout_stays_below_the_process_group_timeout() -> None:
    """A slow step raises the automatic hang timeout (10x the slowest step), but never to the process-group
    timeout: a stuck collective must be reported as a hang, not as a dead worker when it times out."""
    from cluster.policy import HangWatch

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
    from cluster.policy import HangWatch

    watch = HangWatch(load_config(overrides=["failures.hang_timeout_s=0.2"]).failures, 0)
    for batches in range(1, 5):  # 0.4 s at step 7, one eval batch every 0.1 s
        assert watch.update([Heartbeat(0, 7, 0.0, 0.01, True, eval_batches=batches)]) is None
        time.sleep(0.1)
    time.sleep(0.15)
    hung = watch.update([Heartbeat(0, 7, 0.0, 0.01, True, eval_batches=4)])
    assert hung is not None and hung[0] == 0 and "no progress" in hung[1]


# ---------------------------------------------------------------------------------------- stop on request
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
    from cluster.control import STOP_FILE, read_stop_request, request_stop

    driver, _ = make({0: ["busy", "busy"]}, group_cls=CommittingGroup)
    request_stop(driver.run_url, reason="python -m cluster stop by me@here")  # after the driver started
    result = driver.run()
    assert result.status == "stopped" and result.stop_reason == "python -m cluster stop by me@here"
    assert not driver.storage.exists(STOP_FILE) and read_stop_request(driver.storage) is None
    assert kinds(driver).count("stopped") == 1


def test_a_stop_request_older_than_the_driver_is_removed_unread(caplog: pytest.LogCaptureFixture) -> None:
    from cluster.control import STOP_FILE, write_stop_request
    from cluster.storage import Storage

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

    from cluster.api import stop_on_signals

    driver, _ = make({})
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals(driver):
        signal.raise_signal(signal.SIGTERM)  # the handler runs before raise_signal returns
        assert driver.control.stop is not None and driver.control.stop.reason == "SIGTERM"
        with pytest.raises(KeyboardInterrupt, match="SIGINT again"):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_profile_asked_for_reaches_the_named_ranks_and_is_recorded() -> None:
    from cluster.control import PROFILE_FILE, write_profile_request

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
    from cluster.control import PROFILE_FILE, STACKS_FILE, write_profile_request, write_stacks_request

    driver, _ = make({0: ["busy"]})
    write_profile_request(driver.storage, 3, None)
    write_stacks_request(driver.storage)
    driver.control.started_at = time.time() + 1
    assert driver.run().status == "finished"
    assert not driver.storage.exists(PROFILE_FILE) and not driver.storage.exists(STACKS_FILE)
    assert not {"stacks", "profile_requested"} & set(kinds(driver))


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


# ------------------------------------------------------------------------------------ slow rank: move
class SlowOne(ScriptedGroup):
    """Rank 1's own part of each step is 3x the others' in every heartbeat; setup reports a node per rank."""

    def heartbeats(self, timeout: float = 2.0) -> list[Heartbeat | None]:
        from cluster.pace import Pace

        slow = self.attempt == 0  # the replacement keeps pace
        return [
            Heartbeat(r, 1, 0.0, 0.01, True, pace=Pace(0.03 if (r == 1 and slow) else 0.01, 0.031, 8, 0.0))
            for r in range(self.world_size)
        ]

    def start(
        self,
        world_size: int,
        peers: PeerPlan | None = None,
        skips: list[tuple[int, int]] | None = None,
        rollback: tuple[int, int] | None = None,
    ) -> list[SetupInfo]:
        infos = super().start(world_size, peers, skips, rollback)
        return [dataclasses.replace(i, node_id=f"node-{i.rank}-a{self.attempt}") for i in infos]


def test_a_slow_rank_is_moved_off_its_node_between_two_steps_when_asked_to() -> None:
    driver, _ = make(
        {0: ["busy"] * 8}, ["training.epochs=2", "failures.slow_rank_action=move"], group_cls=SlowOne
    )
    ScriptedGroup.move_script = ["placing", "preparing", "ready"]
    result = driver.run()
    assert result.status == "finished" and not result.failures
    first, second = ScriptedGroup.instances
    assert "prepare_move[1] avoid=['node-1-a0']" in first.calls  # never onto the slow node again
    assert "stop(checkpoint=False)" in first.calls and "salvage leaving [1] keep_state=True" in first.calls
    assert second.peers is not None  # the replacement got the state from a healthy rank
    ev = driver.events.records()
    assert [e["rank"] for e in ev if e["event"] == "slow_rank"] == [1]
    (begun,) = [e for e in ev if e["event"] == "slow_rank_move"]
    assert begun["rank"] == 1 and begun["node"] == "node-1-a0" and begun["via"] == "peers"
    (moved,) = [e for e in ev if e["event"] == "slow_rank_moved"]
    assert moved["ranks"] == [1] and moved["lost_steps"] == 0 and moved["source"] == "peers"
    assert not [e for e in ev if e["event"] in ("preemption_notice", "preemption_move", "failure")]


def test_a_slow_rank_with_nowhere_to_go_stays_and_is_only_reported() -> None:
    driver, _ = make(
        {0: ["busy"] * 8},
        ["training.epochs=2", "failures.slow_rank_action=move", "scaling.resource_wait_s=0.005"],
        group_cls=SlowOne,
    )
    ScriptedGroup.move_script = ["placing"]  # never placed
    result = driver.run()
    assert result.status == "finished" and len(ScriptedGroup.instances) == 1  # no stop, no shrink
    (group,) = ScriptedGroup.instances
    assert "cancel_move" in group.calls and not any(c.startswith("stop(") for c in group.calls)
    (failed,) = [e for e in driver.events.records() if e["event"] == "slow_rank_move_failed"]
    assert failed["ranks"] == [1] and "no room on another node" in failed["reason"]

    driver, _ = make({0: ["busy"] * 8}, ["training.epochs=2"], group_cls=SlowOne)  # the default: report
    driver.run()
    assert not any(c.startswith("prepare_move") for c in ScriptedGroup.instances[0].calls)
    assert "slow_rank" in kinds(driver)


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
