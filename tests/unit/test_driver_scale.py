"""The driver at 1,000 ranks, through the scripted worker group (no processes): epochs, heartbeats, a
failure storm of 50 ranks handled as one incident, a shrink and a grow back; and its cost per rank, which
must grow linearly in N (benchmarks/bench_driver_scale.py states the figures)."""

from __future__ import annotations

import pytest

from cluster.core.errors import Failure
from tests.support.fakes import STEPS, ScriptedGroup, kinds
from tests.support.scale import DEAD, SLOW, N, big_driver, cpu_per_round

pytestmark = pytest.mark.timeout(120)


def test_thousand_ranks_epochs_heartbeats_storm_and_resize() -> None:
    storm = Failure("worker_died", 1, "worker_died:ranks 1-50 died with their node")
    busy = ["busy"] * 25  # heartbeat rounds while an epoch runs
    driver = big_driver({0: [*busy, "ok", *busy, storm], 1: [*busy, "grow", "ok"]})
    result = driver.run()
    assert result.status == "finished" and result.world_size == N
    assert len(result.failures) == 1  # one incident, one failure against max_failures=1
    ev = driver.events.records()
    names = kinds(driver)
    assert names.count("failure") == 1 and names.count("decision") == 1 and names.count("recovered") == 1
    decision = next(e for e in ev if e["event"] == "decision")
    assert decision["source"] == "peers" and decision["peer_step"] == STEPS + 2
    resizes = [(e["old"], e["new"]) for e in ev if e["event"] == "resize"]
    assert resizes == [(N, N - DEAD), (N - DEAD, N)]
    sizes = [e["world_size"] for e in ev if e["event"] == "group_started"]
    assert sizes == [N, N - DEAD, N]
    assert [e["epoch"] for e in ev if e["event"] == "epoch_end"] == [0, 1, 2, 3]
    second = ScriptedGroup.instances[1]
    assert second.adopted.peers is not None and len(second.adopted.peers) == N - DEAD
    assert second.calls[0] == "epoch1@2"  # resumed from the survivors' step, not from epoch 1's start
    slow = [e for e in ev if e["event"] == "slow_rank"]
    assert slow and {e["rank"] for e in slow} == {SLOW}, slow  # found among 1,000, and only it
    assert slow[0]["ratio"] == 2.0


def test_heartbeat_round_cost_is_linear_in_ranks() -> None:
    """O(N) per round (the slow-rank watch's sort: O(N log N)), not O(N^2): 10x the ranks costs about 10x,
    far from 100x. (A loose bound on a
    ratio measured in one process, not a timing target.)"""
    cpu_per_round(100)  # warm up
    small = min(cpu_per_round(100) for _ in range(3))
    large = min(cpu_per_round(1000) for _ in range(3))
    assert large / small < 30, (small, large)
