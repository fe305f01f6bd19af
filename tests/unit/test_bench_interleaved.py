"""The arithmetic and the freezer behind ``benchmarks.bench_interleaved`` (the time-sliced epoch benchmark)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from benchmarks.bench_interleaved import Freezer, _label_arms, active_between, epoch_active_times, summarize


def test_active_between_counts_only_the_overlap_with_active_intervals() -> None:
    iv = [(0.0, 1.0), (2.0, 3.0), (4.0, 5.0)]
    assert active_between(iv, 0.0, 5.0) == pytest.approx(3.0)
    assert active_between(iv, 0.5, 2.5) == pytest.approx(1.0)  # 0.5 of the first, 0.5 of the second
    assert active_between(iv, 1.0, 2.0) == pytest.approx(0.0)  # wholly frozen
    assert active_between(iv, 4.2, 4.7) == pytest.approx(0.5)  # wholly inside one slice
    assert active_between([], 0.0, 10.0) == 0.0


def test_epoch_active_times_leaves_out_epochs_after_the_cut_and_missing_ends() -> None:
    iv = [(0.0, 1.0), (2.0, 3.0), (4.0, 5.0), (6.0, 7.0)]
    ends = [0.5, 2.5, None, 4.5, 6.5]
    # 0.5 -> 2.5: 1.0 active; (2.5 -> None) and (None -> 4.5) unknown; 4.5 -> 6.5 ends after the cut at 6.0
    assert epoch_active_times(ends, iv, until=6.0) == pytest.approx([1.0])
    assert epoch_active_times(ends, iv, until=7.0) == pytest.approx([1.0, 1.0])


def test_labels_number_a_repeated_arm() -> None:
    assert _label_arms(["bare", "bare", "bare_slow"]) == ["bare#1", "bare#2", "bare_slow"]
    assert _label_arms(["product", "bare"]) == ["product", "bare"]


def test_summary_ratio_is_per_repeat_against_bare() -> None:
    def rep(p: float, b: float) -> dict[str, object]:
        return {"arms": {"product": {"interleaved": {"epoch_mean_s": p, "epoch_median_s": p}},
                         "bare": {"interleaved": {"epoch_mean_s": b, "epoch_median_s": b}}}}

    s = summarize([rep(1.01, 1.0), rep(2.04, 2.0), rep(3.0, 3.0)], ["product", "bare"])
    r = s["epoch_ratios"]["product/bare"]
    assert s["base"] == "bare"
    assert r["per_repeat"] == pytest.approx([1.01, 1.02, 1.0])
    assert r["median_epoch_ratio_per_repeat"] == pytest.approx([1.01, 1.02, 1.0])
    assert r["mean"] == pytest.approx(1.01)
    assert r["upper95"] == pytest.approx(1.01 + 1.96 * 0.01 / 3**0.5)


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(") ", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.timeout(60)
def test_freezer_stops_a_process_and_its_children_and_thaws_them() -> None:
    try:
        fz = Freezer(f"cluster_test_{uuid.uuid4().hex[:8]}")
    except RuntimeError as e:
        pytest.skip(f"no writable cgroup freezer on this machine: {e}")
    # A parent that starts a busy child: both must be in the cgroup, and both must stop.
    code = "import subprocess,sys; subprocess.Popen([sys.executable,'-c','while True: pass']); " \
           "import time\nwhile True: time.sleep(0.01)"
    proc = subprocess.Popen([sys.executable, "-c", code], preexec_fn=fz.join)
    try:
        deadline = time.monotonic() + 20
        while len(fz.pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = fz.pids()
        assert proc.pid in pids and len(pids) == 2
        child = next(p for p in pids if p != proc.pid)
        time.sleep(0.3)
        fz.freeze()
        before = _cpu_ticks(child)
        time.sleep(0.5)
        assert _cpu_ticks(child) == before  # frozen: not one tick in half a second of a busy loop
        fz.thaw()
        time.sleep(0.5)
        assert _cpu_ticks(child) > before + 10  # running again (100 ticks/s on one core)
    finally:
        fz.remove()  # thaws, kills both, removes the cgroup
        proc.wait(timeout=10)
    assert not os.path.exists(fz.path)
