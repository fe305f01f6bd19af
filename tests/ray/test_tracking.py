"""TensorBoard and MLflow tracking against the real tools: a real `mlflow server` (sqlite store, local
artifacts, a free port on 127.0.0.1) read back through MlflowClient, and TensorBoard's own reader."""

from __future__ import annotations

import io
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from cluster import load_config, train
from cluster.core.errors import Failure
from cluster.driver.sinks import mlflow_run_id
from cluster.inspect import read_events
from cluster.run.checkpoint import CheckpointStore, step_dir
from cluster.run.logs import read_metrics
from cluster.run.storage import Storage
from tests.support.fakes import Hook, RowsGroup, make

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")


class MlflowServer:
    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [
            os.path.join(os.path.dirname(sys.executable), "mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.root}/mlflow.db",
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        log = open(self.root / "server.log", "ab")
        # no server-side jobs: mlflow 3 starts seven huey consumers for them, ~25 s of CPU a start on 2 cores
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True, env=env)
        end = time.monotonic() + 90
        while time.monotonic() < end:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise AssertionError("mlflow server did not start in 90 s")

    def stop(self) -> None:
        """Kill the server's process group (its pid is the group id: start_new_session)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture
def mlflow_server(tmp_path: pathlib.Path) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path / "mlflow")
    server.root.mkdir()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def history(client: Any, run_id: str, key: str) -> dict[int, float]:
    """Metric values by step; the latest logged value wins (a retrained step is logged again)."""
    out: dict[int, float] = {}
    for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
        out[m.step] = m.value
    return out


def last_by_step(rows: list[dict[str, Any]], kind: str, col: str = "loss") -> dict[int, float]:
    return {r["global_step"]: r[col] for r in sorted(rows, key=lambda r: r["time"]) if r["kind"] == kind}


@pytest.fixture
def webhook() -> Iterator[Hook]:
    h = Hook()
    yield h
    h.close()


@pytest.mark.timeout(300)
def test_a_real_job_in_mlflow_and_tensorboard_and_its_resubmission(
    ray_local: None,
    tiny_overrides: list[str],
    mlflow_server: MlflowServer,
    tmp_path: pathlib.Path,
    webhook: Hook,
) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = [
        *tiny_overrides,
        "name=tracked",
        "training.epochs=2",
        "checkpoint.every_steps=10",
        "tracking.tensorboard=true",
        f"tracking.mlflow_uri={mlflow_server.uri}",
        "tracking.mlflow_experiment=tests",
        "task_args.eval_chars=4096",  # a held-out set: evaluated at each epoch's end
        f"tracking.notify_url={webhook.url}",  # and a webhook on loopback
    ]
    first = train(load_config("jobs/configs/tiny_cpu.yaml", overrides), out=io.StringIO())
    assert first.status == "finished"
    (told,) = webhook.got  # the default events: of a run without failures, its end
    assert told["event"]["event"] == "finished" and told["text"].startswith(
        f"[tracked] finished: {first.global_step}"
    )
    assert "SECRET" not in json.dumps(read_events(Storage(first.run_url)))
    storage = Storage(first.run_url)
    run_id = mlflow_run_id(storage)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert client.get_experiment(run.info.experiment_id).name == "tests"
    tags = run.data.tags
    assert (tags["status"], tags["attempts"], tags["failures_survived"], tags["submissions"]) == (
        "FINISHED",
        "1",
        "0",
        "1",
    )
    params = run.data.params
    assert params["training.epochs"] == "2" and params["task"] == "jobs.tasks.charlm:CharLMTask"
    assert params["tracking.mlflow_uri"] == mlflow_server.uri and params["storage.options"] == "{}"

    rows = read_metrics(storage).to_pylist()
    steps = last_by_step(rows, "step")
    assert len(steps) == first.global_step
    assert history(client, run_id, "train/loss") == pytest.approx(steps)
    assert history(client, run_id, "train/lr") == pytest.approx(last_by_step(rows, "step", "lr"))
    norms = last_by_step(rows, "step", "grad_norm")
    assert len(norms) == first.global_step and all(v > 0 for v in norms.values())
    assert history(client, run_id, "train/grad_norm") == pytest.approx(norms)
    assert history(client, run_id, "epoch/loss") == pytest.approx(last_by_step(rows, "epoch"))
    evals = last_by_step(rows, "eval")
    assert sorted(evals) == [first.global_step // 2, first.global_step]  # one per epoch
    assert history(client, run_id, "eval/loss") == pytest.approx(evals)
    assert history(client, run_id, "eval/acc") == pytest.approx(last_by_step(rows, "eval", "m_acc"))
    # the final checkpoint's weights, byte for byte
    latest = CheckpointStore(storage).list()[-1]
    got = client.download_artifacts(run_id, "checkpoint/model.pt", str(tmp_path / "dl"))
    assert pathlib.Path(got).read_bytes() == storage.read_bytes(f"{step_dir(latest.step)}/model.pt")

    # TensorBoard's own reader on <run>/tensorboard: the same values (stored as float32)
    acc = EventAccumulator(f"{first.run_url}/tensorboard")
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("train/loss")} == pytest.approx(steps, rel=1e-6)
    assert {e.step: e.value for e in acc.Scalars("epoch/samples_per_s")} == pytest.approx(
        last_by_step(rows, "epoch", "samples_per_s"), rel=1e-6
    )
    assert {"train/step_time_s", "train/checkpoint_stall_s", "train/world_size", "train/attempt"} <= set(
        acc.Tags()["scalars"]
    )
    assert {e.step: e.value for e in acc.Scalars("eval/loss")} == pytest.approx(evals, rel=1e-6)
    assert {"eval/bits_per_char", "eval/seconds"} <= set(acc.Tags()["scalars"])
    # the goodput account: its running total at each epoch's end, and the run's at its end
    (final,) = [e for e in read_events(storage) if e["event"] == "goodput"]
    assert first.goodput is not None and first.goodput.ettr == pytest.approx(final["ettr"], abs=0.01)
    ettr = history(client, run_id, "goodput/ettr")
    assert len(ettr) == 2 and all(0 < v <= 1 for v in ettr.values())  # epoch 1's, then the end's
    assert ettr[first.global_step] == pytest.approx(final["ettr"])
    assert history(client, run_id, "goodput/productive_s")[first.global_step] == pytest.approx(
        final["seconds"]["productive"]
    )
    assert {e.step: e.value for e in acc.Scalars("goodput/ettr")} == pytest.approx(ettr, rel=1e-5)
    assert {"goodput/starting_s", "goodput/checkpoint_stall_s"} <= set(acc.Tags()["scalars"])

    # resubmitted with one more epoch: the same MLflow run goes on, on the same step axis
    second = train(
        load_config("jobs/configs/tiny_cpu.yaml", [*overrides, "training.epochs=3"]), out=io.StringIO()
    )
    assert second.global_step > first.global_step
    assert mlflow_run_id(storage) == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["submissions"] == "2"
    assert run.data.params["training.epochs"] == "2" and run.data.tags["changed.training.epochs"] == "3"
    rows = read_metrics(storage).to_pylist()
    assert history(client, run_id, "train/loss") == pytest.approx(last_by_step(rows, "step"))
    assert max(history(client, run_id, "train/loss")) == second.global_step
    acc = EventAccumulator(f"{first.run_url}/tensorboard")
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("train/loss")} == pytest.approx(
        last_by_step(rows, "step"), rel=1e-6
    )


class OutageGroup(RowsGroup):
    """Stops the MLflow server when epoch 1 ends and starts it again when epoch 3 ends."""

    server: MlflowServer

    def poll(self, timeout: float) -> Any:
        results = super().poll(timeout)
        if results and results[0].epoch == 1:
            self.server.stop()
        if results and results[0].epoch == 3:
            self.server.start()
        return results


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_tracking_server_down_mid_run_never_stops_training(
    mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver through its scripted-group seam, tracking to a real server that is killed after epoch 1
    and back after epoch 3: training goes on meanwhile, a warning event says so, and every metric row
    reaches MLflow once the server is back."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setattr("cluster.driver.tracking.BACKOFF_MAX_S", 2.0)
    OutageGroup.server = mlflow_server
    driver, _ = make(
        {0: ["ok", "ok", Failure("worker_died", 1, "worker_died:rank 1 died")]},
        [
            "training.epochs=6",
            f"tracking.mlflow_uri={mlflow_server.uri}",
            "tracking.flush_timeout_s=120",
        ],
        resume={1: 8},
        group_cls=OutageGroup,
    )
    result = driver.run()
    assert result.status == "finished"
    ev = driver.events.records()
    names = [e["event"] for e in ev]
    assert "tracking_error" in names and "tracking_resumed" in names, names
    down, up = names.index("tracking_error"), names.index("tracking_resumed")
    assert down < up
    assert names[down:up].count("epoch_end") >= 1  # epochs ended while the server was down
    assert "tracking_incomplete" not in names
    assert ev[down]["sink"] == "mlflow" and ev[down]["error"]

    run_id = mlflow_run_id(driver.storage)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    rows = read_metrics(driver.storage).to_pylist()
    assert history(client, run_id, "train/loss") == pytest.approx(last_by_step(rows, "step"))
    assert history(client, run_id, "epoch/loss") == pytest.approx(last_by_step(rows, "epoch"))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["failures_survived"] == "1" and run.data.tags["attempts"] == "2"
