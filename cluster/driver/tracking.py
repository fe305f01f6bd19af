"""Send a run's metrics and events to the tools users watch runs with (the sinks of
:mod:`cluster.driver.sinks`: TensorBoard, MLflow, a webhook).

The driver hands every metric row it writes to Parquet, and every event it appends, to a ``Tracker``;
nothing here runs on a training step's path, and nothing here can stop training. Each sink has its own
thread and a bounded queue (the oldest items are dropped, and counted, when it is full). A sink that
fails (server down, slow, refusing writes) is retried with backoff; the driver records ``tracking_error``
when a sink starts failing and ``tracking_resumed`` when it works again, and at the end waits at most
``tracking.flush_timeout_s`` for what is queued (``tracking_incomplete`` says what was left unsent).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cluster.core.redact import redact_text
from cluster.driver.sinks import (  # the sinks are imported from here by the run record
    Item,
    MlflowSink,
    Sink,
    TensorBoardSink,
    WebhookSink,
    flatten,
    scalars,
)

logger = logging.getLogger(__name__)

BATCH = 500
"""Items per send: MLflow's log_batch takes at most 1,000 metrics."""
BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0


class _Feeder:
    """One sink's thread and bounded queue. Sends in order; on an error keeps the batch, waits (backoff) and
    sends it again, so an outage costs time in this thread only."""

    def __init__(self, sink: Sink, maxlen: int, note: Callable[..., None]) -> None:
        self.sink = sink
        self.maxlen = maxlen
        self.note = note
        self.queue: collections.deque[Item] = collections.deque()
        self.cond = threading.Condition()
        self.dropped = 0
        self.closing = False
        self.deadline = float("inf")  # set by stop(): a failing sink gives up then, not at process exit
        self.opened = False
        self.failing: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"cluster-tracking-{sink.name}", daemon=True)
        self.thread.start()

    def put(self, item: Item) -> None:
        with self.cond:
            if len(self.queue) >= self.maxlen:
                self.queue.popleft()
                self.dropped += 1
            self.queue.append(item)
            self.cond.notify()

    def pending(self) -> int:
        with self.cond:
            return len(self.queue)

    def _run(self) -> None:
        delay = BACKOFF_S
        while True:
            with self.cond:
                while not self.queue and not self.closing:
                    self.cond.wait()
                if not self.queue and self.closing:
                    break
                batch = list(itertools.islice(self.queue, BATCH))
            try:
                if not self.opened:
                    self.sink.open()
                    self.opened = True
                self.sink.send(batch)
            except Exception as exc:
                why = redact_text(f"{type(exc).__name__}: {str(exc)[:500]}")  # a URI's token, a key
                if self.failing is None:
                    logger.warning(
                        "tracking to %s failed, retrying in the background: %s", self.sink.name, why
                    )
                    self.note("tracking_error", sink=self.sink.name, error=why, pending=self.pending())
                self.failing = why
                if time.monotonic() >= self.deadline:
                    break  # closed and out of time: what is left is reported by Tracker.close
                with self.cond:
                    self.cond.wait(min(delay, max(0.0, self.deadline - time.monotonic())))
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            last = batch[-1].seq
            with self.cond:
                while self.queue and self.queue[0].seq <= last:
                    self.queue.popleft()
            if self.failing is not None:
                logger.warning("tracking to %s works again", self.sink.name)
                self.note("tracking_resumed", sink=self.sink.name, pending=self.pending())
                self.failing = None
            delay = BACKOFF_S
        if self.opened:
            try:
                self.sink.close()
            except Exception as exc:
                logger.warning(
                    "closing tracking sink %s failed: %s: %s",
                    self.sink.name,
                    type(exc).__name__,
                    redact_text(str(exc)),
                )

    def stop(self, deadline: float) -> None:
        with self.cond:
            self.closing = True
            self.deadline = deadline
            self.cond.notify_all()
        self.thread.join(max(0.0, deadline - time.monotonic()))


class Tracker:
    """Fans rows and events out to the configured sinks. Every method returns at once."""

    def __init__(self, sinks: list[Sink], queue_size: int, flush_timeout_s: float) -> None:
        self.flush_timeout_s = flush_timeout_s
        self._notes: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._feeders = [_Feeder(s, queue_size, self._note) for s in sinks]

    def _note(self, event: str, **fields: Any) -> None:
        with self._lock:
            self._notes.append((event, fields))

    def notes(self) -> list[tuple[str, dict[str, Any]]]:
        """Events the sinks asked the driver to record (``tracking_error``, ``tracking_resumed``)."""
        with self._lock:
            out, self._notes = self._notes, []
        return out

    def _put(self, kind: str, data: dict[str, Any]) -> None:
        self._seq += 1
        for f in self._feeders:
            f.put(Item(self._seq, kind, data))

    def rows(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self._put("row", row)

    def event(self, record: dict[str, Any]) -> None:
        self._put("event", record)

    def close(self, summary: dict[str, Any]) -> dict[str, Any] | None:
        """Queue the final summary (status, attempts, failures survived, the final checkpoint), wait at
        most ``flush_timeout_s`` for every sink; return what was left unsent or dropped, if anything."""
        self._put("finish", summary)
        deadline = time.monotonic() + self.flush_timeout_s
        for f in self._feeders:
            f.stop(deadline)
        left = {f.sink.name: f.pending() for f in self._feeders if f.pending() or f.thread.is_alive()}
        dropped = {f.sink.name: f.dropped for f in self._feeders if f.dropped}
        if not left and not dropped:
            return None
        logger.warning(
            "tracking incomplete after %.0fs: unsent %s, dropped (queue full) %s",
            self.flush_timeout_s,
            left,
            dropped,
        )
        return {"unsent": left, "dropped": dropped}


__all__ = [
    "BACKOFF_MAX_S",
    "BACKOFF_S",
    "BATCH",
    "Item",
    "MlflowSink",
    "Sink",
    "TensorBoardSink",
    "Tracker",
    "WebhookSink",
    "flatten",
    "scalars",
]
