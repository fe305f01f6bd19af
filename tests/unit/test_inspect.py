"""The event arithmetic behind `python -m cluster list/show`, on hand-written event logs."""

from __future__ import annotations

import pytest

from cluster.inspect import (
    FAILED,
    FINISHED,
    STOPPED,
    UNFINISHED,
    count_attempts,
    failure_records,
    flatten,
    preemption_records,
    run_status,
    slow_rank_records,
)

pytestmark = pytest.mark.timeout(60)


def ev(event: str, **fields: object) -> dict[str, object]:
    return {"time": 0.0, "event": event, **fields}


CRASHED_THEN_FINISHED = [
    ev("run_start", attempt=0),
    ev("group_started", attempt=0),
    ev("failure", kind="worker_died", rank=1, attempt=0, step=12, message="rank 1's process died\ndetails"),
    ev("decision", restart=True, reason="restart 1/3", delay_s=1.0),
    ev("group_started", attempt=1),
    ev("recovered", kind="worker_died", lost_steps=2, detect_to_first_step_s=3.5, spare="preparing"),
    ev("failure", kind="user_error", rank=0, attempt=1, step=20, message="RuntimeError: boom"),
    ev("decision", restart=False, reason="the same RuntimeError happened twice at step 20"),
    ev("run_failed", error="..."),
    ev("run_start", attempt=0),  # resubmitted
    ev("group_started", attempt=0),
    ev("finished", global_step=40, attempts=1),
]


def test_status_comes_from_the_last_submission() -> None:
    assert run_status(CRASHED_THEN_FINISHED) == FINISHED
    assert run_status(CRASHED_THEN_FINISHED[:9]) == FAILED
    assert run_status(CRASHED_THEN_FINISHED[:11]) == UNFINISHED  # resubmitted after failing, not done yet
    assert run_status([]) == UNFINISHED
    assert run_status([ev("run_start"), ev("already_complete", global_step=3)]) == FINISHED
    stopped = [ev("run_start"), ev("stop_requested", reason="SIGINT"), ev("stopped", global_step=7)]
    assert run_status(stopped) == STOPPED
    assert run_status([*stopped, ev("run_start")]) == UNFINISHED  # resubmitted: training again


def test_attempts_add_up_over_submissions() -> None:
    assert count_attempts(CRASHED_THEN_FINISHED) == 3  # attempts 0 and 1, then 0 again
    assert count_attempts(CRASHED_THEN_FINISHED[:2]) == 1
    assert count_attempts([]) == 0


def test_failures_pair_with_their_decision_and_recovery() -> None:
    first, second = failure_records(CRASHED_THEN_FINISHED)
    assert (first.kind, first.rank, first.step, first.attempt) == ("worker_died", 1, 12, 0)
    assert first.message == "rank 1's process died"
    assert (first.decision, first.recovery_s, first.lost_steps) == ("restart", 3.5, 2)
    assert first.spare == "preparing" and second.spare is None  # the hot spare took rank 1's place
    assert second.decision is not None and second.decision.startswith("gave up: the same RuntimeError")
    assert second.recovery_s is None and second.lost_steps is None


def test_flatten_keeps_free_form_mappings_whole() -> None:
    cfg = {
        "training": {"epochs": 3},
        "task_args": {"d_model": 8},
        "storage": {"url": "s3://b", "options": {"key": "***"}},
    }
    assert flatten(cfg) == {
        "training.epochs": 3,
        "task_args": {"d_model": 8},
        "storage.url": "s3://b",
        "storage.options": {"key": "***"},
    }


def test_preemption_notices_pair_with_what_followed() -> None:
    events = [
        ev("preemption_notice", node="aaaa", ranks=[1], seconds_left=20.0),
        ev("group_started", attempt=1),
        ev(
            "preemption_move",
            ranks=[1],
            source="peers",
            stop_step=24,
            lost_steps=0,
            stall_s=0.8,
            seconds_before_deadline=14.2,
        ),
        ev("preemption_notice", node="bbbb", ranks=[0, 1], seconds_left=5.0),
        ev(
            "preemption_checkpoint",
            step=40,
            committed=True,
            reason="the notice leaves 5s",
            seconds_before_deadline=4.1,
        ),
        ev(
            "resize",
            old=2,
            new=1,
            reason="preemption: the notice leaves 5s",
            source="checkpoint",
            stop_step=40,
            lost_steps=0,
            stall_s=2.5,
            seconds_before_deadline=2.0,
        ),
        ev("preemption_notice", node="cccc", ranks=[1], seconds_left=5.0),
        ev("preemption_checkpoint", step=60, committed=True, reason="no room", seconds_before_deadline=4.0),
        ev("preemption_notice", node="dddd", ranks=[1], seconds_left=None),
    ]
    moved, shrunk, checkpointed, pending = preemption_records(events)
    assert (moved.action, moved.source, moved.stop_step, moved.lost_steps) == ("moved", "peers", 24, 0)
    assert moved.before_deadline_s == 14.2 and moved.notice_s == 20.0
    assert (shrunk.action, shrunk.source, shrunk.stop_step, shrunk.ranks) == (
        "shrunk",
        "checkpoint",
        40,
        [0, 1],
    )
    assert shrunk.reason == "the notice leaves 5s"
    assert (checkpointed.action, checkpointed.stop_step, checkpointed.lost_steps) == ("checkpointed", 60, 0)
    assert pending.action == "pending" and pending.notice_s is None


def test_slow_ranks_pair_with_the_step_they_kept_pace_again() -> None:
    times = {"compute_ms": 90.0, "others_ms": 50.0}
    events = [
        ev("slow_rank", rank=3, host="gpu-a", step=120, attempt=0, ratio=1.8, **times),
        ev("slow_rank", rank=5, host="gpu-b", step=130, attempt=0, ratio=2.1, **times),
        ev("slow_rank_cleared", rank=3, host="gpu-a", step=400, attempt=0),
        ev("group_started", attempt=1),
        ev("slow_rank", rank=3, host="gpu-c", step=700, attempt=1, ratio=1.6, **times),
    ]
    first, second, third = slow_rank_records(events)
    assert (first.rank, first.host, first.from_step, first.to_step) == (3, "gpu-a", 120, 400)
    assert first.ratio == 1.8 and first.compute_ms == 90.0
    assert (second.rank, second.to_step) == (5, None)  # slow until its group ended
    assert (third.attempt, third.rank, third.to_step) == (1, 3, None)  # attempt 0's clear is not its own


def test_a_rollback_reads_as_one_line_in_watch_and_in_a_notification() -> None:
    from cluster.core.events import line
    from cluster.inspect import WATCHED, event_line

    e = {"event": "rollback", "window": [5, 7], "skipped": [6, 7], "checkpoint_step": 5, "discarded": [6]}
    want = (
        "rollback after a loss that was not finite: to checkpoint step 5, steps 6-7 skipped, deleted "
        "checkpoints [6]"
    )
    assert event_line(e) == line("rollback", e) == want  # a notification is "[run] " + line
    assert "rollback" in WATCHED
    fresh = {**e, "checkpoint_step": None, "discarded": [], "skipped": [1, 3]}
    assert (
        event_line(fresh)
        == "rollback after a loss that was not finite: to the run's start, steps 1-3 skipped"
    )


def test_the_final_path_leaves_out_rows_the_run_went_back_past() -> None:
    from cluster.inspect import final_path

    def row(step: int, t: float, kind: str = "step") -> dict[str, object]:
        return {"kind": kind, "global_step": step, "time": t}

    rows = [row(s, s) for s in range(1, 9)]  # first path: steps 1-8 at times 1-8
    rows += [row(6, 11), row(7, 12)]  # a recovery from checkpoint 5 replayed 6-7 (then the group failed)
    rows += [row(4, 21), row(5, 22), row(6, 23), row(4, 23.5, "eval")]  # rewound to 3 at time 20
    events = [
        ev("group_started", resume_step=0, time=0.5),
        ev("group_started", resume_step=5, time=10),
        ev("rewound", to_step=3, time=20),
        ev("group_started", resume_step=3, time=20.5),
    ]
    kept = final_path(rows, events)
    assert [(r["global_step"], r["time"]) for r in kept] == [
        (1, 1),
        (2, 2),
        (3, 3),
        (4, 21),
        (4, 23.5),
        (5, 22),
        (6, 23),
    ]
    assert final_path(rows[:3], []) == rows[:3]  # no restarts: every row


def test_rows_written_beside_commits_fill_only_the_steps_the_driver_wrote_no_row_for() -> None:
    from cluster.inspect import final_path

    def row(step: int, seq: int, copy: bool = False, kind: str = "step") -> dict[str, object]:
        return {
            "kind": kind,
            "global_step": step,
            "time": float(step),
            "_seq": seq,
            "_copy": copy,
            "src": copy,
        }

    events = [ev("group_started", resume_step=0), ev("x"), ev("group_started", resume_step=4), ev("x")]
    rows = [row(s, 1) for s in (1, 2)]  # the driver flushed 1-2, then died
    rows += [row(s, 1, copy=True) for s in (1, 2, 3, 4)]  # rank 0's commit at 4 wrote 1-4 beside it
    rows += [row(s, 1, copy=True) for s in (5, 6)]  # a commit at 6 the next driver went back past
    rows += [row(s, 3) for s in (5, 6, 7)]  # the resubmission resumed from 4
    kept = final_path(rows, events)
    assert [(r["global_step"], r["src"]) for r in kept] == [
        (1, False),
        (2, False),
        (3, True),
        (4, True),
        (5, False),
        (6, False),
        (7, False),
    ]


def test_show_says_where_ranks_a_previous_driver_left_were_adopted_or_why_not() -> None:
    from cluster.inspect.render import _events_section

    adopted = ev("adopted", ranks=2, step=212, from_generation=1, pids=[7, 8])
    refused = ev("adoption_refused", why="1 of 2 ranks did not answer (gone or stuck)", from_generation=2)
    lines = _events_section([adopted, refused])
    assert lines[0].endswith("adopted 2 ranks at step 212 from the previous driver"), lines
    assert lines[1].endswith(
        "the previous driver's ranks were not adopted (1 of 2 ranks did not answer (gone or stuck)): "
        "resuming from storage"
    ), lines
