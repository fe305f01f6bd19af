"""Asking a running job to do something, from anywhere that can write its storage: stop cleanly, or say
where every rank is (their stacks).

``python -m cluster stop RUN`` (or ``cluster.request_stop(run_url)``) writes
``<run>/control/stop.json``. The job's driver looks for it while the ranks train (at most every
``STOP_POLL_S``), stops every rank at the same step boundary with a checkpoint there, writes a ``stopped``
event and ends with status ``stopped``. A resubmission of the same job resumes from that checkpoint
exactly. The driver removes the request once it has acted on it; a request older than the driver (left by a
stop that found no job) is removed unread.

``python -m cluster stacks RUN`` (or :func:`write_stacks_request`) writes ``<run>/control/stacks.json``; the
driver takes every rank's thread stacks, writes them to ``<run>/diagnostics/`` and a ``stacks`` event naming
the request's id, then removes the request.

Ctrl-C and ``ray job stop`` (SIGINT, SIGTERM) reach the same stop through the driver's signal handlers
(:func:`cluster.driver.train`); a second signal stops at once, as before.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from cluster.storage import Storage

logger = logging.getLogger(__name__)

CONTROL = "control"
STOP_FILE = f"{CONTROL}/stop.json"
STACKS_FILE = f"{CONTROL}/stacks.json"
PROFILE_FILE = f"{CONTROL}/profile.json"
ANSWERED = (STACKS_FILE, PROFILE_FILE)
"""Requests the driver answers (and removes) while the ranks train; ``STOP_FILE`` ends the job instead."""
STOP_POLL_S = 5.0
"""While the ranks train, the driver lists ``control/`` at most once per this many seconds (one storage
listing; on an object store, one LIST request)."""


@dataclass(frozen=True)
class StopRequest:
    reason: str
    """Who asked and how: ``SIGTERM``, ``SIGINT``, or ``python -m cluster stop by user@host``."""
    requested_at: float


DRIVER_FILE = "driver.json"
DRIVER_BEAT_S = 30.0
"""The driver rewrites ``driver.json`` (host, pid, state, step, time) this often while it runs, from a
thread of its own, whatever its main loop is doing. ``list`` and ``show`` tell a running job from one
whose driver is gone by its age."""
DRIVER_GONE_S = 3 * DRIVER_BEAT_S + 30.0
"""A driver not heard of for this long is gone (three missed beats, and a slow write's margin)."""


class DriverBeat:
    """The driver's presence in storage: ``start`` writes ``driver.json`` at once and every
    ``DRIVER_BEAT_S`` after; ``stop`` writes it a last time with ``ended`` set. ``snapshot`` is called on
    the beat's thread and returns the fields to write (state, step): plain reads of the driver."""

    def __init__(self, run: Storage, snapshot: Any, every_s: float = DRIVER_BEAT_S) -> None:
        self.run = run
        self.snapshot = snapshot
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged = False
        self.started = time.time()

    def start(self) -> None:
        self._write(ended=False)
        self._thread = threading.Thread(target=self._loop, name="cluster-driver-beat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._write(ended=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._write(ended=False)

    def _write(self, ended: bool) -> None:
        body = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": self.started,
            "time": time.time(),
            "every_s": self.every_s,
            "ended": ended,
            **self.snapshot(),
        }
        try:
            self.run.write_atomic(DRIVER_FILE, json.dumps(body).encode())
        except Exception as exc:  # storage down: the next beat tries again; training goes on
            if not self._logged:
                logger.warning("could not write %s: %s: %s", DRIVER_FILE, type(exc).__name__, exc)
                self._logged = True


def driver_seen(run: Storage) -> dict[str, Any] | None:
    """What the run's driver last wrote (``DriverBeat``), with ``age_s``; None for runs from before it or
    when it cannot be read."""
    try:
        data = json.loads(run.read_bytes(DRIVER_FILE))
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("time"), (int, float)):
        return None
    return {**data, "age_s": max(0.0, time.time() - float(data["time"]))}


def request_stop(
    run_url: str, storage_options: dict[str, Any] | None = None, reason: str | None = None
) -> StopRequest:
    """Ask the job training the run at ``run_url`` (``<storage.url>/<name>``) to stop at its next step with
    a checkpoint there. Returns at once; the job's ``stopped`` event says where it stopped (module doc)."""
    return write_stop_request(Storage(run_url, storage_options), reason)


def write_stop_request(run: Storage, reason: str | None = None) -> StopRequest:
    who = f"{_user()}@{socket.gethostname()}"
    req = StopRequest(reason or f"python -m cluster stop by {who}", time.time())
    run.write_atomic(STOP_FILE, json.dumps({"reason": req.reason, "requested_at": req.requested_at}).encode())
    return req


def read_stop_request(run: Storage) -> StopRequest | None:
    """The pending request, or None. A file that does not parse counts as a request (someone asked)."""
    try:
        raw = run.read_bytes(STOP_FILE)
    except FileNotFoundError:
        return None
    try:
        data: Any = json.loads(raw)
        return StopRequest(str(data["reason"]), float(data["requested_at"]))
    except (ValueError, KeyError, TypeError):
        logger.warning("%s does not parse; taking it as a stop request", run.url(STOP_FILE))
        return StopRequest(f"{STOP_FILE} (unreadable)", time.time())


def clear_stop_request(run: Storage) -> None:
    """Remove the request (acted on, or stale); a missing file is fine."""
    run.rm(STOP_FILE)


def pending(run: Storage) -> set[str]:
    """The requests waiting in ``control/``, by path (``STOP_FILE``, ``STACKS_FILE``)."""
    return {f"{CONTROL}/{name}" for name in run.listdir(CONTROL)}


def write_stacks_request(run: Storage) -> str:
    """Ask the job training ``run`` for every rank's stacks; returns the request's id, which the job's
    ``stacks`` event names."""
    return _write_request(run, STACKS_FILE, {})


def write_profile_request(run: Storage, steps: int, ranks: list[int] | None) -> str:
    """Ask the job training ``run`` to profile ``steps`` steps on ``ranks`` (None: every rank); returns the
    request's id, which its ``profile_requested`` event and the folder of its files name."""
    return _write_request(run, PROFILE_FILE, {"steps": steps, "ranks": ranks})


def read_request(run: Storage, path: str) -> dict[str, Any] | None:
    """A pending request (``id``, ``by``, ``requested_at`` and its own fields), or None. An unreadable one
    still counts (someone asked): it reads as ``{}``."""
    try:
        data: Any = json.loads(run.read_bytes(path))
    except FileNotFoundError:
        return None
    except ValueError:
        logger.warning("%s does not parse; answering it with defaults", run.url(path))
        return {}
    return data if isinstance(data, dict) else {}


def take_request(run: Storage, path: str) -> dict[str, Any]:
    """Read and remove a request."""
    data = read_request(run, path) or {}
    run.rm(path)
    return data


def _write_request(run: Storage, path: str, fields: dict[str, Any]) -> str:
    req_id = uuid.uuid4().hex[:12]
    body = {"id": req_id, "by": f"{_user()}@{socket.gethostname()}", "requested_at": time.time(), **fields}
    run.write_atomic(path, json.dumps(body).encode())
    return req_id


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's anonymous uid)
        return "unknown"
