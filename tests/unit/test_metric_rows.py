"""Step rows reach storage while an epoch trains (``metrics.flush_s``), a torn metrics file costs only its own
rows, and no reader drops rows because two machines' clocks differ."""

from __future__ import annotations

import time
from typing import Any

import pytest

from cluster.inspect import run_metrics
from cluster.run.logs import EventLog, read_metrics, write_metrics
from cluster.run.storage import Storage
from cluster.seam.protocol import EpochResult, Heartbeat
from tests.support.fakes import STEPS, ScriptedGroup, make

pytestmark = [pytest.mark.timeout(60)]


class StreamingGroup(ScriptedGroup):
    """Rank 0's heartbeats stream one step row each (as real workers do); each poll while the epoch runs
    notes how many step rows storage holds already."""

    seen_on_storage: list[int] = []
    run: Storage | None = None

    def heartbeats(self, timeout: float = 2.0) -> list[Heartbeat | None]:
        self.beat_step = getattr(self, "beat_step", self.epoch * STEPS) + 1
        row = {"time": time.time(), "global_step": self.beat_step, "epoch": self.epoch, "loss": 1.0}
        beats = super().heartbeats(timeout)
        beats[0] = Heartbeat(0, self.beat_step, 0.0, 0.01, True, rows=[row])
        return beats

    def poll(self, timeout: float) -> list[EpochResult] | None:
        assert StreamingGroup.run is not None
        found = read_metrics(StreamingGroup.run).to_pylist()
        StreamingGroup.seen_on_storage.append(sum(1 for r in found if r["kind"] == "step"))
        return super().poll(timeout)


@pytest.mark.parametrize(("flush_s", "mid_epoch"), [(0.0, True), (3600.0, False)])
def test_step_rows_reach_storage_while_the_epoch_trains(flush_s: float, mid_epoch: bool) -> None:
    """With ``metrics.flush_s=0`` each heartbeat's rows are on storage at once (a driver killed now loses
    none); with an hour, none are before the epoch's end (today's behaviour, bounded by the setting)."""
    StreamingGroup.seen_on_storage = []
    driver, _ = make(
        {0: ["busy", "busy", "busy", "ok"]},
        ["training.epochs=1", f"metrics.flush_s={flush_s}"],
        group_cls=StreamingGroup,
    )
    StreamingGroup.run = driver.storage
    assert driver.run().status == "finished"
    during = StreamingGroup.seen_on_storage[1:-1]  # polls after a heartbeat, before the epoch's result
    assert (max(during) > 0) is mid_epoch, during
    steps = [r["global_step"] for r in read_metrics(driver.storage).to_pylist() if r["kind"] == "step"]
    assert sorted(steps) == sorted(set(steps)) and steps  # each streamed row written once


def test_a_torn_metrics_file_costs_only_its_own_rows(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    run = Storage(str(tmp_path / "run"))
    events = EventLog(run)
    events.append("run_start", attempt=0)
    write_metrics(run, [_row(1, 0.0), _row(2, 0.1)], 0, 0, seq=events.count)
    run.write_bytes("metrics/steps-e00000-a000-s000000001-99.parquet", b"PAR1 torn by a crash")
    assert [r["global_step"] for r in read_metrics(run).to_pylist()] == [1, 2]
    assert "does not read as Parquet" in caplog.text and "s000000001-99" in caplog.text
    assert run_metrics(run.root).num_rows == 2


def test_rows_of_a_rank_whose_clock_is_behind_the_driver_s_are_kept(tmp_path: Any) -> None:
    """A failure at step 6, a recovery from step 4: rank 0 of the new group timestamps its rows 30 s behind
    the driver's clock, so they look older than the ``group_started`` that began them. Placed by where their
    file sits among the events (not by time), steps 5-6 of the new group are kept and the old group's 5-6
    are not."""
    run = Storage(str(tmp_path / "run"))
    events = EventLog(run)
    t = time.time()
    events.append("group_started", resume_step=0)
    old = [_row(g, t + g, loss=9.0) for g in range(1, 7)]
    events.append("failure", kind="worker_died")
    write_metrics(run, old, 0, 0, seq=events.count)  # flushed after the failure
    events.append("group_started", resume_step=4)
    new = [_row(g, t + g - 30.0, loss=1.0) for g in (5, 6, 7)]  # 30 s behind
    write_metrics(run, new, 0, 1, seq=events.count)
    kept = run_metrics(run.root).to_pylist()
    assert [(r["global_step"], r["loss"]) for r in kept] == [
        (1, 9.0),
        (2, 9.0),
        (3, 9.0),
        (4, 9.0),
        (5, 1.0),
        (6, 1.0),
        (7, 1.0),
    ]


def _row(step: int, t: float, loss: float = 1.0) -> dict[str, Any]:
    return {"kind": "step", "time": t, "global_step": step, "epoch": 0, "loss": loss}
