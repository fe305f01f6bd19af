"""Failures on a real local Ray: SIGKILLed workers, torn checkpoint writes, hangs, user exceptions.

The strongest check: a run interrupted and resumed at the same world size ends with a model.pt that is
bitwise equal to the fault-free run's (CPU/gloo; every step reseeds RNGs from (seed, step, rank))."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import torch

from cluster import load_config, train
from cluster.core.errors import TrainingFailedError
from cluster.inspect import format_show, report
from cluster.run.checkpoint import CheckpointStore
from cluster.run.logs import read_metrics
from cluster.run.storage import Storage
from tests.support.faults import EPOCHS, NO_SPARE, STEPS, assert_bitwise_equal, events, final_model, overrides
from tests.support.goodput import account

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def reference(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("ref")
    result = train(
        load_config("jobs/configs/tiny_cpu.yaml", overrides(str(root), "ref", NO_SPARE)), out=io.StringIO()
    )
    assert result.status == "finished" and result.attempts == 1
    return final_model(result.run_url)


def kill_when(run_url: str, ready: Callable[[], bool], rank: int, delay: float = 0.0) -> threading.Thread:
    """SIGKILL rank ``rank``'s process from outside once ``ready()`` holds (pids come from the event log)."""

    def go() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                started = events(run_url, "group_started")
            except (FileNotFoundError, json.JSONDecodeError):
                started = []
            if started and ready():
                time.sleep(delay)
                os.kill(started[0]["pids"][rank], signal.SIGKILL)
                return
            time.sleep(0.02)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def spare_is_ready(run_url: str) -> bool:
    try:
        return bool(events(run_url, "spare_ready"))
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def committed(run_url: str, step: int) -> bool:
    return os.path.exists(f"{run_url}/checkpoints/step_{step:09d}/manifest.json")


PEER_SCENARIOS = [
    "inject_crash_first_epoch",  # step 3: before any checkpoint exists
    "sigkill_right_after_checkpoint",
    "sigkill_mid_epoch",
    "crash_during_checkpoint",  # rank 0 dies while writing step 10's checkpoint
    "crash_in_backward",  # the survivor waits inside the gradient all-reduce
    "crash_after_step",  # right after the optimizer update, before the next collective
    "raise_in_user_code",  # the raising rank releases its peers by leaving the group
    "grad_accum",
]


@pytest.mark.parametrize("scenario", [*PEER_SCENARIOS, "peers_off"])
def test_killed_worker_recovers_bitwise_equal(reference: dict, tmp_path: object, scenario: str) -> None:
    storage = f"{tmp_path}/runs"
    run_url = f"{storage}/{scenario}"
    extra: list[str] = []
    killer = None
    if scenario == "inject_crash_first_epoch":
        extra = ["failures.inject=[{rank: 1, step: 3, kind: crash}]"]
    elif scenario == "crash_during_checkpoint":
        extra = ["failures.inject=[{rank: 0, step: 10, kind: crash_in_checkpoint}]"]
    elif scenario in ("crash_in_backward", "crash_after_step"):
        extra = [f"failures.inject=[{{rank: 1, step: 18, kind: {scenario}}}]"]
    elif scenario == "raise_in_user_code":
        extra = ["failures.inject=[{rank: 0, step: 13, kind: raise}]"]
    elif scenario == "grad_accum":
        extra = ["training.grad_accum_steps=2", "failures.inject=[{rank: 1, step: 8, kind: crash}]"]
    elif scenario == "peers_off":
        extra = ["failures.recover_from_peers=false", "failures.inject=[{rank: 1, step: 13, kind: crash}]"]
    elif scenario == "sigkill_right_after_checkpoint":
        killer = kill_when(run_url, lambda: committed(run_url, 10), rank=1)
    else:  # mid epoch 2, between checkpoints 20 and 25
        killer = kill_when(run_url, lambda: committed(run_url, 20), rank=0, delay=0.12)
    result = train(
        load_config("jobs/configs/tiny_cpu.yaml", overrides(storage, scenario, *extra)), out=io.StringIO()
    )
    if killer is not None:
        killer.join(1)
    assert result.status == "finished"
    assert result.attempts == 2, result.failures
    assert result.failures[0]["kind"] in ("worker_died", "user_error")
    failure = events(run_url, "failure")[0]
    (recovered,) = events(run_url, "recovered")
    assert recovered["detect_to_first_step_s"] > 0
    assert failure["kind"] == result.failures[0]["kind"]
    first, second = events(run_url, "group_started")
    if scenario == "peers_off":
        assert recovered["source"] == "checkpoint" and recovered["fallback"] is None
        assert recovered["lost_steps"] <= 5 + 1, recovered  # at most one checkpoint interval
        assert recovered["storage_reads"] > 0 and recovered["storage_read_bytes"] > 0
        assert second["resume_step"] == 10
    else:
        assert recovered["source"] == "peers", recovered
        assert recovered["lost_steps"] <= 1, recovered
        assert recovered["storage_reads"] == 0 and recovered["storage_read_bytes"] == 0  # nothing read
        assert recovered["bytes"] > 0
        # every survivor kept its process: only the dead rank's pid changed
        dead = result.failures[0]["rank"]
        if dead != 0:  # rank 0 survived: every step row it logged reached the metrics, none twice
            table = read_metrics(Storage(run_url)).to_pydict()
            steps = [g for g, k in zip(table["global_step"], table["kind"]) if k == "step"]
            assert sorted(steps) == list(range(1, EPOCHS * STEPS + 1))
        assert [p for r, p in enumerate(first["pids"]) if r != dead] == [
            p for r, p in enumerate(second["pids"]) if r != dead
        ]
    # the goodput account: the steps trained again are the recovery's lost steps (none from peers); the
    # time from the failure to the new group's first step is the recovery's
    g = account(run_url)
    assert g.steps["recomputed"] == recovered["lost_steps"], (g.steps, recovered)
    assert g.seconds["recovery"] > 0 and g.steps["productive"] > 0
    if scenario == "crash_during_checkpoint":
        # the torn step-10 write was never read: the survivor held step 10 (or 11) in memory
        assert second["resume_step"] >= 10 and second["resume_checkpoint"] is None
    if scenario == "grad_accum":
        assert_bitwise_equal(final_model(result.run_url), grad_accum_reference(tmp_path))
    else:
        assert_bitwise_equal(final_model(result.run_url), reference)


def grad_accum_reference(tmp_path: object) -> dict[str, torch.Tensor]:
    storage = f"{tmp_path}/ref-accum"
    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml", overrides(storage, "ref", "training.grad_accum_steps=2", NO_SPARE)
    )
    assert train(cfg, out=io.StringIO()).attempts == 1
    return final_model(f"{storage}/ref")


def test_hang_is_detected_by_heartbeat_and_recovered(reference: dict, tmp_path: object) -> None:
    storage = f"{tmp_path}/runs"
    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        overrides(
            storage,
            "hang",
            "failures.inject=[{rank: 1, step: 12, kind: hang}]",
            "failures.hang_timeout_s=3",
            "failures.process_group_timeout_s=120",
        ),
    )
    result = train(cfg, out=io.StringIO())
    assert result.status == "finished"
    assert [f["kind"] for f in result.failures] == ["hang"]
    run_url = result.run_url
    failure = events(run_url, "failure")[0]
    assert "no progress" in failure["message"]
    # the stacks name rank 1 (outside any collective): it alone is replaced, from rank 0's memory
    # (tests/ray/test_hang_peers.py checks this at 4 ranks, with a stopped process too)
    assert failure["suspect"] == 1 and failure["survivors_kept"] is True, failure
    (recovered,) = events(run_url, "recovered")
    assert recovered["source"] == "peers" and recovered["lost_steps"] <= 1, recovered
    started = events(run_url, "group_started")[0]["time"]
    # detected by the 3 s heartbeat timeout, long before the 120 s process-group timeout would fire
    assert failure["time"] - started < 30
    assert_bitwise_equal(final_model(run_url), reference)
    # Before the hung group was killed, the driver took every rank's stacks: the hung rank stands in the
    # injected hang, the other in a collective of DDP's (its forward's buffer broadcast), waiting for it.
    (dump,) = events(run_url, "stacks")
    assert dump["kind"] == "hang" and dump["silent"] == [] and dump["time"] < failure["time"]
    where = {r: g["where"] for g in dump["groups"] for r in g["ranks"]}
    assert "before_step (cluster/rank/faults.py:" in where[1], dump
    assert "torch/nn/parallel/distributed.py" in where[0] and "compute_loss" in where[0], dump
    text = Storage(run_url).read_bytes(dump["path"]).decode()
    assert "=== rank 0" in text and "=== rank 1" in text and "--- thread" in text and "(training)" in text
    # the goodput account: from the last step to the hang's detection (the 3 s timeout) is detection's,
    # from there to the replacement's first step recovery's; the step lost with it is recomputed
    g = account(run_url)
    assert g.seconds["detection"] >= 2.0 and g.seconds["recovery"] > 0, g.seconds
    assert g.steps["recomputed"] == recovered["lost_steps"], g.steps


def test_a_slow_rank_is_named_with_its_host_and_cleared_never_on_the_others(
    tmp_path: object, ray_local: None
) -> None:
    """Rank 1 sleeps 50 ms more than rank 0 in each step from step 4: every step waits for it, and the
    driver says which rank it is, on which host, from the ranks' own parts of their steps."""
    out = io.StringIO()
    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        overrides(
            f"{tmp_path}/r",
            "slow",
            "failures.inject=[{rank: 1, step: 4, kind: slow}]",
            "failures.hang_timeout_floor_s=20",  # heartbeats every second (a twentieth of it)
            "training.max_steps_per_epoch=30",
        ),
    )
    result = train(cfg, out=out)
    assert result.status == "finished" and result.attempts == 1
    slow = events(result.run_url, "slow_rank")
    assert [e["rank"] for e in slow] == [1], slow
    (e,) = slow
    assert result.slow_ranks == [{k: v for k, v in e.items() if k not in ("time", "event")}]  # Python API
    host = events(result.run_url, "group_started")[0]["hosts"][0]
    assert e["host"] == host and e["attempt"] == 0 and e["step"] >= 4
    # its own part: the task's 50 ms sleep, the fault's 50 ms and its compute; the others': 50 ms + compute.
    # The bounds lie half the fault's 50 ms from the right measure and from the wrong one (counting waits)
    assert e["compute_ms"] - e["others_ms"] > 25 and e["ratio"] >= 1.5
    assert e["step_ms"] >= e["compute_ms"] * 0.9  # every rank's step lasts about as long as the slowest
    assert f"rank 1 on {host} is slow" in out.getvalue()
    assert "its forward and backward" in out.getvalue()  # the fault sleeps outside the input fetch
    assert e["input_ms"] < 25 and e["others_input_ms"] < 25  # the fault's 50 ms would show here
    assert not events(result.run_url, "slow_rank_cleared")  # slow to the end
    shown = format_show(report(Storage(result.run_url)))  # python -m cluster show
    assert "slow ranks (1: every rank waited for them at each step)" in shown
    assert "group end" in shown


def test_user_exception_once_is_retried(tmp_path: object, ray_local: None) -> None:
    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        overrides(f"{tmp_path}/r", "once", "failures.inject=[{rank: 1, step: 7, kind: raise}]", NO_SPARE),
    )
    result = train(cfg, out=io.StringIO())
    assert result.status == "finished" and result.attempts == 2
    assert result.failures[0]["kind"] == "user_error"
    assert result.failures[0]["rank"] == 1
    assert "injected fault on rank 1 at step 7" in result.failures[0]["message"]
    assert "Traceback" in events(result.run_url, "failure")[0]["message"]


def test_same_exception_same_step_twice_fails_fast(tmp_path: object, ray_local: None) -> None:
    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        overrides(
            f"{tmp_path}/r",
            "bug",
            "failures.inject=[{rank: 0, step: 7, kind: raise, attempt: -1}]",
            "failures.max_failures=10",
            NO_SPARE,
        ),
    )
    with pytest.raises(TrainingFailedError) as info:
        train(cfg, out=io.StringIO())
    text = str(info.value)
    assert "happened twice at step 7" in text
    assert "Traceback" in text and "injected fault on rank 0 at step 7" in text
    run_url = f"{tmp_path}/r/bug"
    assert len(events(run_url, "failure")) == 2  # not 11: the budget was not burned
    latest = CheckpointStore(Storage(run_url)).load_latest()
    assert latest is not None and latest.info.step == 5  # checkpoints intact


def test_max_failures_exhausted_is_a_clear_error_with_checkpoints_intact(
    tmp_path: object, ray_local: None
) -> None:
    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        overrides(
            f"{tmp_path}/r",
            "budget",
            "failures.inject=[{rank: 1, step: 8, kind: crash, attempt: -1}]",
            "failures.max_failures=1",
        ),
    )
    with pytest.raises(TrainingFailedError, match=r"failures.max_failures=1 exhausted \(2 failures\)"):
        train(cfg, out=io.StringIO())
    run_url = f"{tmp_path}/r/budget"
    assert [e["kind"] for e in events(run_url, "failure")] == ["worker_died", "worker_died"]
    latest = CheckpointStore(Storage(run_url)).load_latest()
    assert latest is not None and latest.info.step == 5
    assert events(run_url, "run_failed")


def test_resources_that_never_appear_are_a_clear_error(tmp_path: object, ray_local: None) -> None:
    from cluster.core.errors import ResourcesUnavailableError

    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        overrides(
            f"{tmp_path}/r",
            "nores",
            "scaling.cpus_per_worker=3",  # 2 x 3 CPUs: never on this 4-CPU Ray
            "scaling.resource_wait_s=2",
        ),
    )
    t0 = time.monotonic()
    with pytest.raises(ResourcesUnavailableError) as info:
        train(cfg, out=io.StringIO())
    assert time.monotonic() - t0 < 60  # a bounded wait, not forever
    text = str(info.value)
    assert "CPU=3" in text and "scaling.resource_wait_s=2" in text and "Add nodes" in text
    assert not os.path.exists(f"{tmp_path}/r/nores/checkpoints")


def test_a_custom_resource_no_node_has_is_refused_before_anything_starts(
    tmp_path: object, ray_local: None
) -> None:
    """No wait of ``scaling.resource_wait_s`` for what no node of the cluster has: one clear error."""
    from cluster.core.errors import ConfigError

    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        overrides(f"{tmp_path}/r", "nores", "scaling.resources_per_worker={tpu_slice: 1}"),
    )
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        train(cfg, out=io.StringIO())
    assert time.monotonic() - t0 < 30
    assert "'tpu_slice'" in str(info.value) and "scaling.resources_per_worker" in str(info.value)
    assert not os.path.exists(f"{tmp_path}/r/nores/checkpoints")


def test_hot_spare_replaces_a_killed_worker(reference: dict, tmp_path: object) -> None:
    storage = f"{tmp_path}/runs"
    run_url = f"{storage}/spare"
    # The kill waits for the driver's report that the spare (started with the group) is prepared. Sleepy steps
    # leave it the CPU for its torch import (which on 2 cores competes with both training workers) and keep
    # the
    # run going well past it; a 20 s hang timeout makes the heartbeat, where readiness is checked, 1 s.
    killer = kill_when(run_url, lambda: committed(run_url, 25) and spare_is_ready(run_url), rank=1, delay=0.2)
    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        overrides(
            storage,
            "spare",
            "failures.hot_spare=true",
            "task_args.step_sleep_s=0.3",
            "failures.hang_timeout_s=20",
        ),
    )
    result = train(cfg, out=io.StringIO())
    killer.join(1)
    assert result.status == "finished" and result.attempts == 2
    (ready,) = events(run_url, "spare_ready")
    assert ready["attempt"] == 0 and ready["prepare_s"] > 0
    (recovered,) = events(run_url, "recovered")
    assert recovered["reused_workers"] == 2  # the survivor and the spare: no process was started
    # never worse than without the spare: the state from the survivor's memory, not from storage
    assert recovered["source"] == "peers" and recovered["storage_reads"] == 0, recovered
    assert recovered["lost_steps"] <= 1, recovered
    assert_bitwise_equal(final_model(run_url), reference)


def test_a_hot_spare_still_preparing_takes_the_dead_rank_s_place(reference: dict, tmp_path: object) -> None:
    """Rank 1 dies before step 2, a moment after the group started and with it the spare (hot_spare=true
    starts it after the ranks' setup): the spare cannot have imported torch yet on 2 cores. It takes the
    dead rank's place anyway, as further along than a process started then; the run ends bitwise the
    fault-free one's."""
    storage = f"{tmp_path}/runs"
    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        overrides(
            storage,
            "spare_early",
            "failures.hot_spare=true",
            "failures.inject=[{rank: 1, step: 2, kind: crash}]",
        ),
    )
    result = train(cfg, out=io.StringIO())
    assert result.status == "finished" and result.attempts == 2
    run_url = result.run_url
    assert all(e["attempt"] != 0 for e in events(run_url, "spare_ready"))  # taken before it was ready
    (recovered,) = events(run_url, "recovered")
    assert recovered["spare"] == "preparing"
    assert recovered["reused_workers"] == 2  # the survivor and the spare: no process was started
    first, second = events(run_url, "group_started")
    assert second["pids"][0] == first["pids"][0] and second["pids"][1] != first["pids"][1]
    assert_bitwise_equal(final_model(run_url), reference)


def test_eight_ranks_one_killed_the_other_seven_keep_their_processes(
    tmp_path: object, ray_local: None
) -> None:
    """Rank 5 dies inside the backward all-reduce: seven survivors, most of them waiting on live neighbours.
    Every one leaves the failed collective and keeps its process; the result is bitwise the fault-free
    run's (with more than 2 ranks that needs training.fixed_buckets, on by default)."""
    eight = [
        "scaling.num_workers=8",
        "scaling.cpus_per_worker=0.5",
        "training.epochs=1",
        "training.max_steps_per_epoch=12",
        "task_args.step_sleep_s=0",
        NO_SPARE,
    ]
    storage = f"{tmp_path}/runs"
    ref = train(
        load_config("jobs/configs/tiny_cpu.yaml", overrides(storage, "ref8", *eight)), out=io.StringIO()
    )
    assert ref.status == "finished" and ref.attempts == 1
    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        overrides(storage, "kill8", *eight, "failures.inject=[{rank: 5, step: 8, kind: crash_in_backward}]"),
    )
    result = train(cfg, out=io.StringIO())
    assert result.status == "finished" and result.attempts == 2
    run_url = result.run_url
    first, second = events(run_url, "group_started")
    assert second["resume_source"] == "peers"
    assert [p for r, p in enumerate(first["pids"]) if r != 5] == [
        p for r, p in enumerate(second["pids"]) if r != 5
    ]
    assert second["pids"][5] != first["pids"][5]
    (recovered,) = events(run_url, "recovered")
    assert recovered["source"] == "peers" and recovered["lost_steps"] <= 1
    assert recovered["reused_workers"] == 7 and recovered["storage_reads"] == 0
    latest = CheckpointStore(Storage(run_url)).load_latest()
    want = CheckpointStore(Storage(ref.run_url)).load_latest()
    assert latest is not None and want is not None and latest.info.step == want.info.step == 12
    assert_bitwise_equal(latest.files["model.pt"], want.files["model.pt"])


def test_a_diverged_run_stops_at_once_naming_the_step_and_keeps_its_good_checkpoints(
    tmp_path: object, ray_local: None
) -> None:
    """Rank 1's loss becomes NaN at step 12: the all-reduced gradient spreads it to every rank's weights,
    rank 0's logged loss is NaN at step 13, and the run stops there, not retried. Checkpoints every step:
    those of the NaN weights (12, 13) are refused, so keep_last never deletes the good ones for them."""
    storage = f"{tmp_path}/runs"
    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        overrides(
            storage,
            "nan",
            "checkpoint.every_steps=1",
            "checkpoint.keep_last=2",
            "failures.inject=[{rank: 1, step: 12, kind: nan}]",
            NO_SPARE,
        ),
    )
    with pytest.raises(TrainingFailedError) as err:
        train(cfg, out=io.StringIO())
    text = str(err.value)
    assert "training diverged (rank 0): the loss is nan at step 13" in text, text[:2000]
    assert "lower the learning rate, set training.grad_clip" in text
    run_url = f"{storage}/nan"
    assert len(events(run_url, "group_started")) == 1  # not retried: it would diverge again
    infos = CheckpointStore(Storage(run_url)).list()
    assert [i.step for i in infos] == [10, 11]
    latest = CheckpointStore(Storage(run_url)).load_latest()
    assert latest is not None and latest.info.step == 11
    assert all(
        bool(torch.isfinite(t).all()) for t in latest.files["model.pt"].values() if t.is_floating_point()
    )


def test_a_stop_asked_while_waiting_for_resources_ends_the_run_at_once(
    tmp_path: object, ray_local: None
) -> None:
    """`python -m cluster stop` (its file) while Ray has no room for the workers: the run ends `stopped`
    within seconds, not after scaling.resource_wait_s, and its placement-group request is withdrawn."""
    import ray
    from ray.util.placement_group import placement_group_table

    from cluster.run.requests import request_stop

    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        overrides(
            f"{tmp_path}/r",
            "waits",
            "scaling.cpus_per_worker=3",  # 2 x 3 CPUs: never on this 4-CPU Ray
            "scaling.resource_wait_s=120",
        ),
    )
    run_url = f"{tmp_path}/r/waits"

    def ask_once_waiting() -> None:
        while not any(p["state"] == "PENDING" for p in placement_group_table().values()):
            time.sleep(0.2)
        request_stop(run_url, None, "test")

    asker = threading.Thread(target=ask_once_waiting, daemon=True)
    asker.start()
    t0 = time.monotonic()
    result = train(cfg, out=io.StringIO())
    assert result.status == "stopped" and result.global_step == 0
    assert time.monotonic() - t0 < 60  # the stop file is read every 5 s; the wait would be 120 s
    (stopped,) = events(run_url, "stopped")
    assert "asked to stop while waiting for resources" in stopped["note"]
    assert all(p["state"] == "REMOVED" for p in placement_group_table().values())
    assert ray.is_initialized()
    asker.join(5)
