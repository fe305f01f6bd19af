"""Where tracking sends a run's rows and events: TensorBoard event files, an MLflow run, a webhook.

Each sink is driven by its own thread in :class:`cluster.driver.tracking.Tracker` (which retries a failing
one); here is only how an item becomes a scalar, a text, a tag or a POST. Names: a step row's values go to
``train/<column>`` (``loss``, ``lr``, ``grad_norm``, ``peak_mem_gib``, ``samples_per_s``, ``step_time_s``,
``input_wait_s``, ``checkpoint_stall_s``, ``world_size``, ``attempt`` and every ``m_<name>`` as
``train/<name>``), an epoch row's to ``epoch/<column>``, an evaluation's to ``eval/loss``, ``eval/<name>``
and ``eval/seconds``; the goodput account (``cluster.run.goodput``) at each epoch's end and the run's end to
``goodput/ettr`` and ``goodput/<class>_s``; the x axis is the global step, so a resumed or recovered run
continues one curve.
Failures, decisions and recoveries are text (TensorBoard; the kinds ``cluster.core.events`` marks
``tensorboard``) or tags (MLflow); a notification is ``[run] `` and the event's line
(``cluster.core.events``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.core import events
from cluster.core.redact import redact_text, redact_tree, redact_url
from cluster.core.urls import is_local
from cluster.run.storage import Storage

logger = logging.getLogger(__name__)

VALUE_COLUMNS = (
    "loss",
    "lr",
    "grad_norm",
    "peak_mem_gib",
    "samples_per_s",
    "step_time_s",
    "input_wait_s",
    "checkpoint_stall_s",
    "world_size",
    "attempt",
)


def scalars(row: dict[str, Any]) -> Iterable[tuple[str, float]]:
    """(name, value) of one metric row, named as the module docstring says."""
    if row.get("kind") == "eval":  # an evaluation: its loss, metrics and duration
        if row.get("loss") is not None:
            yield "eval/loss", float(row["loss"])
        if row.get("step_time_s") is not None:
            yield "eval/seconds", float(row["step_time_s"])
        for key, value in row.items():
            if key.startswith("m_") and value is not None:
                yield f"eval/{key[2:]}", float(value)
        return
    prefix = "epoch" if row.get("kind") == "epoch" else "train"
    for key, value in row.items():
        if value is None or isinstance(value, str):
            continue
        if key in VALUE_COLUMNS:
            yield f"{prefix}/{key}", float(value)
        elif key.startswith("m_"):
            yield f"{prefix}/{key[2:]}", float(value)


def goodput_scalars(record: dict[str, Any]) -> Iterable[tuple[str, float]]:
    """``goodput/ettr`` and ``goodput/<class>`` (seconds) of an event that carries the goodput account: each
    ``epoch_end`` (the running total) and the final ``goodput`` event (``cluster.run.goodput``)."""
    g = record.get("goodput") if record.get("event") == "epoch_end" else record
    if record.get("event") not in ("epoch_end", "goodput") or not isinstance(g, dict):
        return
    if isinstance(g.get("ettr"), int | float):
        yield "goodput/ettr", float(g["ettr"])
    for cls, seconds in (g.get("seconds") or {}).items():
        yield f"goodput/{cls}_s", float(seconds)


def event_step(record: dict[str, Any], default: int) -> int:
    for key in ("global_step", "step", "resume_step", "at_step"):
        value = record.get(key)
        if isinstance(value, int):
            return value
    return default


@dataclass
class Item:
    seq: int
    kind: str  # "row" | "event" | "finish"
    data: dict[str, Any]


class Sink(Protocol):
    name: str

    def open(self) -> None: ...

    def send(self, items: list[Item]) -> None: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------- TensorBoard
class TensorBoardSink:
    """Event files under ``<run>/tensorboard/``: written in place on a local folder; elsewhere staged in a
    local temporary folder and uploaded (whole files, at epoch ends, events and the close: object stores
    cannot append). One file per group start, named so that TensorBoard reads them in order; a start that
    resumes at step S marks S+1 as a restart (TensorBoard's purge), so the steps a failure undid and that
    were trained again show once, as trained the second time."""

    name = "tensorboard"

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.local = is_local(storage.root)
        self.logdir = (
            f"{storage.path}/tensorboard" if self.local else tempfile.mkdtemp(prefix="cluster-tensorboard-")
        )
        self.writer: Any = None
        self.step = 0
        self._uploaded: dict[str, int] = {}

    def open(self) -> None:
        os.makedirs(self.logdir, exist_ok=True)

    def _writer(self, purge_step: int | None = None) -> Any:
        from tensorboardX import SummaryWriter

        if self.writer is not None and purge_step is None:
            return self.writer
        if self.writer is not None:
            self.writer.close()
        suffix = f".{int(time.time() * 1000):013d}.{os.getpid()}"
        self.writer = SummaryWriter(self.logdir, purge_step=purge_step, flush_secs=30, filename_suffix=suffix)
        return self.writer

    def send(self, items: list[Item]) -> None:
        flush = False
        for item in items:
            if item.kind == "row":
                step = int(item.data.get("global_step") or 0)
                self.step = max(self.step, step)
                writer = self._writer()
                for tag, value in scalars(item.data):
                    writer.add_scalar(tag, value, step, walltime=item.data.get("time"))
                flush |= item.data.get("kind") in ("epoch", "eval")
            elif item.kind == "event":
                record = item.data
                if record.get("event") == "group_started":
                    resume = int(record.get("resume_step") or 0)
                    self._writer(purge_step=resume + 1 if resume else 0)
                    self.step = resume
                for tag, value in goodput_scalars(record):
                    self._writer().add_scalar(
                        tag, value, event_step(record, self.step), walltime=record.get("time")
                    )
                if record.get("event") in events.TENSORBOARD:
                    step = event_step(record, self.step)
                    self._writer().add_text(
                        "events", redact_text(events.detail(record)), step, walltime=record.get("time")
                    )
                    flush = True
            else:
                flush = True
        if flush and self.writer is not None:
            self.writer.flush()
            self._upload()

    def _upload(self) -> None:
        if self.local:
            return
        for name in sorted(os.listdir(self.logdir)):
            path = os.path.join(self.logdir, name)
            size = os.path.getsize(path)
            if self._uploaded.get(name) != size:
                with open(path, "rb") as fh:
                    self.storage.write_bytes(f"tensorboard/{name}", fh.read())
                self._uploaded[name] = size

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self._upload()


# ----------------------------------------------------------------------------------------------- MLflow
TRACKING_FILE = "tracking.json"
"""The run's MLflow run (``mlflow_uri``, ``mlflow_run_id``), so a resubmission continues it. A file of its
own: the driver rewrites ``run.json`` while the sink works on its own thread."""


def mlflow_run_id(storage: Storage) -> str | None:
    """The run's MLflow run id: ``tracking.json``, or ``run.json``'s ``tracking`` for runs of earlier
    versions; None before the first."""
    for rel, pick in ((TRACKING_FILE, lambda d: d), ("run.json", lambda d: d.get("tracking") or {})):
        try:
            data = json.loads(storage.read_bytes(rel))
        except FileNotFoundError:
            continue
        found = pick(data).get("mlflow_run_id") if isinstance(data, dict) else None
        if found:
            return str(found)
    return None


class MlflowSink:
    """One MLflow run per run of this product: created at the first send (or continued: its id is kept in
    ``run.json`` under ``tracking``), the resolved config as params (redacted: ``cluster.core.redact``; a
    value a resubmission changed goes to a ``changed.<key>`` tag, as MLflow refuses to change a param),
    metrics by global step, tags ``status``, ``attempts``, ``failures_survived``, ``submissions``, and the
    final checkpoint's ``model.pt`` as the artifact ``checkpoint/model.pt``."""

    name = "mlflow"

    def __init__(
        self,
        uri: str,
        experiment: str,
        storage: Storage,
        config: dict[str, Any],
        run_name: str,
        history: list[dict[str, Any]],
    ) -> None:
        self.uri = uri
        self.experiment = experiment
        self.storage = storage
        self.config = redact_tree(config, known=False)  # to_dict's already; a caller's own dict too
        self.run_name = run_name
        self.run_id: str | None = None
        self.client: Any = None
        self.counts = {"group_started": 0, "recovered": 0, "run_start": 0}
        for record in history:  # earlier submissions of this run, as the event log holds them
            self._count(record)
        self._tags_sent: dict[str, str] = {}

    def _count(self, record: dict[str, Any]) -> None:
        if record.get("event") in self.counts:
            self.counts[record["event"]] += 1

    def _tags(self) -> dict[str, str]:
        return {
            "attempts": str(self.counts["group_started"]),
            "failures_survived": str(self.counts["recovered"]),
            "submissions": str(self.counts["run_start"]),
        }

    def open(self) -> None:
        # MLflow's own HTTP retries (7, backoff up to minutes) would hide an outage inside one call; this
        # sink retries itself, so each call tries twice at most and gives up after 10 s.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        if redact_url(self.uri) != self.uri:  # MLflow prints the run's URL, token and all, at its end
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        known = mlflow_run_id(self.storage)
        run = None
        if known:
            try:
                run = client.get_run(known)
            except Exception as exc:
                logger.warning("MLflow run %s of this run is gone (%s); starting a new one", known, exc)
        if run is None:
            exp = client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
            run = client.create_run(
                exp_id, run_name=self.run_name, tags={"cluster.run_url": redact_url(self.storage.root)}
            )
            body = {"mlflow_uri": redact_url(self.uri), "mlflow_run_id": run.info.run_id}
            self.storage.write_atomic(TRACKING_FILE, json.dumps(body, indent=1).encode())
        else:
            client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        have = run.data.params
        flat = dict(flatten(self.config))
        params = [Param(k, v) for k, v in flat.items() if k not in have]
        changed = [RunTag(f"changed.{k}", v) for k, v in flat.items() if k in have and have[k] != v]
        for i in range(0, max(len(params), len(changed)), 100):
            client.log_batch(self.run_id, params=params[i : i + 100], tags=changed[i : i + 100])
        client.set_tag(self.run_id, "status", "RUNNING")
        self.client = client

    def send(self, items: list[Item]) -> None:
        from mlflow.entities import Metric, RunTag

        metrics: list[Metric] = []
        finish: dict[str, Any] | None = None
        for item in items:
            if item.kind == "row":
                ts = int(float(item.data.get("time") or time.time()) * 1000)
                step = int(item.data.get("global_step") or 0)
                metrics.extend(Metric(k, v, ts, step) for k, v in scalars(item.data))
            elif item.kind == "event":
                self._count(item.data)
                ts = int(float(item.data.get("time") or time.time()) * 1000)
                step = event_step(item.data, 0)
                metrics.extend(Metric(k, v, ts, step) for k, v in goodput_scalars(item.data))
            else:
                finish = item.data
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        tags = self._tags()
        if tags != self._tags_sent:
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            self._tags_sent = tags
        if finish is not None:
            self._finish(finish)

    def _finish(self, summary: dict[str, Any]) -> None:
        status = str(summary.get("status", "finished"))
        self.client.set_tag(self.run_id, "status", status.upper())
        checkpoint = summary.get("checkpoint")
        if checkpoint:
            with tempfile.TemporaryDirectory(prefix="cluster-mlflow-") as tmp:
                path = os.path.join(tmp, "model.pt")
                with open(path, "wb") as fh:
                    fh.write(self.storage.read_bytes(f"{checkpoint}/model.pt"))
                self.client.log_artifact(self.run_id, path, "checkpoint")
            self.client.set_tag(self.run_id, "checkpoint", redact_url(f"{self.storage.root}/{checkpoint}"))
        # MLflow's KILLED: ended by the user, not failed (a stop asked for; resumable)
        terminal = {"finished": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, terminal)

    def close(self) -> None:
        pass


def flatten(data: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, str]]:
    """A nested config as ``(dotted.key, value)`` strings; MLflow keeps a param value up to 6,000 chars."""
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from flatten(value, f"{prefix}{key}.")
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            yield f"{prefix}{key}", text[:6000]


# ------------------------------------------------------------------------------------------------ webhook
class WebhookSink:
    """Notifications: one JSON POST per event of ``tracking.notify_events`` to ``tracking.notify_url``:
    ``{"text": <one line>, "run": name, "run_url": url, "event": <the event's record>}``. Chat tools take
    ``text`` and ignore the rest; anything else can read the record. Sent from the tracking thread, retried
    with backoff by it (an unreachable webhook costs that thread's time only), each event once."""

    name = "webhook"

    def __init__(
        self, url: str, events: list[str], run_name: str, run_url: str, timeout_s: float = 10.0
    ) -> None:
        self.url = url
        self.events = set(events)
        self.run_name = run_name
        self.run_url = run_url
        self.timeout_s = timeout_s
        self._sent = 0  # the highest item sequence number sent: a batch retried after an error skips them

    def open(self) -> None:
        pass

    def send(self, items: list[Item]) -> None:
        import urllib.request

        for item in items:
            if item.seq <= self._sent:
                continue
            record = item.data
            if item.kind == "event" and record.get("event") in self.events:
                body = redact_tree(  # the record's error texts, a run URL's credentials
                    {
                        "text": f"[{self.run_name}] {events.line(record.get('event'), record)}",
                        "run": self.run_name,
                        "run_url": self.run_url,
                        "event": record,
                    }
                )
                req = urllib.request.Request(
                    self.url,
                    data=json.dumps(body, default=str).encode(),
                    headers={"Content-Type": "application/json"},
                    method="POST",
                )
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    resp.read()
            self._sent = item.seq

    def close(self) -> None:
        pass
