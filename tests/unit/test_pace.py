"""A rank's pace (``StepPace``: its own part of each step, before it waits for its peers) and the driver's
judgement of it (``SlowRankWatch``), without processes. The real-DDP check is in
tests/multiprocess/test_pace.py, the end-to-end one in tests/ray/test_faults.py."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from cluster.driver.policy import SLOW_ROUNDS, SlowRankWatch
from cluster.rank.pace import KEEP_HOOKS, StepPace
from cluster.seam.protocol import Heartbeat, Pace
from cluster.spec.config import ConfigError
from cluster.spec.load import load_config

pytestmark = pytest.mark.timeout(30)


def beats(*compute_ms: float | None, input_ms: dict[int, float] | None = None) -> list[Heartbeat | None]:
    waits = input_ms or {}
    return [
        None
        if ms is None
        else Heartbeat(r, 10, 0.0, 0.1, True, pace=Pace(ms / 1000, 0.1, 8, waits.get(r, 1.0) / 1000))
        for r, ms in enumerate(compute_ms)
    ]


def test_a_rank_slow_for_three_rounds_is_reported_once_and_cleared_after_three_at_pace() -> None:
    watch = SlowRankWatch(1.5)
    for _ in range(SLOW_ROUNDS - 1):
        assert watch.update(beats(40, 41, 90, 39)) == ([], [])
    became, cleared = watch.update(beats(40, 41, 90, 39))
    assert [(r.rank, round(r.ratio, 2), r.others_s) for r in became] == [(2, 2.25, 0.040)] and not cleared
    assert watch.update(beats(40, 41, 95, 39)) == ([], [])  # still slow: not reported again
    for _ in range(SLOW_ROUNDS - 1):
        assert watch.update(beats(40, 41, 42, 39)) == ([], [])
    became, cleared = watch.update(beats(40, 41, 42, 39))
    assert not became and [r.rank for r in cleared] == [2]
    assert not watch.slow


def test_a_slow_rank_s_report_says_whether_its_input_or_its_compute_is_slow() -> None:
    from cluster.core.events import console_line
    from cluster.driver.record import RunRecord

    for input_ms, cause in ((55.0, "its input pipeline"), (3.0, "its forward and backward")):
        watch = SlowRankWatch(1.5)
        for _ in range(SLOW_ROUNDS):
            became, _ = watch.update(beats(40, 95, 41, input_ms={0: 2.0, 1: input_ms, 2: 4.0}))
        (r,) = became
        assert (r.rank, r.input_s, r.others_input_s) == (1, input_ms / 1000, 0.003)  # the others' median
        report = RunRecord.slow_report(r, "h", 7, 0)
        assert cause in str(console_line("slow_rank", report))


def test_a_streak_broken_by_one_round_at_pace_starts_again() -> None:
    watch = SlowRankWatch(1.5)
    pattern = [90] * (SLOW_ROUNDS - 1) + [40]
    for ms in pattern * 3:
        assert watch.update(beats(40, ms)) == ([], [])


def test_two_ranks_compare_with_each_other_and_tiny_steps_need_a_real_gap() -> None:
    watch = SlowRankWatch(1.5)
    for _ in range(SLOW_ROUNDS):
        became, _ = watch.update(beats(10, 30))
    assert [r.rank for r in became] == [1]  # with two ranks, the other one is the baseline
    tiny = SlowRankWatch(1.5)
    for _ in range(SLOW_ROUNDS + 2):  # 3x, but 1 ms apart: timer noise on a tiny step, not a slow rank
        assert tiny.update(beats(0.5, 1.5, 0.5)) == ([], [])


def test_ranks_without_a_pace_are_left_out_and_a_lone_rank_has_no_baseline() -> None:
    watch = SlowRankWatch(1.5)
    for _ in range(SLOW_ROUNDS):
        became, _ = watch.update(beats(None, 40, None, 90, 41))
    assert [r.rank for r in became] == [3]
    lone = SlowRankWatch(1.5)
    for _ in range(SLOW_ROUNDS + 1):
        assert lone.update(beats(None, 90)) == ([], [])


def test_slow_rank_ratio_must_be_above_one_or_null() -> None:
    assert load_config(overrides=["failures.slow_rank_ratio=null"]).failures.slow_rank_ratio is None
    with pytest.raises(ConfigError, match=r"failures.slow_rank_ratio=1.0 must be above 1"):
        load_config(overrides=["failures.slow_rank_ratio=1.0"])


def _step(model: nn.Module, pace: StepPace, sleep_s: float = 0.0) -> None:
    t0 = time.perf_counter()
    pace.begin()
    time.sleep(sleep_s)  # inside the rank's own part: a slow input fetch
    pace.fetched(sleep_s)
    model(torch.randn(4, 8)).sum().backward()
    time.sleep(0.01)  # after its last gradient: the wait for the peers, not its own part
    pace.end(time.perf_counter() - t0)


def test_step_pace_measures_to_the_last_gradient_and_keeps_few_hooks() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    pace = StepPace()
    pace.attach(model, torch.device("cpu"))
    assert len(pace._handles) == 6  # learning: every parameter
    _step(model, pace)
    assert len(pace._handles) == KEEP_HOOKS  # the ones whose gradients came last
    for _ in range(4):
        _step(model, pace, sleep_s=0.03)
    p = pace.take()
    assert p is not None and p.steps == 5
    assert 0.03 <= p.compute_s < p.step_s - 0.009  # the 10 ms after the last gradient is not its own part
    assert p.input_s == 0.03  # the median step's wait for its batch
    assert pace.take() is None  # taken: the next heartbeat starts a new window


def test_step_pace_learns_again_when_its_hooked_parameters_get_no_gradient() -> None:
    a, b = nn.Linear(8, 8), nn.Linear(8, 2)
    pace = StepPace()
    pace.attach(nn.ModuleList([a, b]), torch.device("cpu"))

    def step(use_a: bool) -> None:
        pace.begin()
        x = torch.randn(2, 8)
        b(a(x) if use_a else x).sum().backward()
        pace.end(0.01)

    step(use_a=True)  # a's gradients come last: its two parameters keep the hooks
    assert len(pace._handles) == KEEP_HOOKS and not pace._learning
    step(use_a=False)  # a unused: no hook fired, no sample; every parameter is hooked again
    assert len(pace._handles) == 4 and pace._learning
    step(use_a=False)  # learned on b's
    assert len(pace._handles) == KEEP_HOOKS and not pace._learning
    step(use_a=False)
    p = pace.take()
    assert p is not None and p.steps == 3
    pace.close()
    assert not pace._handles
