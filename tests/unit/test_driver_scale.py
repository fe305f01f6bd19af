"""The driver at 1,000 ranks, through the scripted worker group (no processes): epochs, heartbeats, a
failure storm of 50 ranks handled as one incident, a shrink and a grow back; and its cost per rank, which
must grow linearly in N (benchmarks/bench_driver_scale.py states the figures)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from cluster.driver import Driver
from cluster.errors import Failure
from cluster.group import EpochResult, Heartbeat, Salvage
from cluster.pace import Pace
from cluster.peer import PeerState
from cluster.policy import HangWatch, SlowRankWatch
from tests.unit.test_driver import STEPS, ScriptedGroup, kinds, make

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

N, DEAD, SLOW = 1000, 50, 7
EVEN, BEHIND = Pace(0.010, 0.021, 5), Pace(0.020, 0.021, 5)  # rank SLOW's own part takes twice the others'


class BigGroup(ScriptedGroup):
    """The scripted group at scale: its replies are built once per epoch, so that what is measured is the
    driver's work, not the script's. A storm kills ``DEAD`` ranks at once; capacity follows."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._beats: list[Heartbeat | None] = []
        self._results: list[EpochResult] = []

    def run_epoch(self, epoch: int, start_step: int, evaluate_first: bool = False) -> None:
        super().run_epoch(epoch, start_step)
        step = epoch * STEPS + 1
        self._beats = [
            Heartbeat(r, step, 0.0, 0.01, True, pace=BEHIND if r == SLOW else EVEN)
            for r in range(self.world_size)
        ]
        self._results = []

    def heartbeats(self, timeout: float = 2.0) -> list[Heartbeat | None]:
        return self._beats

    def poll(self, timeout: float) -> list[EpochResult] | None:
        if self.script and self.script[0] == "grow":  # resources come back during this epoch
            self.script.pop(0)
            self.capacity[0] = self.cfg.scaling.num_workers
        return super().poll(timeout)

    def salvage(self, failure: Failure, attempt: int) -> Salvage | None:
        """A node-sized wave: ranks 1..DEAD died together; the other survivors are kept with their state,
        and the capacity left is what the dead ranks did not hold."""
        self.capacity[0] = self.world_size - DEAD
        state = PeerState(0, self.epoch * STEPS + 2, self.epoch, 2, "d", 8)
        alive = [r for r in range(self.world_size) if not 1 <= r <= DEAD]
        survivors = {r: dataclasses.replace(state, rank=r) for r in alive}
        return Salvage(resources="pg", actors=dict.fromkeys(survivors, "actor"), peers=survivors, rows=[])


def big_driver(script: dict[int, list[Any]], n: int = N) -> Driver:
    driver, _ = make(
        script,
        [
            f"scaling.num_workers={n}",
            f"scaling.min_workers={max(1, n - DEAD - 50)}",
            f"training.global_batch_size={8 * n}",
            "training.epochs=4",
            "failures.max_failures=1",  # a storm counted more than once would fail the job
        ],
        capacity=n,
        resume={2: 2 * STEPS},  # growing back restarts from epoch 1's end checkpoint
        group_cls=BigGroup,
    )
    return driver


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


def cpu_per_round(n: int, rounds: int = 100) -> float:
    """Driver CPU seconds of one heartbeat round (collect the beats, update the hang watch and the slow-rank
    watch) at ``n`` ranks."""
    driver = big_driver({}, n)
    driver._prepare_storage()
    group = BigGroup(driver.cfg, driver.run_url, 0, {}, [n], {})
    group.reserve([n], 1.0)
    group.start(n)
    group.run_epoch(0, 0)
    driver.group = group
    watch = HangWatch(driver.cfg.failures, 0)
    driver._slow = SlowRankWatch(2.5)  # measured, never reporting: its cost is the same either way
    t0 = time.process_time()
    for _ in range(rounds):
        beats = driver._beats()
        watch.update(beats)
        driver._watch_pace(beats, 0)
    return (time.process_time() - t0) / rounds


def test_heartbeat_round_cost_is_linear_in_ranks() -> None:
    """O(N) per round (the slow-rank watch's sort: O(N log N)), not O(N^2): 10x the ranks costs about 10x,
    far from 100x. (A loose bound on a
    ratio measured in one process, not a timing target.)"""
    cpu_per_round(100)  # warm up
    small = min(cpu_per_round(100) for _ in range(3))
    large = min(cpu_per_round(1000) for _ in range(3))
    assert large / small < 30, (small, large)
