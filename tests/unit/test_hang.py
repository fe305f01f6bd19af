"""Telling the hung rank from the ranks waiting for it (``cluster.driver.hang``), and the automatic hang
timeout after warm-up (``cluster.driver.policy.HangWatch``, on an injected clock)."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.core.stacks import Frame, ThreadStack
from cluster.driver.hang import hang_failure, judge, state_of
from cluster.driver.policy import HangStats, HangWatch
from cluster.seam.protocol import Heartbeat, Pace
from cluster.spec.load import load_config

pytestmark = pytest.mark.timeout(30)

SITE = "/venv/lib/python3.12/site-packages"
LOOP = [
    Frame("/app/cluster/rank/worker.py", 450, "_train_epoch"),
    Frame("/app/cluster/rank/step.py", 80, "train_step"),
]
ALLREDUCE = [*LOOP, Frame(f"{SITE}/torch/distributed/c10d_logger.py", 81, "wrapper")]
BACKWARD = [
    *LOOP,
    Frame(f"{SITE}/torch/_tensor.py", 625, "backward"),
    Frame(f"{SITE}/torch/autograd/graph.py", 829, "_engine_run_backward"),
]
BROADCAST = [*LOOP, Frame(f"{SITE}/torch/nn/parallel/distributed.py", 1480, "_sync_buffers")]
USER = [*LOOP, Frame("/app/mytask.py", 12, "compute_loss")]
LOADER = [*LOOP, Frame(f"{SITE}/torch/utils/data/dataloader.py", 1133, "_try_get_data")]


def rank(frames: list[Frame] | None) -> list[ThreadStack] | None:
    if frames is None:
        return None
    return [
        ThreadStack("MainThread", True, frames),
        ThreadStack("heartbeat", False, [Frame("/x.py", 1, "f")]),
    ]


@pytest.mark.parametrize(
    ("frames", "state"),
    [
        (ALLREDUCE, "waiting"),
        (BACKWARD, "waiting"),  # DDP's reducer blocks the autograd engine until gradients are reduced
        (BROADCAST, "waiting"),  # DDP's forward broadcasts buffers
        (USER, "outside"),
        (LOADER, "outside"),  # a rank waiting for its own input waits for no peer
        (None, "silent"),
    ],
)
def test_each_rank_is_waiting_outside_or_silent(frames: list[Frame] | None, state: str) -> None:
    assert state_of(rank(frames)) == state


def test_an_idle_rank_is_not_waiting_for_a_peer() -> None:
    assert state_of([ThreadStack("heartbeat", False, [Frame("/x.py", 1, "f")])]) == "outside"


def test_the_silent_rank_among_waiting_ones_is_the_suspect() -> None:
    """A SIGSTOPped rank answers nothing; the three others wait for it in the all-reduce."""
    v = judge(
        {0: rank(ALLREDUCE), 1: rank(BACKWARD), 2: rank(None), 3: rank(ALLREDUCE)}, dict.fromkeys(range(4), 7)
    )
    assert v.suspect == 2 and v.keep_survivors and v.waiting == [0, 1, 3]
    assert "silent" in v.how and "ranks 0-1,3 waited" in v.how


def test_the_only_rank_outside_a_collective_is_the_suspect_and_where_it_stands_is_said() -> None:
    v = judge({0: rank(BROADCAST), 1: rank(USER), 2: rank(ALLREDUCE)}, dict.fromkeys(range(3), 3))
    assert v.suspect == 1 and "compute_loss (app/mytask.py:12)" in v.how
    assert not judge({0: rank(ALLREDUCE), 1: rank(USER)}, {}, warm_restart=False).keep_survivors


@pytest.mark.parametrize(
    ("stacks", "steps", "why"),
    [
        ({0: ALLREDUCE, 1: BACKWARD}, {0: 5, 1: 5}, "all wait inside a collective"),
        ({0: None, 1: None, 2: ALLREDUCE}, {0: 5, 1: 5, 2: 5}, "ranks 0-1 silent"),
        ({0: USER, 1: None, 2: ALLREDUCE}, {0: 5, 1: 5, 2: 5}, "several suspects"),
        ({0: USER}, {0: 5}, "a single rank"),
        ({0: ALLREDUCE, 1: USER}, {0: 4, 1: 5}, "ahead of rank 0"),  # a waiting rank behind it: not sure
    ],
)
def test_no_suspect_when_no_rank_stands_out(
    stacks: dict[int, list[Frame] | None], steps: dict[int, int], why: str
) -> None:
    v = judge({r: rank(f) for r, f in stacks.items()}, steps)
    assert v.suspect is None and not v.keep_survivors and why in v.how, v
    assert "every rank gets a fresh process" in v.describe()


def test_among_several_candidates_the_one_behind_every_other_rank_is_the_suspect() -> None:
    v = judge({0: rank(None), 1: rank(USER), 2: rank(ALLREDUCE)}, {0: 6, 1: 5, 2: 6})
    assert v.suspect == 1 and "behind" in v.how


def test_the_failure_names_the_suspect_and_keeps_the_watch_s_message() -> None:
    stacks = {0: rank(ALLREDUCE), 1: rank(None)}
    f = hang_failure((0, "no progress for 12s"), stacks, {0: 3, 1: 3}, warm_restart=True)
    assert f.kind == "hang" and f.rank == 1 and f.hang is not None and f.hang.suspect == 1
    assert f.message.startswith("rank 1 hangs (silent") and "others keep their processes" in f.message
    assert f.message.endswith("no progress for 12s")
    none = hang_failure((0, "no progress"), None, {}, warm_restart=True)
    assert none.rank == 0 and none.hang is not None and none.hang.suspect is None


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def beats(
    step: int, step_s: float = 0.2, rows: list[dict] | None = None, first_s: float = 0.2
) -> list[Heartbeat | None]:
    """Two ranks at ``step``; ``first_s``: the slowest step since they started (the worker's own max)."""
    pace = Pace(step_s / 2, step_s, 5)
    return [
        Heartbeat(r, step, 0.0, max(first_s, step_s), True, rows=rows if r == 0 else [], pace=pace)
        for r in range(2)
    ]


def test_after_warm_up_and_a_checkpoint_the_automatic_timeout_drops_to_its_minimum() -> None:
    """A 3 s first step (compilation, caches) sets the timeout while warming up, not after."""
    cfg = load_config(overrides=["failures.hang_warmup_steps=20"]).failures
    clock = Clock()
    watch = HangWatch(cfg, 0, HangStats(0, 20, checkpoint_expected=True), clock=clock)
    assert watch.timeout() == 60  # the floor while warming up
    for step in range(1, 30):
        clock.t += 0.2
        assert watch.update(beats(step, first_s=7.0)) is None
    assert watch.timeout() == 70  # 29 steps, but no checkpoint seen yet: 10x the slowest step so far
    clock.t += 0.2
    watch.update(beats(30, rows=[{"global_step": 30, "step_time_s": 0.3, "checkpoint_stall_s": 0.5}]))
    assert watch.timeout() == 10  # max(10 s, 10 x 0.3 s, 3 x 0.5 s)
    clock.t += 10.5  # no step for longer than that: hung
    hung = watch.update(beats(30))
    assert hung is not None and "hang timeout 10s" in hung[1] and "30 (ranks 0-1)" in hung[1]


def test_the_slowest_step_and_the_longest_checkpoint_stall_keep_the_timeout_above_them() -> None:
    cfg = load_config(overrides=["failures.hang_warmup_steps=0"]).failures
    stats = HangStats(0, 0, checkpoint_expected=False)
    watch = HangWatch(cfg, 0, stats, clock=Clock())
    watch.update(beats(1, step_s=2.0))
    assert watch.timeout() == 20  # 10 x the slowest step (the median of a heartbeat's steps)
    watch.update(beats(2, rows=[{"global_step": 2, "step_time_s": 2.5, "checkpoint_stall_s": 9.0}]))
    assert watch.timeout() == 27  # 3 x a 9 s checkpoint stall, above 10 x the 2.5 s logged step
    # the group's statistics outlive the epoch's watch: the next epoch starts from them
    assert HangWatch(cfg, 2, stats, clock=Clock()).timeout() == 27


def test_a_timeout_the_user_set_is_kept_and_the_floor_can_be_kept_too() -> None:
    base = load_config().failures
    warm = HangStats(0, 0, checkpoint_expected=False, max_step=50)
    assert HangWatch(dataclasses.replace(base, hang_timeout_s=45.0), 0, warm).timeout() == 45
    assert HangWatch(base, 0, warm).timeout() == 10
    kept = dataclasses.replace(base, hang_timeout_min_s=base.hang_timeout_floor_s)
    assert HangWatch(kept, 0, warm).timeout() == 60


def test_a_short_minimum_is_refused() -> None:
    from cluster.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"failures\.hang_timeout_min_s=1"):
        load_config(overrides=["failures.hang_timeout_min_s=1"])
