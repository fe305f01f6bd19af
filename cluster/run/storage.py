"""fsspec's filesystems, opened in one place. URLs are plain strings (never pathlib, which mangles ``s3://``),
checked and joined by ``cluster.core.urls`` (which asks fsspec's protocol registry only).

Everything that touches run storage goes through :class:`Storage`: one filesystem object, one root,
retries with backoff and jitter for transient errors, and error messages with credentials removed.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
from fsspec.core import url_to_fs

from cluster.core.errors import StorageError
from cluster.core.redact import redact_text
from cluster.core.urls import check_relative, join, normalize_url, url_problem

logger = logging.getLogger(__name__)

T = TypeVar("T")


RETRIES = 5
"""Retries of a failed storage call, at least (the time budget below may allow more)."""
RETRY_BUDGET_S = 60.0
"""Keep retrying transient errors for at least this long: an object store's outage of tens of seconds
(a restart, a throttling burst) stalls a checkpoint instead of failing it."""
BACKOFF_S = 0.5
"""First retry delay; doubles per retry up to BACKOFF_MAX_S, each delay jittered by x0.5..1.5."""
BACKOFF_MAX_S = 8.0

PROBE = ".storage-probe.json"
PROBE_ENV = "CLUSTER_STORAGE_PROBE"
"""Environment variable that carries the driver's probe token to every worker (see ``check_probe``)."""

# Errors that retrying cannot fix. The first group is raised as it is (callers test for a missing file);
# the second becomes a StorageError at once.
_MISSING: tuple[type[BaseException], ...] = (FileNotFoundError, IsADirectoryError, NotADirectoryError)
_DENIED_NAMES = (
    "NoCredentialsError",
    "PartialCredentialsError",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
)


def redact(text: str, options: dict[str, Any] | None = None) -> str:
    """Remove secrets (storage option values at any depth, and all ``cluster.core.redact.redact_text`` hides)
    from a message."""
    return redact_text(text, options or {})


class Storage:
    """A root URL plus its filesystem. Paths given to methods are relative to the root."""

    def __init__(
        self,
        root: str,
        options: dict[str, Any] | None = None,
        retries: int | None = None,
        backoff_s: float | None = None,
        retry_budget_s: float | None = None,
    ) -> None:
        self.root = normalize_url(root)
        self.options = dict(options or {})
        self.retries = RETRIES if retries is None else retries
        self.backoff_s = BACKOFF_S if backoff_s is None else backoff_s
        self.retry_budget_s = RETRY_BUDGET_S if retry_budget_s is None else retry_budget_s
        problem = url_problem(root, "storage")
        if problem is not None:
            raise StorageError(problem)
        try:
            fs, path = url_to_fs(self.root, **self.options)
        except (ImportError, ValueError) as exc:
            raise StorageError(
                f"cannot open storage {self.root!r}: {redact(str(exc), self.options)}. "
                "Install the fsspec backend for this protocol (s3fs for s3://, gcsfs for gs://)"
            ) from None
        self.fs: fsspec.AbstractFileSystem = fs
        self.path: str = path.rstrip("/") or "/"
        self.local = bool(getattr(fs, "local_file", False))
        """Paths are the OS's own (a local disk or a shared mount): folders exist, a rename is atomic and
        an fsync makes a write durable. Otherwise an object store: a PUT is atomic, there are no folders."""
        self.reads = 0
        """Files read through this object (``read_bytes``), and their bytes: what a recovery read."""
        self.bytes_read = 0

    def url(self, rel: str = "") -> str:
        return join(self.root, check_relative(rel)) if rel else self.root

    def _p(self, rel: str) -> str:
        return join(self.path, check_relative(rel)) if rel else self.path

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``; retry transient errors with exponential backoff and jitter.

        Gives up once both ``retries`` retries were made and ``retry_budget_s`` has passed, so an outage
        shorter than the budget costs time, not the write. A missing file is raised as it is (final); refused
        permissions and missing credentials fail at once. The StorageError never carries an option's value.
        """
        delay = self.backoff_s
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                return fn()
            except _MISSING:
                raise
            except Exception as exc:
                attempt += 1
                elapsed = time.monotonic() - start
                denied = isinstance(exc, PermissionError) or type(exc).__name__ in _DENIED_NAMES
                if denied or (attempt > self.retries and elapsed >= self.retry_budget_s):
                    raise StorageError(
                        f"{what} failed after {attempt} attempts over {elapsed:.1f}s: "
                        f"{type(exc).__name__}: {redact(str(exc), self.options)}"
                        + (". Check the credentials in storage.options or the environment" if denied else "")
                    ) from None
                wait = delay * (0.5 + random.random())
                logger.warning(
                    "%s failed (attempt %d), retrying in %.1fs: %s: %s",
                    what,
                    attempt,
                    wait,
                    type(exc).__name__,
                    redact(str(exc), self.options),
                )
                time.sleep(wait)
                delay = min(delay * 2, BACKOFF_MAX_S)
                self.fs.invalidate_cache()

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a file. On a local filesystem it is on disk (fsync) when this returns, so a manifest
        published after it never names a file a power cut could still lose."""
        path = self._p(rel)

        def put() -> None:
            if self.local:  # object stores have no folders (and s3fs would create a missing bucket)
                self.fs.makedirs(path.rsplit("/", 1)[0] or "/", exist_ok=True)
                with self.fs.open(path, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
            else:
                self.fs.pipe_file(path, data)

        self.retry(f"writing {self.url(rel)}", put)

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write so that readers see the old content or the new, never a torn file (:meth:`write_all_atomic`
        of one file)."""
        self.write_all_atomic({rel: data})

    def write_all_atomic(self, files: dict[str, bytes]) -> None:
        """Write files so that readers see each one old or new, never torn; published in the given order.

        Locally: each to a temporary file beside it, fsynced, then the folders fsynced (the entries of the
        files written before, such as a checkpoint's data files, are durable before anything names them),
        then the renames that publish them, then the folders again (the renames themselves are durable).
        Every file is written before any is published, so a write that fails (a full disk) publishes none;
        the temporary files never outlive a failure. A failed fsync after the renames is a warning, not an
        error: the files are published, readers see them. On an object store each file is one PUT (atomic:
        it appears whole or not at all), in order."""
        if not self.local:
            for rel, data in files.items():
                self.write_bytes(rel, data)
            return
        tmps = {rel: f"{rel}.tmp-{os.getpid()}-{random.randrange(1 << 30)}" for rel in files}
        folders = sorted({self._p(rel).rsplit("/", 1)[0] or "/" for rel in files})
        try:
            for rel, data in files.items():
                self.write_bytes(tmps[rel], data)
            for folder in folders:
                self.retry(f"syncing {folder}", functools.partial(_fsync_folder, folder))
            for rel, tmp in tmps.items():
                rename = functools.partial(self.fs.mv, self._p(tmp), self._p(rel))
                self.retry(f"renaming {self.url(tmp)}", rename)
        except BaseException:  # (re-raised) whatever stopped it, the temporary files go
            for tmp in tmps.values():
                self._discard(tmp)
            raise
        for folder in folders:
            self._sync_after(folder, ", ".join(self.url(rel) for rel in files))

    def _discard(self, rel: str) -> None:
        """Remove a temporary file a failed write left; a failure to is logged (the write's own error is what
        the caller hears of)."""
        try:
            self.rm(rel)
        except StorageError as exc:
            logger.warning("could not remove the temporary file %s: %s", self.url(rel), exc)

    def _sync_after(self, folder: str, what: str) -> None:
        """Fsync a folder after a rename published ``what``: retried; when it keeps failing a warning, since
        readers see what was published already (only a power cut could still undo the rename)."""
        try:
            self.retry(f"syncing {folder}", lambda: _fsync_folder(folder))
        except StorageError as exc:
            logger.warning(
                "%s is published, but its folder could not be synced (a power cut may still undo it): %s",
                what,
                exc,
            )

    def move(self, src: str, dst: str, last: str | None = None) -> None:
        """Move the folder ``src`` to ``dst``, which must not exist yet.

        Locally one rename (atomic). On an object store every object is copied (``last``, e.g. a
        manifest, after the others) before any is deleted (``last`` first): a crash part way leaves
        ``src`` whole, or ``dst`` whole, never neither."""
        if self.local:
            parent = self._p(dst).rsplit("/", 1)[0] or "/"
            self.retry(f"creating {self.url(dst)}", lambda: self.fs.makedirs(parent, exist_ok=True))
            self.retry(
                f"moving {self.url(src)} to {self.url(dst)}",
                lambda: self.fs.mv(self._p(src), self._p(dst), recursive=True),
            )
            for folder in (parent, self._p(src).rsplit("/", 1)[0] or "/"):
                self._sync_after(folder, f"the move of {self.url(src)} to {self.url(dst)}")
            return
        base = self._p(src).strip("/")
        names = sorted(
            str(p).strip("/")[len(base) + 1 :]  # (some filesystems answer with a leading "/")
            for p in self.retry(f"listing {self.url(src)}", lambda: self.fs.find(self._p(src)))
        )
        order = sorted(names, key=lambda n: n == last)  # ``last`` copied last, deleted first
        for name in order:
            self._copy(f"{src}/{name}", f"{dst}/{name}")
        for name in reversed(order):
            self.rm(f"{src}/{name}")
        self.rm(src, recursive=True)

    def _copy(self, src: str, dst: str) -> None:
        self.retry(f"copying {self.url(src)}", lambda: self.fs.copy(self._p(src), self._p(dst)))

    def read_bytes(self, rel: str) -> bytes:
        path = self._p(rel)

        def cat() -> bytes:
            try:
                return bytes(self.fs.cat_file(path))
            except FileNotFoundError:
                # An object store's client answers "missing" from a listing it cached when the file was
                # created since by another process (s3fs does): look once more, past the cache.
                self.fs.invalidate_cache(path.rsplit("/", 1)[0])
                return bytes(self.fs.cat_file(path))

        data: bytes = self.retry(f"reading {self.url(rel)}", cat)
        self.reads += 1
        self.bytes_read += len(data)
        return data

    def exists(self, rel: str) -> bool:
        path = self._p(rel)

        def look() -> bool:
            if self.fs.exists(path):
                return True
            if self.local:
                return False
            self.fs.invalidate_cache(path.rsplit("/", 1)[0])  # as ``read_bytes``: past a cached listing
            return bool(self.fs.exists(path))

        return bool(self.retry(f"checking {self.url(rel)}", look))

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly under ``rel``; empty when it does not exist."""
        path = self._p(rel)

        def ls() -> list[str]:
            try:
                entries = self.fs.ls(path, detail=False, refresh=True)
            except FileNotFoundError:
                return []
            return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})

        return self.retry(f"listing {self.url(rel)}", ls)

    def size(self, rel: str) -> int:
        return int(self.retry(f"stat {self.url(rel)}", lambda: self.fs.size(self._p(rel))))

    def rm(self, rel: str, recursive: bool = False) -> None:
        def remove() -> None:
            try:
                self.fs.rm(self._p(rel), recursive=recursive)
            except FileNotFoundError:
                pass

        self.retry(f"deleting {self.url(rel)}", remove)

    def open_fs_path(self, rel: str) -> tuple[fsspec.AbstractFileSystem, str]:
        return self.fs, self._p(rel)


def _fsync_folder(path: str) -> None:
    """Make a local folder's entries (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_probe(storage: Storage) -> str:
    """Write a fresh random token to ``<run>/.storage-probe.json`` and return it.

    The driver calls this before starting workers; each worker then calls :func:`check_probe` with the
    token, which proves that the worker's node sees the very storage the driver writes to (a local path
    that exists on every node, but as separate disks, fails here instead of as a lost checkpoint later).
    """
    token = uuid.uuid4().hex
    body = {"token": token, "host": socket.gethostname(), "time": time.time()}
    storage.write_atomic(PROBE, json.dumps(body).encode())
    return token


def check_probe(storage: Storage, token: str, node: str | None = None) -> None:
    """Raise StorageError unless ``storage`` holds the probe written by :func:`write_probe` as ``token``."""
    node = node or socket.gethostname()
    hint = "use s3://, gs:// or a shared mount that every node sees"
    try:
        body = json.loads(storage.read_bytes(PROBE))
    except FileNotFoundError:
        raise StorageError(
            f"storage.url={storage.root} is not visible from node {node}: the driver's probe file "
            f"{PROBE} is missing there; {hint}"
        ) from None
    except ValueError:
        body = {}
    found = body.get("token") if isinstance(body, dict) else None
    if found != token:
        writer = body.get("host", "?") if isinstance(body, dict) else "?"
        raise StorageError(
            f"storage.url={storage.root} is not visible from node {node}: it holds a different probe "
            f"(written by {writer}) than the driver's; this node sees another folder of the same name; {hint}"
        )
