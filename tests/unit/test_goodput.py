"""The goodput ledger's account on an injected clock: each second in one class, the classes adding up to the
wall clock, steps split into productive and recomputed by where the run went back, and a resubmission
continuing the account of a killed driver."""

from __future__ import annotations

import math
from typing import Any

import pytest

from cluster.run.goodput import CLASSES, Goodput, Ledger, classify, goodput_of, ledger_for

pytestmark = pytest.mark.timeout(30)


def adds_up(g: Goodput, wall: float) -> None:
    assert set(g.seconds) == set(CLASSES)
    assert math.isclose(sum(g.seconds.values()), g.wall_s, abs_tol=1e-6)
    assert g.wall_s == pytest.approx(wall)
    assert all(v >= 0 for v in g.seconds.values()), g.seconds


def test_a_run_without_faults_is_waiting_starting_training_and_the_final_flush() -> None:
    led = Ledger(0.0)
    led.reserving(1.0)
    led.reserved(3.0)
    led.started(0, 0)
    led.stall("checkpoint_stall", 0.5)
    led.stall("evaluation", 1.0)
    led.stall("input_stall", 0.25)
    led.ran(first_step_at=5.0, start_step=0, end_step=10, t=15.0)  # steps 2-10 in 10 s (the first: starting)
    led.ran(first_step_at=15.5, start_step=10, end_step=20, t=25.0)  # the next epoch: all training
    led.enter("checkpoint_stall", 25.0)
    led.close(26.0)
    g = led.goodput(26.0)
    adds_up(g, 26.0)
    assert g.seconds["waiting"] == 2.0 and g.seconds["starting"] == 1.0 + 2.0
    assert g.seconds["checkpoint_stall"] == 0.5 + 1.0 and g.seconds["evaluation"] == 1.0
    assert g.seconds["input_stall"] == 0.25
    assert g.seconds["productive"] == pytest.approx(10.0 - 1.75 + 10.0)
    assert g.seconds["recomputed"] == 0.0 and g.steps == {"productive": 19, "recomputed": 0}
    assert g.ettr == pytest.approx(g.seconds["productive"] / 26.0)


def test_a_failure_is_detection_then_recovery_and_the_replayed_steps_are_recomputed() -> None:
    led = Ledger(0.0)
    led.started(0, 0)
    led.ran(1.0, 0, 10, t=11.0)  # steps 2-10 productive (10 s)
    led.progressed(13, 14.0)  # a heartbeat: step 13 done at 14
    led.failed(now=20.0)  # noticed at 20: 11-13 trained (3 s), 6 s detecting
    led.started(1, 10)  # from the checkpoint at 10: 11-13 again
    led.ran(25.0, 10, 20, t=35.0)
    g = led.goodput(35.0)
    adds_up(g, 35.0)
    assert g.seconds["detection"] == 6.0
    assert g.seconds["recovery"] == 5.0  # noticed (20) to the first step of the new group (25)
    assert g.seconds["recomputed"] == 3.0 and g.steps["recomputed"] == 3
    assert g.seconds["productive"] == 10.0 + 10.0
    assert g.attempts["1.0"]["recomputed"] == 3.0 and g.attempts["1.1"]["recovery"] == 5.0


def test_a_recovery_from_peers_recomputes_nothing() -> None:
    led = Ledger(0.0)
    led.started(0, 0)
    led.ran(1.0, 0, 10, t=11.0)
    led.progressed(13, 14.0)
    led.failed(now=15.0)
    led.started(1, 13)  # the survivors held step 13
    led.ran(17.0, 13, 20, t=24.0)
    g = led.goodput(24.0)
    adds_up(g, 24.0)
    assert g.seconds["recomputed"] == 0.0 and g.steps["productive"] == 9 + 3 + 6


def test_a_group_that_fails_before_its_first_epoch_ends_trains_from_its_first_progress() -> None:
    led = Ledger(0.0)
    led.started(0, 0)
    led.progressed(2, 4.0)  # a heartbeat: the group trains (steps 1-2 belong to its start)
    led.progressed(6, 8.0)
    led.failed(now=9.0)
    g = led.goodput(9.0)
    adds_up(g, 9.0)
    assert g.seconds["starting"] == 4.0 and g.seconds["productive"] == 4.0 and g.seconds["detection"] == 1.0


def test_stalls_reported_beyond_the_wall_are_scaled_into_it() -> None:
    led = Ledger(0.0)
    led.started(0, 0)
    led.stall("checkpoint_stall", 30.0)  # more than the stretch's 10 s (clocks of different processes)
    led.ran(0.0, 0, 10, t=10.0)
    g = led.goodput(10.0)
    adds_up(g, 10.0)
    assert g.seconds["checkpoint_stall"] == 10.0


def test_a_resubmission_continues_the_killed_driver_s_account() -> None:
    first = Ledger(0.0)
    first.started(0, 0)
    first.ran(1.0, 0, 20, t=41.0)  # steps 2-20: 40 s
    events: list[dict[str, Any]] = [{"time": 41.0, "event": "epoch_end", "goodput": first.snapshot(41.0)}]
    # killed: its driver.json beat at 51 said step 25; the new job starts at 100 and resumes from 22
    led = ledger_for(100.0, 2, events, {"time": 51.0, "global_step": 25})
    led.started(0, 22)
    led.ran(102.0, 22, 30, t=110.0)
    g = led.goodput(110.0)
    adds_up(g, 110.0)
    assert g.seconds["driver_down"] == 49.0
    assert g.seconds["recomputed"] == pytest.approx(6.0)  # 23-25 of the killed tail (3 of 5 steps of 10 s)
    assert g.seconds["productive"] == pytest.approx(40.0 + 4.0 + 8.0)
    assert g.seconds["recovery"] == 0.0 and g.seconds["starting"] == 1.0 + 2.0
    # read back from the events alone, before the resubmission: as of the last sign of life
    before = goodput_of(events, {"time": 51.0, "global_step": 25})
    assert before is not None
    adds_up(before, 51.0)


def test_an_ended_account_reads_back_as_it_was_written() -> None:
    led = Ledger(0.0)
    led.started(0, 0)
    led.ran(1.0, 0, 10, t=11.0)
    led.close(12.0)
    snap = led.snapshot(12.0, ended=True)
    read = goodput_of([{"time": 12.0, "event": "goodput", **snap}], {"time": 500.0, "global_step": 10})
    assert read is not None and read.to_dict()["seconds"] == Goodput.from_dict(snap).to_dict()["seconds"]
    adds_up(read, 12.0)


def test_classify_counts_a_step_recomputed_once_a_later_start_went_back_below_it() -> None:
    entries = [
        ["s", "1.0", 0, 10, 10.0],
        ["b", 5],
        ["s", "1.1", 5, 12, 7.0],
        ["b", 8],
        ["s", "1.2", 8, 9, 1.0],
    ]
    assert classify(entries) == [
        ("1.0", 5, 5, 5.0, 5.0),
        ("1.1", 3, 4, 3.0, 4.0),
        ("1.2", 1, 0, 1.0, 0.0),
    ]


def test_contiguous_stretches_are_one_entry() -> None:
    led = Ledger(0.0)
    led.started(0, 0)
    for epoch in range(50):
        led.ran(0.5 if epoch == 0 else None, epoch * 10, epoch * 10 + 10, t=float(epoch + 1))
    assert len(led.entries) == 1


def test_a_group_that_fails_before_any_heartbeat_trains_from_its_first_step() -> None:
    led = Ledger(0.0)
    led.started(0, 0)
    led.progressed(6, 8.0, first_at=3.0)  # the survivors' heartbeat after the failure: step 1 done at 3
    led.failed(now=9.0)
    g = led.goodput(9.0)
    adds_up(g, 9.0)
    assert g.seconds["starting"] == 3.0 and g.seconds["productive"] == 5.0 and g.steps["productive"] == 5


def test_skipped_steps_are_neither_kept_nor_recomputed_unless_they_were_trained() -> None:
    led = Ledger(0.0)
    led.started(0, 0)
    led.ran(1.0, 0, 12, t=12.0)  # steps 2-12, with 10-12 trained (the NaN batch among them)
    led.progressed(12, 12.0)
    led.failed(now=12.0)
    led.skips = [(10, 12)]  # the rollback's window, from the next start on
    led.started(1, 8)
    led.ran(13.0, 8, 16, t=20.0)  # 10-12 skipped: steps 10..16 but 9, 13-16 trained after the first
    g = led.goodput(20.0)
    assert g.steps == {"productive": 7 + 4, "recomputed": 4}  # 2-8 and 13-16 kept; 9-12 redone/abandoned


def test_a_driver_killed_before_its_first_epoch_ended_is_accounted_from_its_events() -> None:
    events: list[dict[str, Any]] = [
        {"time": 10.0, "event": "run_start"},
        {"time": 14.0, "event": "group_started", "attempt": 0, "resume_step": 0},
    ]
    led = ledger_for(60.0, 2, events, {"time": 24.0, "global_step": 5})  # its last beat: step 5 at 24
    led.started(0, 5)
    led.ran(61.0, 5, 10, t=66.0)
    g = led.goodput(66.0)
    adds_up(g, 56.0)  # from the first driver's run_start
    assert g.seconds["starting"] == 4.0 + 1.0 and g.seconds["driver_down"] == 36.0
    assert g.steps == {"productive": 5 + 4, "recomputed": 0}


def test_adopted_ranks_steps_trained_while_no_driver_was_there_are_kept_not_lost() -> None:
    """Killed at step 5 (its last beat at 24); its ranks train on with no driver to step 30, where the next
    submission (started at 60) adopts them at 62; they end the epoch at step 40 at 72."""
    events: list[dict[str, Any]] = [
        {"time": 10.0, "event": "run_start"},
        {"time": 14.0, "event": "group_started", "attempt": 0, "resume_step": 0},
    ]
    led = ledger_for(60.0, 2, events, {"time": 24.0, "global_step": 5})
    led.adopted(30, 62.0)
    led.started(0, 30)  # the adopted group: where the ranks stand
    led.progressed(35, 67.0, first_at=15.0)  # a heartbeat: the group's first step was long ago
    led.ran(15.0, 0, 40, t=72.0)  # the epoch they were given, collected
    g = led.goodput(72.0)
    adds_up(g, 62.0)
    assert g.seconds["driver_down"] == 36.0  # the previous driver's last sign of life to this start
    assert g.seconds["starting"] == 4.0 + 2.0  # the first group's start, and this driver's up to adopting
    assert g.seconds["productive"] == pytest.approx(10.0 + 10.0)  # 14-24 and 62-72
    assert g.steps == {"productive": 40, "recomputed": 0}  # 1-5, 6-30 (no driver), 31-40
