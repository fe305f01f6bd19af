"""The arithmetic, the arms and the freezer behind ``benchmarks.bench_interleaved`` (the time-sliced epoch
benchmark), and how its product arm's figures are read from the run's own event log (``bench_ddp``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_ddp
from benchmarks.bench_interleaved import (
    ARMS,
    Freezer,
    _label_arms,
    active_between,
    arm_spec,
    epoch_active_times,
    summarize,
)


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
        return {
            "arms": {
                "product": {"interleaved": {"epoch_mean_s": p, "epoch_median_s": p}},
                "bare": {"interleaved": {"epoch_mean_s": b, "epoch_median_s": b}},
            }
        }

    s = summarize([rep(1.01, 1.0), rep(2.04, 2.0), rep(3.0, 3.0)], ["product", "bare"])
    r = s["epoch_ratios"]["product/bare"]
    assert s["base"] == "bare"
    assert r["per_repeat"] == pytest.approx([1.01, 1.02, 1.0])
    assert r["median_epoch_ratio_per_repeat"] == pytest.approx([1.01, 1.02, 1.0])
    assert r["mean"] == pytest.approx(1.01)
    assert r["upper95"] == pytest.approx(1.01 + 1.96 * 0.01 / 3**0.5)


def _spec(arm: str, work: str) -> dict[str, Any]:
    return arm_spec(arm, work, epochs=8, ckpt_every=25, steps_per_epoch=48, slow_ms=1.2)


def test_every_arm_runs_one_of_bench_ddps_children(tmp_path: Path) -> None:
    for arm in ARMS:
        spec = _spec(arm, str(tmp_path))
        assert spec["_child_arm"] in bench_ddp.ARMS, arm
        assert spec["epochs"] == 8 and spec["ckpt_every_steps"] == 25 and not spec["kill_step"]


def test_variants_change_settings_never_the_products_code(tmp_path: Path) -> None:
    work = str(tmp_path)
    assert _spec("product", work)["product_set"] == []
    assert _spec("product_system", work)["product_set"] == ["scaling.tune_allocator=false"]
    nice = _spec("product_nice15", work)
    assert nice["product_set"] == ["scaling.worker_niceness=null"]
    assert nice["env"] == {"RAY_worker_niceness": "15"}
    assert _spec("bare_tuned", work)["tune_allocator"] and not _spec("bare", work)["tune_allocator"]
    assert _spec("bare_thread", work)["loop_thread"] and not _spec("bare", work)["loop_thread"]
    slow = _spec("bare_slow", work)
    assert slow["task"] == "benchmarks.faults:SlowCharLM" and slow["task_args"]["step_delay_ms"] == 1.2
    # The diagnostic arm that patched ray.remote and the driver is gone, and so is the switch it used.
    assert "product_main" not in ARMS
    assert all("main_thread" not in _spec(arm, work) for arm in ARMS)
    with pytest.raises(ValueError, match="product_main"):
        _spec("product_main", work)


def _write_events(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_events_are_read_from_the_log_file_and_from_numbered_segments(tmp_path: Path) -> None:
    # a run written before segments (events.jsonl), resumed by a version that writes segments
    _write_events(tmp_path / "events.jsonl", [{"time": 1.0, "event": "run_start"}])
    _write_events(tmp_path / "events" / "000002.jsonl", [{"time": 5.0, "event": "finished"}])
    _write_events(tmp_path / "events" / "000001.jsonl", [{"time": 2.0, "event": "group_started"}])
    events = bench_ddp.read_events(str(tmp_path))
    assert [e["event"] for e in events] == ["run_start", "group_started", "finished"]
    assert bench_ddp.read_events(str(tmp_path / "missing")) == []


def test_product_breakdown_comes_from_the_event_log() -> None:
    setup = {"process_group": 0.01, "task": 0.02, "ddp": 1.5, "checkpoint_load": 0.005, "ready": 0.001}
    events = [
        {"time": 101.5, "event": "run_start", "attempt": 0},
        {
            "time": 105.0,
            "event": "group_started",
            "attempt": 0,
            "seconds": 3.4,
            "setup_s": setup,
            "pids": [7, 8],
        },
        {"time": 110.0, "event": "epoch_end"},
        {"time": 120.0, "event": "finished", "global_step": 192},
    ]
    bd = bench_ddp.product_breakdown(events, t0=100.0, t_end=120.25, first_step=105.1, last_step=119.9)
    assert bd["call_to_run_start_s"] == pytest.approx(1.5)
    assert bd["run_start_to_group_started_s"] == pytest.approx(3.5)
    assert bd["group_start_s"] == pytest.approx(3.4)
    assert bd["actors_up_s"] == pytest.approx(3.4 - sum(setup.values()))
    assert bd["setup_ddp_s"] == pytest.approx(1.5)
    assert bd["group_started_to_first_step_s"] == pytest.approx(0.1)
    assert bd["last_step_to_finished_s"] == pytest.approx(0.1)
    assert bd["finished_to_return_s"] == pytest.approx(0.25)
    # A run that never started a group or finished still gives what it has.
    assert bench_ddp.product_breakdown(events[:1], 100.0, 102.0, None, 101.0) == {"call_to_run_start_s": 1.5}


def test_product_fault_figures_come_from_the_event_log_and_the_kill_file(tmp_path: Path) -> None:
    kill_file = tmp_path / "killed"
    kill_file.write_text("200.0 1234 76\n")
    events = [
        {"time": 190.0, "event": "group_started", "attempt": 0, "resume_step": 0},
        {"time": 200.03, "event": "failure", "kind": "worker_died"},
        {"time": 202.0, "event": "group_started", "attempt": 1, "resume_step": 70},
        {
            "time": 202.5,
            "event": "recovered",
            "lost_steps": 5,
            "reserve_s": 0.001,
            "detect_to_first_step_s": 2.4,
        },
    ]
    rows = [{"attempt": 0, "time": 199.9}, {"attempt": 1, "time": 202.4}, {"attempt": 1, "time": 202.45}]
    fault, phases = bench_ddp.product_fault(events, rows, str(kill_file), 76)
    assert fault["recovery_s"] == pytest.approx(2.4)
    assert fault["kill_to_detect_s"] == pytest.approx(0.03)
    assert (
        fault["resume_step"] == 70 and fault["lost_steps"] == 5 and fault["product_reported_lost_steps"] == 5
    )
    assert phases == {"lost_steps": 5, "reserve_s": 0.001, "detect_to_first_step_s": 2.4}


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(") ", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.multiprocess  # starts a process
@pytest.mark.timeout(60)
def test_freezer_stops_a_process_and_its_children_and_thaws_them() -> None:
    try:
        fz = Freezer(f"cluster_test_{uuid.uuid4().hex[:8]}")
    except RuntimeError as e:
        pytest.skip(f"no writable cgroup freezer on this machine: {e}")
    # A parent that starts a busy child: both must be in the cgroup, and both must stop.
    code = (
        "import subprocess,sys; subprocess.Popen([sys.executable,'-c','while True: pass']); "
        "import time\nwhile True: time.sleep(0.01)"
    )
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
