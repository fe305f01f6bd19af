"""Tracking: the background feeder's retry, order, bound and deadline (through a sink seam), and the
TensorBoard sink through the driver on staged (memory://) storage, read back with TensorBoard's reader."""

from __future__ import annotations

import pathlib
import threading
import time
from typing import Any

import fsspec
import pytest

from cluster.core.errors import Failure
from cluster.driver.tracking import Item, Tracker, flatten, scalars
from cluster.run.logs import read_metrics
from cluster.run.storage import Storage
from tests.support.fakes import STEPS, RowsGroup, make

pytestmark = pytest.mark.timeout(60)


class FlakySink:
    """Fails while ``down`` is set; records what it received, in order."""

    name = "flaky"

    def __init__(self) -> None:
        self.down = threading.Event()
        self.got: list[Item] = []
        self.opened = 0

    def open(self) -> None:
        self.opened += 1

    def send(self, items: list[Item]) -> None:
        if self.down.is_set():
            raise ConnectionError("server down")
        self.got.extend(items)

    def close(self) -> None:
        pass


def wait_for(cond: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_names_and_flattened_params() -> None:
    row = {"kind": "step", "global_step": 3, "loss": 1.5, "lr": 0.1, "grad_norm": 2.5, "m_acc": 0.5}
    row = {**row, "world_size": 2, "x": None}
    assert dict(scalars(row)) == {
        "train/loss": 1.5,
        "train/lr": 0.1,
        "train/grad_norm": 2.5,
        "train/acc": 0.5,
        "train/world_size": 2.0,
    }
    assert dict(scalars({**row, "kind": "epoch"}))["epoch/loss"] == 1.5
    flat = dict(flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2], "f": {}}))
    assert flat == {"a.b": "1", "a.c.d": "x", "e": "[1, 2]", "f": "{}"}


def test_a_failing_sink_is_retried_in_the_background_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cluster.driver.tracking.BACKOFF_S", 0.05)
    sink = FlakySink()
    tracker = Tracker([sink], queue_size=1000, flush_timeout_s=10)
    tracker.rows([{"global_step": 1}])
    wait_for(lambda: len(sink.got) == 1)
    sink.down.set()
    t0 = time.perf_counter()
    for step in range(2, 50):
        tracker.rows([{"global_step": step}])
    assert time.perf_counter() - t0 < 0.5  # the caller never waits for the sink
    wait_for(lambda: any(n[0] == "tracking_error" for n in tracker._notes))
    sink.down.clear()
    wait_for(lambda: len(sink.got) == 49)
    notes = tracker.notes()
    assert [n[0] for n in notes] == ["tracking_error", "tracking_resumed"]
    assert "server down" in notes[0][1]["error"] and notes[0][1]["sink"] == "flaky"
    assert [i.data["global_step"] for i in sink.got] == list(range(1, 50))  # nothing lost, in order
    assert tracker.close({"status": "finished"}) is None
    assert sink.got[-1].kind == "finish" and sink.opened == 1


def test_queue_is_bounded_and_close_keeps_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cluster.driver.tracking.BACKOFF_S", 0.05)
    sink = FlakySink()
    sink.down.set()
    tracker = Tracker([sink], queue_size=10, flush_timeout_s=0.5)
    tracker.rows([{"global_step": s} for s in range(25)])
    t0 = time.monotonic()
    left = tracker.close({"status": "finished"})
    assert time.monotonic() - t0 < 3
    assert left == {"unsent": {"flaky": 10}, "dropped": {"flaky": 16}}  # 25 rows + the summary, 10 kept
    assert sink.got == []
    feeder = tracker._feeders[0]
    feeder.thread.join(2)
    assert not feeder.thread.is_alive()  # a failing sink stops retrying at the deadline


def test_tensorboard_on_object_storage_through_the_driver(tmp_path: pathlib.Path) -> None:
    """memory:// cannot be written in place by TensorBoard's writer: files are staged and uploaded. A
    failure in epoch 2 resumes from the checkpoint at step 6: steps 7 and 8 are trained twice, and
    TensorBoard shows each step once, steps 7 and 8 as retrained (the loss rows differ by attempt)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    driver, _ = make(
        {0: ["ok", "ok", Failure("worker_died", 1, "worker_died:rank 1 died")]},
        ["tracking.tensorboard=true"],
        resume={1: 6},
        group_cls=RowsGroup,
    )
    result = driver.run()
    assert result.status == "finished" and result.attempts == 2
    storage = Storage(driver.run_url)
    names = storage.listdir("tensorboard")
    assert len(names) == 2 and all(n.startswith("events.out.tfevents.") for n in names)  # one per start
    for name in names:
        (tmp_path / name).write_bytes(storage.read_bytes(f"tensorboard/{name}"))
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(loss) == list(range(1, 3 * STEPS + 1))  # every step once
    table = read_metrics(storage).to_pylist()
    steps = [r for r in table if r["kind"] == "step"]
    assert len(steps) == 3 * STEPS + 2  # Parquet keeps the undone steps 7, 8 too (attempt column)
    last = {r["global_step"]: r["loss"] for r in sorted(steps, key=lambda r: r["time"])}
    assert loss == pytest.approx(last, rel=1e-6)
    assert loss[7] == pytest.approx(10 / 7 + 1) and loss[6] == pytest.approx(10 / 6)
    epoch_loss = {e.step: e.value for e in acc.Scalars("epoch/loss")}
    assert epoch_loss == pytest.approx({r["global_step"]: r["loss"] for r in table if r["kind"] == "epoch"})
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("events/text_summary")]
    assert any(t.startswith("**failure** kind=worker_died") for t in texts)
    assert any(t.startswith("**recovered**") for t in texts) and any(
        t.startswith("**finished**") for t in texts
    )
    fsspec.filesystem("memory").rm(driver.run_url.replace("memory://", "/"), recursive=True)
