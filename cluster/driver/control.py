"""The driver's side of the run's requests (the files are ``cluster.run.requests``'): stop cleanly, say
where every rank is (their stacks), profile some steps; and ``driver.json``, the driver's presence.

``python -m cluster stop RUN`` (or ``cluster.request_stop(run_url)``) writes
``<run>/control/stop.json``. The job's driver looks for it while the ranks train (at most every
``STOP_POLL_S``), stops every rank at the same step boundary with a checkpoint there, writes a ``stopped``
event and ends with status ``stopped``. A resubmission of the same job resumes from that checkpoint
exactly. The driver removes the request once it has acted on it; a request older than the driver (left by a
stop that found no job) is removed unread.

``python -m cluster stacks RUN`` (or ``cluster.run.requests.write_stacks_request``) writes
``<run>/control/stacks.json``; the driver takes every rank's thread stacks, writes them to
``<run>/diagnostics/`` and a ``stacks`` event naming the request's id, then removes the request.

Ctrl-C and ``ray job stop`` (SIGINT, SIGTERM) reach the same stop through the driver's signal handlers
(:func:`cluster.api.train.train`); a second signal stops at once, as before.

:class:`RunControl` is the driver's side of all of this: the stop asked for (by a signal, the stop file or
``training.time_limit_s``) and the requests it must answer while ranks train (stacks, profiles).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cluster.core.errors import StorageError
from cluster.run.folder import RunFolder
from cluster.run.requests import (
    DRIVER_BEAT_S,
    DRIVER_FILE,
    MAX_STEPS,
    PROFILE_FILE,
    STACKS_FILE,
    STOP_FILE,
    StopRequest,
    clear_stop_request,
    pending,
    read_request,
    read_stop_request,
    take_request,
)
from cluster.run.storage import Storage

if TYPE_CHECKING:
    from cluster.core.stacks import ThreadStack
    from cluster.driver.record import RunRecord
    from cluster.seam.protocol import WorkerGroup

logger = logging.getLogger(__name__)

ANSWERED = (STACKS_FILE, PROFILE_FILE)
"""Requests the driver answers (and removes) while the ranks train; ``STOP_FILE`` ends the job instead."""
STACKS_TIMEOUT_S = 5.0
"""How long the driver waits for the ranks' stacks; a rank that did not answer by then is named silent."""
STOP_POLL_S = 5.0
"""While the ranks train, the driver lists ``control/`` at most once per this many seconds (one storage
listing; on an object store, one LIST request)."""


class DriverBeat:
    """The driver's presence in storage: ``start`` writes ``driver.json`` at once and every
    ``DRIVER_BEAT_S`` after; ``stop`` writes it a last time with ``ended`` set. ``snapshot`` is called on
    the beat's thread and returns the fields to write (state, step): plain reads of the driver."""

    def __init__(
        self,
        run: Storage,
        snapshot: Any,
        every_s: float = DRIVER_BEAT_S,
        fence: Callable[[], None] | None = None,
    ) -> None:
        self.run = run
        self.fence = fence
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
            if self.fence is not None:
                self.fence()  # a driver that was taken over no longer says it runs the job
            self.run.write_atomic(DRIVER_FILE, json.dumps(body).encode())
        except Exception as exc:  # storage down: the next beat tries again; training goes on
            if not self._logged:
                logger.warning("could not write %s: %s: %s", DRIVER_FILE, type(exc).__name__, exc)
                self._logged = True


class RunControl:
    """The driver's view of the run's requests (module doc). ``stop`` is set once a stop is asked for; the
    stop file is read without retries, so a storage outage never stalls the loop that watches the ranks."""

    def __init__(self, run: Storage, time_limit_s: float | None) -> None:
        self.storage = RunFolder(run).unretried()
        self.time_limit_s = time_limit_s
        self.started_at = time.time()
        self.stop: StopRequest | None = None
        self._next_check = 0.0  # while ranks train
        self._next_wait_check = 0.0  # while no group trains
        self._error_logged = False

    def request_stop(self, reason: str) -> None:
        """Only sets a field: safe from a signal handler or another thread."""
        if self.stop is None:
            self.stop = StopRequest(reason, time.time())

    def clear_stale(self, run: Storage) -> None:
        """Before the driver starts: requests from before it (nothing answered them then) are removed."""
        stale = read_stop_request(run)
        if stale is not None and stale.requested_at <= self.started_at:
            logger.warning(
                "removing a stop request from before this job started (%s, %s): no job was running then",
                stale.reason,
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stale.requested_at)),
            )
            clear_stop_request(run)
        for path in ANSWERED:
            asked = read_request(run, path)
            if asked is not None and _time_of(asked, path) <= self.started_at:
                logger.warning("removing %s, from before this job started: no job was running then", path)
                take_request(run, path)

    def watch(self) -> list[tuple[str, dict[str, Any]]]:
        """While ranks train: read ``control/`` (at most every ``STOP_POLL_S``) and the time limit; returns
        the requests to answer now (``STACKS_FILE`` / ``PROFILE_FILE`` with what was asked)."""
        now = time.time()
        asked: list[tuple[str, dict[str, Any]]] = []
        if now >= self._next_check:
            self._next_check = now + STOP_POLL_S
            asked = self._read(group_requests=True)
        self._check_time_limit(now)
        return asked

    def stop_asked(self) -> bool:
        """While no group trains (backing off, waiting for room): whether the run is asked to stop (a
        signal, the stop file read at most every ``STOP_POLL_S``, ``training.time_limit_s``)."""
        now = time.time()
        if self.stop is None and now >= self._next_wait_check:
            self._next_wait_check = now + STOP_POLL_S
            self._read(group_requests=False)
        self._check_time_limit(now)
        return self.stop is not None

    def _check_time_limit(self, now: float) -> None:
        limit = self.time_limit_s
        if limit is not None and now - self.started_at >= limit:
            self.request_stop(f"training.time_limit_s={limit:g} reached")

    def _read(self, group_requests: bool) -> list[tuple[str, dict[str, Any]]]:
        """One listing of ``control/``: a stop asked for, stacks and profiles asked for (taken, to be
        answered at once). Without ``group_requests`` (no group trains) only a stop is taken; the others
        wait for the ranks. Storage trouble only delays them."""
        asked: list[tuple[str, dict[str, Any]]] = []
        try:
            found = pending(self.storage)
            if STOP_FILE in found and self.stop is None:
                req = read_stop_request(self.storage)
                if req is not None:
                    self.request_stop(req.reason)
            if group_requests:
                for path in (STACKS_FILE, PROFILE_FILE):
                    if path in found:
                        asked.append((path, take_request(self.storage, path)))
        except StorageError as exc:  # storage down: the next poll tries again; training goes on
            if not self._error_logged:
                logger.warning("could not read the run's control requests: %s", exc)
                self._error_logged = True
        return asked

    def clear_stop(self, run: Storage) -> None:
        """The stop was acted on: remove its file (the next submission removes it as stale otherwise)."""
        try:
            clear_stop_request(run)
        except StorageError as exc:
            logger.warning("could not remove the stop request file: %s", exc)


def answer_requests(
    control: RunControl,
    group: WorkerGroup,
    record: RunRecord,
    world_size: int,
    step: int,
    attempt: int,
    hosts: list[str],
) -> None:
    """Answer the stacks and profile requests found while the ranks train (``RunControl.watch``)."""
    for path, asked in control.watch():
        if path == STACKS_FILE:
            by = asked.get("by", "python -m cluster stacks")
            dump_stacks(group, record, f"asked for by {by}", "request", step, attempt, hosts, asked.get("id"))
        elif path == PROFILE_FILE:
            start_profile(group, record, asked, world_size, step, attempt)


def dump_stacks(
    group: WorkerGroup,
    record: RunRecord,
    reason: str,
    kind: str,
    step: int | None,
    attempt: int,
    hosts: list[str],
    request: str | None = None,
) -> dict[int, list[ThreadStack] | None] | None:
    """Every rank's thread stacks to ``diagnostics/`` (the full report), a ``stacks`` event (where each
    group of ranks stands) and console lines; returns them (rank -> threads, None: no answer), or None when
    they could not be taken. Never raises: it serves a diagnosis, and must not stand in the way of the
    recovery that follows a hang."""
    from cluster.core import stacks as stack_dump

    storage = record.storage
    stacks: dict[int, list[ThreadStack] | None] | None = None
    try:
        raw = group.stacks(STACKS_TIMEOUT_S)
        stacks = {r: stack_dump.from_wire(x) if x is not None else None for r, x in enumerate(raw)}
        groups, silent = stack_dump.group(stacks)
        rel = f"diagnostics/stacks_{time.strftime('%Y%m%d-%H%M%S')}_attempt{attempt}_{kind}.txt"
        storage.write_atomic(rel, stack_dump.render(reason, stacks, hosts, step).encode())
        record.event(
            "stacks",
            reason=reason,
            kind=kind,
            step=step,
            attempt=attempt,
            request=request,
            path=rel,
            groups=[{"ranks": g.ranks, "where": g.where} for g in groups],
            silent=silent,
            url=storage.url(rel),
        )
    except Exception as exc:  # a diagnosis that fails is logged; the run goes on
        logger.warning("could not take the ranks' stacks: %s: %s", type(exc).__name__, exc)
    return stacks


def start_profile(
    group: WorkerGroup, record: RunRecord, asked: dict[str, Any], world_size: int, step: int, attempt: int
) -> None:
    """Hand a profile request to the ranks it names (``cluster.rank.profiling``); they write the files."""
    req_id = str(asked.get("id") or uuid.uuid4().hex[:12])
    steps, ranks = profile_request(asked, world_size)
    folder = f"profiles/{time.strftime('%Y%m%d-%H%M%S')}-{req_id}"
    group.profile(req_id, steps, ranks, folder)
    record.event(
        "profile_requested",
        request=req_id,
        by=asked.get("by"),
        ranks=ranks,
        steps=steps,
        folder=folder,
        url=record.storage.url(folder),
        step=step,
        attempt=attempt,
    )


def _time_of(asked: dict[str, Any], path: str) -> float:
    """A request's ``requested_at``; one that is missing or not a number counts as from before the driver
    (a warning says so): a malformed request never stops the job."""
    value = asked.get("requested_at", 0)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    logger.warning("%s: requested_at=%r is not a time; taking the request as stale", path, value)
    return 0.0


def profile_request(asked: dict[str, Any], world_size: int) -> tuple[int, list[int]]:
    """A profile request's steps and ranks, each in range; what does not parse is replaced by the default
    (every rank, 5 steps) with a warning: a malformed request never stops the job."""
    steps_asked = asked.get("steps") or 5
    try:
        steps = min(max(int(steps_asked), 1), MAX_STEPS)
    except (TypeError, ValueError):
        logger.warning("%s: steps=%r is not a number; profiling 5 steps", PROFILE_FILE, steps_asked)
        steps = 5
    wanted = asked.get("ranks")
    ranks: list[int] = []
    if isinstance(wanted, list):
        for r in wanted:
            if isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world_size:
                ranks.append(r)
            else:
                logger.warning("%s: rank %r is not a rank of this group; left out", PROFILE_FILE, r)
    elif wanted is not None:
        logger.warning("%s: ranks=%r is not a list of ranks; profiling every rank", PROFILE_FILE, wanted)
    return steps, sorted(set(ranks)) or list(range(world_size))


def grace_note(reason: str) -> str:
    """Under ``ray job submit``, ``ray job stop`` SIGKILLs the driver RAY_JOB_STOP_WAIT_TIME_S (3 by default)
    after its SIGTERM: say how long the stop has, and how to give it more."""
    if reason != "SIGTERM" or "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        return ""
    wait = os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", "3")
    return (
        f" (`ray job stop` kills this driver {wait}s after its SIGTERM; a longer RAY_JOB_STOP_WAIT_TIME_S in "
        "the job's runtime_env env_vars gives the checkpoint time to commit)"
    )
