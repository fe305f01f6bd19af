"""The driver's moves through the scripted group: drain notices, slow ranks moved off their node, shrinking
and growing back (cluster.driver.moves decides, the driver carries it out)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import pytest

from cluster.core.errors import Failure
from cluster.seam.peers import PeerPlan
from cluster.seam.preemption import DrainNotice
from cluster.seam.protocol import Heartbeat, SetupInfo
from cluster.spec.config import JobConfig
from tests.support.fakes import STEPS, ScriptedGroup, kinds, make, transitions

pytestmark = pytest.mark.timeout(30)


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


def test_growing_back_is_a_transition_of_its_own(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="cluster.driver.driver")
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


class SlowOne(ScriptedGroup):
    """Rank 1's own part of each step is 3x the others' in every heartbeat; setup reports a node per rank."""

    def heartbeats(self, timeout: float = 2.0) -> list[Heartbeat | None]:
        from cluster.seam.protocol import Pace

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


class EndsFirst(SlowOne):
    """The stop lands past the epoch's end (the ranks were at its last steps when asked to hold, as on a
    loaded machine): the epoch ends whole first, and the group stops there (``Worker.stop_at``)."""

    def stop(self, checkpoint: bool) -> int:
        self.calls.append(f"stop(checkpoint={checkpoint})")
        return (self.epoch + 1) * STEPS + 1  # one step past the epoch's end; poll returns the whole epoch

    def salvage(self, failure: Failure | None, attempt: int, **kw: Any) -> Any:
        self.stop_step = (self.epoch + 1) * STEPS  # the survivors' state: where the epoch ended
        return super().salvage(failure, attempt, **kw)


def test_a_move_whose_stop_falls_past_the_epoch_end_loses_no_step() -> None:
    """The group stopped at the epoch's end, one step before the stop step it was given: the replacement
    resumes there and nothing was lost (the event once said 1 lost step: the stop step, never reached,
    counted as trained)."""
    driver, _ = make(
        {0: ["busy"] * 8}, ["training.epochs=2", "failures.slow_rank_action=move"], group_cls=EndsFirst
    )
    ScriptedGroup.move_script = ["placing", "preparing", "ready"]
    result = driver.run()
    assert result.status == "finished" and not result.failures
    (moved,) = [e for e in driver.events.records() if e["event"] == "slow_rank_moved"]
    assert moved["stop_step"] == moved["resume_step"] == STEPS, moved
    assert moved["lost_steps"] == 0, moved


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
