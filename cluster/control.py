"""Asking a running job to stop cleanly, from anywhere that can write its storage.

``python -m cluster stop RUN`` (or ``cluster.request_stop(run_url)``) writes
``<run>/control/stop.json``. The job's driver looks for it while the ranks train (at most every
``STOP_POLL_S``), stops every rank at the same step boundary with a checkpoint there, writes a ``stopped``
event and ends with status ``stopped``. A resubmission of the same job resumes from that checkpoint
exactly. The driver removes the request once it has acted on it; a request older than the driver (left by a
stop that found no job) is removed unread.

Ctrl-C and ``ray job stop`` (SIGINT, SIGTERM) reach the same stop through the driver's signal handlers
(:func:`cluster.driver.train`); a second signal stops at once, as before.
"""

from __future__ import annotations

import getpass
import json
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

from cluster.storage import Storage

logger = logging.getLogger(__name__)

STOP_FILE = "control/stop.json"
STOP_POLL_S = 5.0
"""While the ranks train, the driver reads the stop request's file at most once per this many seconds (one
small storage read; on an object store, one HEAD request)."""


@dataclass(frozen=True)
class StopRequest:
    reason: str
    """Who asked and how: ``SIGTERM``, ``SIGINT``, or ``python -m cluster stop by user@host``."""
    requested_at: float


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
    try:
        run.rm(STOP_FILE)
    except FileNotFoundError:
        pass


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's anonymous uid)
        return "unknown"
