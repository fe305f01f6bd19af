"""A new group's automatic hang timeout starts from the run's history (``cluster.driver.policy``:
``HangHistory``, ``HangMemory``; read back by ``cluster.run.history``): warm only after the group's own first
step, never longer than its warm-up's timeout before it is warm, and nothing changes without a warm history
or with a timeout the user set. On an injected clock."""

from __future__ import annotations

import dataclasses
import io
import logging
import time
from pathlib import Path

import pytest

from cluster.driver.driver import Driver
from cluster.driver.policy import HangHistory, HangMemory, HangStats, HangWatch, past_stats
from cluster.run.checkpoint import CommitRecord
from cluster.run.history import PastGroup, newest_files, read_past_groups, same_shape
from cluster.run.logs import read_event_log
from cluster.run.storage import Storage
from cluster.seam.protocol import EpochResult
from cluster.spec.config import JobConfig
from cluster.spec.load import load_config
from tests.support.fakes import ScriptedGroup, make
from tests.unit.test_hang import Clock, beats

pytestmark = pytest.mark.timeout(60)

HISTORY = HangHistory(0.3, 0.5, "submission 1 attempt 0")
FIXTURE = Path(__file__).parents[1] / "fixtures" / "runs_before_layers" / "before-layers"


def watch_at(start: int, history: HangHistory | None, overrides: tuple[str, ...] = ()) -> HangWatch:
    cfg = load_config(overrides=["failures.hang_warmup_steps=20", *overrides]).failures
    stats = HangStats(start, 20, checkpoint_expected=True, history=history)
    return HangWatch(cfg, start, stats, clock=Clock())


def test_a_warm_history_makes_a_new_group_warm_only_after_its_own_first_step() -> None:
    watch = watch_at(100, HISTORY)
    clock = watch._clock
    assert isinstance(clock, Clock)
    assert watch.timeout_and_source() == (60, "warm-up")  # before its first step: the floor
    clock.t += 30
    assert watch.update(beats(100, first_s=0.0)) is None  # set-up, loading: still no step
    assert watch.timeout() == 60
    clock.t += 25  # the first step took 55 s (compilation): not a hang
    assert watch.update(beats(101, first_s=55.0)) is None
    limit, source = watch.timeout_and_source()
    assert limit == 10 and source == "history (submission 1 attempt 0)"  # max(10 s, 10 x 0.3 s, 3 x 0.5 s)
    clock.t += 10.5
    hung = watch.update(beats(101))
    assert hung is not None and "hang timeout 10s: history (submission 1 attempt 0)" in hung[1]


def test_without_its_first_step_the_floor_holds_for_a_silent_rank_too() -> None:
    watch = watch_at(100, HISTORY)
    clock = watch._clock
    assert isinstance(clock, Clock)
    clock.t += 59
    assert watch.update([None, None]) is None  # no rank answered yet: the floor, as without a history
    clock.t += 2
    hung = watch.update([None, None])
    assert hung is not None and "within 60s" in hung[1]


def test_the_history_never_lengthens_the_warm_up_and_counts_with_the_group_once_warm() -> None:
    slow = HangHistory(0.3, 30.0, "submission 1 attempt 0")  # 3 x a 30 s stall: 90 s, above the floor
    watch = watch_at(0, slow)
    watch.update(beats(1))
    assert watch.timeout_and_source() == (60, "warm-up")  # the history only ever shortens it
    # warm by its own steps: 20 steps and a checkpoint (a 0.5 s stall, 0.2 s steps)
    watch.update(beats(21, rows=[{"global_step": 21, "step_time_s": 0.2, "checkpoint_stall_s": 0.5}]))
    assert watch.timeout_and_source() == (90, "warm + history (submission 1 attempt 0)")
    # a history faster than the group: the group's own
    fast = watch_at(0, HangHistory(0.01, 0.01, "x"))
    fast.update(beats(21, rows=[{"global_step": 21, "step_time_s": 2.0, "checkpoint_stall_s": 0.5}]))
    assert fast.timeout_and_source() == (20, "warm")
    # before the group is warm, its own warm steps count with the history's
    mixed = watch_at(0, HangHistory(0.3, 0.5, "x"))
    mixed.stats.warm_step_time = 1.5
    mixed.update(beats(1))
    assert mixed.timeout_and_source() == (15, "history (x)")


def test_a_timeout_the_user_set_is_kept_whatever_the_history() -> None:
    watch = watch_at(0, HISTORY, ("failures.hang_timeout_s=45",))
    watch.update(beats(1))
    assert watch.timeout_and_source() == (45, "failures.hang_timeout_s")
    watch.update(beats(25, rows=[{"global_step": 25, "step_time_s": 0.2, "checkpoint_stall_s": 0.5}]))
    assert watch.timeout() == 45


def past(
    world_size: int = 2, steps: int = 40, stalls: tuple[float, ...] = (0.4,), step_s: float = 0.3
) -> PastGroup:
    rows = [
        {"kind": "step", "global_step": g, "step_time_s": step_s, "checkpoint_stall_s": 0.0}
        for g in range(1, steps + 1)
    ]
    return PastGroup(1, 0, 0, world_size, {}, rows, list(stalls), steps)


def memory(groups: list[PastGroup], warmup: int = 20, expected: bool = True) -> HangMemory:
    cfg = load_config(overrides=[f"failures.hang_warmup_steps={warmup}"]).failures
    return HangMemory(cfg, expected, lambda: groups)


@pytest.mark.parametrize(
    "group",
    [
        past(steps=15),  # fewer steps than its warm-up
        past(stalls=()),  # no checkpoint, and checkpoints are on
        past(world_size=4),  # another world size
    ],
)
def test_a_history_that_is_not_warm_changes_nothing(group: PastGroup) -> None:
    mem = memory([group])
    assert mem.history(2) is None
    stats = HangStats(0, 20, checkpoint_expected=True)
    mem.seed(stats, 2)  # before the first step: not even looked for
    assert not stats.history_asked
    stats.max_step = 1
    mem.seed(stats, 2)
    assert stats.history_asked and stats.history is None
    cfg = load_config(overrides=["failures.hang_warmup_steps=20"]).failures
    with_memory = HangWatch(cfg, 0, stats, clock=Clock())
    without = HangWatch(cfg, 0, HangStats(0, 20, True, max_step=1), clock=Clock())
    for step in (1, 5, 21):
        for w in (with_memory, without):
            w.update(beats(step, first_s=4.0))
        assert with_memory.timeout_and_source() == without.timeout_and_source()


def test_without_checkpoints_a_history_is_warm_after_its_warm_up_steps() -> None:
    history = memory([past(stalls=())], expected=False).history(2)
    assert history is not None and history.warm_step_time == 0.3 and history.max_stall == 0.0


def test_the_memory_reads_once_keeps_this_driver_s_warm_groups_and_survives_a_failed_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = []

    def failing() -> list[PastGroup]:
        calls.append(1)
        raise OSError("storage down")

    cfg = load_config(overrides=["failures.hang_warmup_steps=20"]).failures
    mem = HangMemory(cfg, True, failing)
    with caplog.at_level(logging.WARNING):
        assert mem.history(2) is None  # no history: the warm-up as without one
    assert "could not be read" in caplog.text
    assert mem.history(2) is None and calls == [1]  # read once
    own = HangStats(
        0, 20, True, max_step=30, warm_step_time=0.25, max_stall=0.7, checkpoints=1, history=HISTORY
    )
    mem.remember(2, own)
    mem.remember(2, HangStats(30, 20, True, max_step=31))  # not warm: left out
    h = mem.history(2)
    assert h is not None and (h.warm_step_time, h.max_stall) == (0.25, 0.7)  # its own, not what it was lent
    assert h.source == "this job's steps 0-30" and mem.history(4) is None


def test_a_past_group_is_judged_as_the_hang_watch_judged_it() -> None:
    g = past(steps=40, stalls=(0.4, 0.9))
    g.rows[5]["step_time_s"] = 7.0  # step 6: in the warm-up, left out
    g.rows[30]["step_time_s"] = 0.8  # step 31: after it
    st = past_stats(g, 20, True)
    assert st.warm() and st.warm_step_time == 0.8 and st.max_stall == 0.9 and st.checkpoints == 2


def test_only_a_config_of_the_same_shape_lends_its_history() -> None:
    cfg = load_config().to_dict()
    assert same_shape(cfg, cfg)
    longer = {**cfg, "training": {**cfg["training"], "epochs": 9}, "failures": {"max_failures": 7}}
    assert same_shape(longer, cfg)  # how long it trains and how it handles failures: same steps
    bigger = {**cfg, "training": {**cfg["training"], "global_batch_size": 512}}
    assert not same_shape(bigger, cfg) and not same_shape(None, cfg)


def test_the_reader_reads_the_old_run_folder() -> None:
    """The committed run of an older version: each group, its rows from the metric files (not the epoch
    rows) and its checkpoints' stalls from the events."""
    storage = Storage(str(FIXTURE))
    groups = read_past_groups(storage, lambda: read_event_log(storage))
    assert len(groups) == 1
    g = groups[0]
    assert (g.submission, g.attempt, g.start_step, g.world_size, g.max_step) == (1, 0, 0, 2, 12)
    assert [r["global_step"] for r in g.rows] == [4, 5, 8, 10] and {r["kind"] for r in g.rows} == {"step"}
    assert g.stalls == [0.0006, 0.0171, 0.0004, 0.0004]
    st = past_stats(g, 3, True)
    assert st.warm() and st.warm_step_time == pytest.approx(0.018996475) and st.max_stall == 0.0171
    assert (
        len(read_past_groups(storage, lambda: read_event_log(storage), limit=1)[0].rows) == 2
    )  # newest only


def test_the_newest_files_are_those_of_the_highest_event_count() -> None:
    names = [
        "steps-e00003-a000-s000000010-111.parquet",
        "steps-e00001-a001-s000000040-222.parquet",
        "steps-e00002-a000-s000000040-333.parquet",
        "steps-e00000-a000-1.parquet",  # an older version's: no event count
    ]
    assert [n for _, n in newest_files(names, 2)] == [names[2], names[1]]


class TimedGroup(ScriptedGroup):
    """The scripted group, with rank 0's step rows (0.05 s steps, a 2 s first step) and a checkpoint at each
    epoch's end that stalled training 0.4 s, as real workers report them."""

    def poll(self, timeout: float) -> list[EpochResult] | None:
        results = super().poll(timeout)
        if results:
            head = results[0]
            first = head.global_step - head.steps
            head.step_rows = [
                {
                    "time": time.time(),
                    "global_step": g,
                    "epoch": self.epoch,
                    "loss": 1.0,
                    "attempt": self.attempt,
                    "world_size": self.world_size,
                    "step_time_s": 2.0 if g == 1 else 0.05,
                    "checkpoint_stall_s": 0.4 if g == head.global_step else 0.0,
                }
                for g in range(first + 1, head.global_step + 1)
            ]
            head.commits = [CommitRecord(head.global_step, self.epoch + 1, "u", 10, 0.4, 0.1)]
        return results


def resubmit(cfg: JobConfig) -> Driver:
    ScriptedGroup.instances = []
    return Driver(
        cfg,
        group_factory=lambda c, u, a: ScriptedGroup(c, u, a, {0: ["busy"]}, [2], {}),
        out=io.StringIO(),
        poll_s=0.0,
    )


def test_a_resubmission_starts_from_what_the_run_folder_recorded_of_the_first() -> None:
    """A run folder written by the current driver (its events and metric files); the next submission of the
    run reads its groups back and its first group is warm after its first step."""
    driver, _ = make({}, ["failures.hang_warmup_steps=2"], group_cls=TimedGroup)
    driver.run()
    groups = read_past_groups(driver.storage, driver.events.records, driver.cfg.to_dict())
    assert [(g.submission, g.attempt, g.start_step, g.world_size, g.max_step) for g in groups] == [
        (1, 0, 0, 2, 12)
    ]
    assert len(groups[0].rows) == 12 and groups[0].stalls == [0.4, 0.4, 0.4]
    other = dataclasses.replace(
        driver.cfg, training=dataclasses.replace(driver.cfg.training, global_batch_size=8)
    )
    assert read_past_groups(driver.storage, driver.events.records, other.to_dict()) == []

    second = resubmit(driver.cfg)
    second.run()
    stats = second._hang_stats
    assert stats.history == HangHistory(0.05, 0.4, "submission 1 attempt 0")
    assert stats.stepped() and not stats.warm()
    assert HangWatch(second.cfg.failures, 1, stats).timeout_and_source() == (
        10,
        "history (submission 1 attempt 0)",
    )
