"""The fast tier's three end-to-end smoke tests (``pytest -m fast``), on one shared local Ray: a clean run
to its end; one rank SIGKILLed from outside and recovered from its peer's memory, bitwise; a run stopped
(Ctrl-C) and resubmitted, resuming from the stop's checkpoint, bitwise. Each is short (a 30-step job) and
each would fail if the promise it names broke; the full suite holds the many variations of each."""

from __future__ import annotations

import io
import os
import signal
import threading
import time

import pytest
import torch

from cluster import load_config, train
from cluster.run.checkpoint import CheckpointStore
from cluster.run.storage import Storage
from tests.support.faults import EPOCHS, STEPS, assert_bitwise_equal, events, final_model, overrides

pytestmark = [pytest.mark.timeout(240), pytest.mark.fast]


def _events(run_url: str, kind: str) -> list[dict]:
    try:
        return events(run_url, kind)
    except (FileNotFoundError, ValueError):
        return []


def after_steps(run_url: str, groups: int, delay: float, action: object) -> threading.Thread:
    """Call ``action()`` ``delay`` s after the run's group number ``groups + 1`` started."""

    def go() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            started = _events(run_url, "group_started")
            if len(started) > groups:
                time.sleep(delay)
                action(started[-1])  # type: ignore[operator]
                return
            time.sleep(0.02)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


@pytest.fixture(scope="module")
def clean(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A run without faults: (its URL, its console output)."""
    root = tmp_path_factory.mktemp("clean")
    out = io.StringIO()
    result = train(load_config("jobs/configs/tiny_cpu.yaml", overrides(str(root), "clean")), out=out)
    assert result.status == "finished" and result.attempts == 1, result.failures
    return result.run_url, out.getvalue()


def test_a_clean_run_trains_to_its_end_with_a_verified_checkpoint_there(clean: tuple[str, str]) -> None:
    run_url, text = clean
    latest = CheckpointStore(Storage(run_url)).load_latest()
    assert latest is not None and latest.info.step == EPOCHS * STEPS  # verified on load
    losses = [e["loss"] for e in events(run_url, "epoch_end")]
    assert len(losses) == EPOCHS and losses[-1] < losses[0]
    assert f"epoch {EPOCHS}/{EPOCHS}" in text
    assert _events(run_url, "failure") == [] and len(events(run_url, "finished")) == 1


def test_a_rank_killed_from_outside_recovers_from_its_peer_bitwise(
    clean: tuple[str, str], tmp_path: object
) -> None:
    storage = f"{tmp_path}/runs"
    run_url = f"{storage}/killed"
    killer = after_steps(run_url, 0, 1.0, lambda g: os.kill(g["pids"][1], signal.SIGKILL))
    result = train(load_config("jobs/configs/tiny_cpu.yaml", overrides(storage, "killed")), out=io.StringIO())
    killer.join(5)
    assert result.status == "finished" and result.attempts == 2, result.failures
    (recovered,) = events(run_url, "recovered")
    assert recovered["source"] == "peers" and recovered["lost_steps"] <= 1, recovered
    assert recovered["storage_reads"] == 0  # the state came from rank 0's memory
    first, second = events(run_url, "group_started")
    assert first["pids"][0] == second["pids"][0] != 0 and first["pids"][1] != second["pids"][1]
    assert_bitwise_equal(final_model(run_url), final_model(clean[0]))


def test_a_stopped_run_resubmitted_resumes_from_its_stop_and_ends_bitwise(
    clean: tuple[str, str], tmp_path: object
) -> None:
    storage = f"{tmp_path}/runs"
    run_url = f"{storage}/stopped"
    cfg = load_config("jobs/configs/tiny_cpu.yaml", overrides(storage, "stopped"))
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        after_steps(run_url, 0, 1.0, lambda g: os.kill(os.getpid(), signal.SIGINT))
        first = train(cfg, out=io.StringIO())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert first.status == "stopped" and first.stop_reason == "SIGINT"
    assert 0 < first.global_step < EPOCHS * STEPS
    (stopped,) = events(run_url, "stopped")
    assert stopped["committed"] is True and stopped["checkpoint_step"] == first.global_step
    second = train(cfg, out=io.StringIO())
    assert second.status == "finished" and second.global_step == EPOCHS * STEPS
    assert events(run_url, "group_started")[-1]["resume_step"] == first.global_step
    weights: dict[str, torch.Tensor] = final_model(run_url)
    assert_bitwise_equal(weights, final_model(clean[0]))
