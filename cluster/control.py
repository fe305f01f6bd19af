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
import socket
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
