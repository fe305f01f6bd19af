"""The scripted worker group at 1,000 ranks (no processes), shared by the driver's scale test and
``benchmarks/bench_driver_scale.py``: a failure storm of ``DEAD`` ranks, a slow rank ``SLOW``, and the
driver's CPU per heartbeat round."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection
from typing import Any

from cluster.core.errors import Failure
from cluster.driver.driver import Driver
from cluster.driver.policy import HangWatch, SlowRankWatch
from cluster.seam.peers import PeerState
from cluster.seam.protocol import EpochResult, Heartbeat, Pace, Salvage
from tests.support.fakes import STEPS, ScriptedGroup, make

N, DEAD, SLOW = 1000, 50, 7
EVEN, BEHIND = Pace(0.010, 0.021, 5), Pace(0.020, 0.021, 5)  # rank SLOW's own part takes twice the others'


class BigGroup(ScriptedGroup):
    """The scripted group at scale: its replies are built once per epoch, so that what is measured is the
    driver's work, not the script's. A storm kills ``DEAD`` ranks at once; capacity follows."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._beats: list[Heartbeat | None] = []
        self._results: list[EpochResult] = []

    def run_epoch(self, epoch: int, start_step: int, evaluate_first: bool = False, seq: int = 0) -> None:
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

    def salvage(
        self,
        failure: Failure | None,
        attempt: int,
        *,
        leaving: Collection[int] = (),
        keep_state: bool | None = None,
    ) -> Salvage | None:
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
    driver.moves.slow = SlowRankWatch(2.5)  # measured, never reporting: its cost is the same either way
    t0 = time.process_time()
    for _ in range(rounds):
        beats = driver._beats()
        watch.update(beats)
        driver.moves.pace(beats, 0, driver.attempt, may_move=False, world_size=n)
    return (time.process_time() - t0) / rounds
