"""Taking, grouping and writing the ranks' thread stacks (``cluster.core.stacks``), in this process."""

from __future__ import annotations

import threading

import pytest

from cluster.core.stacks import Frame, ThreadStack, from_wire, group, ranges, render, take, to_wire, where

pytestmark = pytest.mark.timeout(30)


def _parked_in_user_code(release: threading.Event) -> None:
    release.wait()


def test_take_finds_a_parked_thread_and_marks_the_training_one() -> None:
    release = threading.Event()
    t = threading.Thread(target=_parked_in_user_code, args=(release,), name="trainer", daemon=True)
    t.start()
    try:
        threads = take(t.ident)
    finally:
        release.set()
        t.join(5)
    assert threads[0].training and threads[0].name == "trainer"  # the training thread comes first
    assert sum(th.training for th in threads) == 1
    assert all(th.name != threading.current_thread().name for th in threads)  # not the caller's own
    frames = threads[0].frames
    assert frames[-1].function == "wait" and frames[-1].file.endswith("threading.py")  # innermost last
    here = next(f for f in frames if f.function == "_parked_in_user_code")
    assert here.file == __file__ and "release.wait()" in here.code
    # one line: the innermost frame, and the innermost frame outside installed libraries
    assert where(threads[0]).startswith("wait (") and "_parked_in_user_code (unit/test_stacks.py:" in where(
        threads[0]
    )
    assert from_wire(to_wire(threads)) == threads  # plain data on the wire, nothing lost


def stack(*functions: str, training: bool = True) -> list[ThreadStack]:
    frames = [
        Frame(f"/x/site-packages/torch/{fn}.py" if fn.startswith("t_") else "/r/cluster/w.py", i, fn)
        for i, fn in enumerate(functions, 1)
    ]
    return [ThreadStack("MainThread", training, frames), ThreadStack("heartbeat", False, [])]


def test_ranks_are_grouped_by_their_training_stack_and_silent_ones_named() -> None:
    waiting = stack("run_epoch", "_train_step", "t_all_reduce")
    stacks = {
        0: waiting,
        1: stack("run_epoch", "compute_loss"),
        2: waiting,
        3: None,
        4: stack("x", training=False),
    }
    groups, silent = group(stacks)
    assert [(g.ranks, g.where) for g in groups] == [
        ([0, 2], "t_all_reduce (torch/t_all_reduce.py:3) from _train_step (cluster/w.py:2)"),
        ([1], "compute_loss (cluster/w.py:2)"),
        ([4], "idle (no epoch running)"),
    ]
    assert silent == [3]
    text = render("hang: no progress", stacks, ["a", "b", "a", "c", "c"], 12)
    assert text.startswith("# stacks of 5 rank(s): hang: no progress")
    assert "ranks 0,2: t_all_reduce" in text and "ranks 3: no answer" in text
    assert "=== rank 3 on c\n(no answer)" in text
    assert text.count('File "/r/cluster/w.py", line 2, in _train_step') == 1  # rank 2's is not repeated
    assert "(the same stack as a lower rank's training thread)" in text


def test_ranges() -> None:
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert ranges([3]) == "3" and ranges([]) == ""


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        (
            "/tmp/ray/session_x/runtime_resources/working_dir_files/abc/cluster/rank/faults.py",
            "cluster/rank/faults.py",
        ),
        ("/repo/cluster/__main__.py", "cluster/__main__.py"),
        (
            "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py",
            "torch/distributed/c10d_logger.py",
        ),
        ("/home/me/proj/tasks/charlm.py", "tasks/charlm.py"),
    ],
)
def test_a_frame_of_this_package_shows_its_layer(path: str, shown: str) -> None:
    assert Frame(path, 3, "f").short() == f"f ({shown}:3)"
