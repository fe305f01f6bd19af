"""A hang recovered from peers on a real local Ray: one of 4 ranks stops (SIGSTOP at a moment the test does
not choose, so mostly inside a collective or its own compute, and silent: its actor cannot answer; or an
injected hang before a step, outside any collective, answering). The driver names it from the ranks'
stacks, SIGKILLs it by pid, the three others leave their broken collective, keep their processes and state,
and the replacement takes the state from one of them: at most one step lost, and the final weights are
bitwise equal to a fault-free run's."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import threading
import time

import pytest
import torch

from cluster import load_config, train
from tests.support.faults import NO_SPARE, assert_bitwise_equal, events, final_model, overrides

pytestmark = pytest.mark.timeout(240)

HANG = [
    "scaling.num_workers=4",
    "failures.hang_warmup_steps=5",  # warm once 5 steps and the step-5 checkpoint are seen
    "failures.hang_timeout_min_s=5",  # then the automatic timeout: max(5 s, 10x the step, 3x the stall)
]


@pytest.fixture(scope="module")
def reference(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("ref4")
    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml", overrides(str(root), "ref", "scaling.num_workers=4", NO_SPARE)
    )
    result = train(cfg, out=io.StringIO())
    assert result.status == "finished" and result.attempts == 1
    return final_model(result.run_url)


def stop_rank_when_step_10_commits(run_url: str, rank: int, stopped: list[int]) -> threading.Thread:
    """SIGSTOP rank ``rank`` a random moment (0-0.3 s) after checkpoint 10 commits."""

    def go() -> None:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            try:
                started = events(run_url, "group_started")
            except (FileNotFoundError, json.JSONDecodeError):
                started = []
            if started and os.path.exists(f"{run_url}/checkpoints/step_{10:09d}/manifest.json"):
                time.sleep(random.uniform(0.0, 0.3))
                pid = started[0]["pids"][rank]
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
                return
            time.sleep(0.02)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("how", ["sigstop", "hang_before_step"])
def test_a_hung_rank_is_replaced_and_the_three_others_keep_their_processes(
    reference: dict[str, torch.Tensor], tmp_path: object, how: str
) -> None:
    storage, hung = f"{tmp_path}/runs", 2
    run_url = f"{storage}/{how}"
    extra = [*HANG]
    stopped: list[int] = []
    if how == "hang_before_step":
        extra.append(f"failures.inject=[{{rank: {hung}, step: 13, kind: hang}}]")
        stopper = None
    else:
        stopper = stop_rank_when_step_10_commits(run_url, hung, stopped)
    try:
        result = train(
            load_config("jobs/configs/tiny_cpu.yaml", overrides(storage, how, *extra)), out=io.StringIO()
        )
    finally:
        if stopper is not None:
            stopper.join(1)
        for pid in stopped:  # ended by the driver; never left stopped, whatever happened
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert result.status == "finished", result.failures
    assert [f["kind"] for f in result.failures] == ["hang"]
    (failure,) = events(run_url, "failure")
    assert failure["suspect"] == hung and failure["rank"] == hung and failure["survivors_kept"] is True, (
        failure
    )
    if how == "sigstop":
        assert failure["told_by"].startswith("silent"), failure
    else:
        assert (
            "the only rank outside a collective, at before_step (cluster/rank/faults.py" in failure["told_by"]
        )
    assert "ranks 0-1,3 waited inside a collective" in failure["told_by"]
    (recovered,) = events(run_url, "recovered")
    assert recovered["source"] == "peers" and recovered["fallback"] is None, recovered
    assert recovered["lost_steps"] <= 1, recovered
    assert recovered["storage_reads"] == 0  # nothing read from storage
    first, second = events(run_url, "group_started")
    assert second["pids"][hung] != first["pids"][hung]
    assert [p for r, p in enumerate(first["pids"]) if r != hung] == [
        p for r, p in enumerate(second["pids"]) if r != hung
    ]
    assert_bitwise_equal(final_model(run_url), reference)
