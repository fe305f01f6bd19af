"""The run's requests and the driver's presence, as files in the run's folder: what ``python -m cluster
stop|stacks|profile`` (or :func:`request_stop`) writes and the driver reads (``cluster.driver.control``), and
``driver.json``, which the driver rewrites while it runs and ``list``, ``show`` and the goodput account read.

- ``control/stop.json``: stop at the next step boundary with a checkpoint there;
- ``control/stacks.json``: take every rank's thread stacks;
- ``control/profile.json``: profile some steps on some ranks (at most ``MAX_STEPS``).
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

from cluster.run.folder import RunFolder
from cluster.run.storage import Storage

logger = logging.getLogger(__name__)

CONTROL = "control"
STOP_FILE = f"{CONTROL}/stop.json"
STACKS_FILE = f"{CONTROL}/stacks.json"
PROFILE_FILE = f"{CONTROL}/profile.json"

MAX_STEPS = 100
"""The most steps one request records (a trace grows with every step)."""


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


def driver_seen(run: Storage) -> dict[str, Any] | None:
    """What the run's driver last wrote (``cluster.driver.control.DriverBeat``), with ``age_s``; None for
    runs from before it or when it cannot be read."""
    try:
        data = json.loads(run.read_bytes(DRIVER_FILE))
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("time"), (int, float)):
        return None
    return {**data, "age_s": max(0.0, time.time() - float(data["time"]))}


def read_driver_file(run: Storage) -> dict[str, Any] | None:
    """The run's ``driver.json`` as its driver last wrote it (for the goodput account: the previous driver's
    last sign of life); None when there is none, or when it does not read (logged)."""
    try:
        data = json.loads(run.read_bytes(DRIVER_FILE))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("could not read %s for the goodput account: %s", DRIVER_FILE, exc)
        return None
    return data if isinstance(data, dict) else None


def request_stop(
    run_url: str, storage_options: dict[str, Any] | None = None, reason: str | None = None
) -> StopRequest:
    """Ask the job training the run at ``run_url`` (``<storage.url>/<name>``) to stop at its next step with
    a checkpoint there. Returns at once; the job's ``stopped`` event says where it stopped (module doc)."""
    return write_stop_request(RunFolder.at(run_url, storage_options).storage, reason)


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
