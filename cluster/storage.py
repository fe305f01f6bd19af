"""fsspec, imported in one place. URLs are plain strings (never pathlib, which mangles ``s3://``).

Everything that touches run storage goes through :class:`Storage`: one filesystem object, one root,
retries with backoff and jitter for transient errors, and error messages with credentials removed.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
from fsspec.core import url_to_fs

from cluster.errors import StorageError

T = TypeVar("T")

_SECRET_RE = re.compile(r"(?i)(secret|token|password|key|credential)[^=:\s]*\s*[=:]\s*\S+")


def normalize_url(url: str) -> str:
    """Make a local path absolute so every process agrees on it; leave URLs with a protocol alone."""
    if "://" in url:
        return url.rstrip("/")
    return os.path.abspath(os.path.expanduser(url))


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://") or url.startswith("local://")


def join(base: str, *parts: str) -> str:
    out = base.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def redact(text: str, options: dict[str, Any] | None = None) -> str:
    """Remove secrets (storage option values, key=value credentials) from a message."""
    for value in (options or {}).values():
        if isinstance(value, str) and len(value) >= 4:
            text = text.replace(value, "***")
        elif isinstance(value, dict):
            text = redact(text, value)
    return _SECRET_RE.sub(lambda m: m.group(0).split("=")[0].split(":")[0] + "=***", text)


class Storage:
    """A root URL plus its filesystem. Paths given to methods are relative to the root."""

    def __init__(
        self, root: str, options: dict[str, Any] | None = None, retries: int = 5, backoff_s: float = 0.5
    ) -> None:
        self.root = normalize_url(root)
        self.options = dict(options or {})
        self.retries = retries
        self.backoff_s = backoff_s
        try:
            fs, path = url_to_fs(self.root, **self.options)
        except (ImportError, ValueError) as exc:
            raise StorageError(
                f"cannot open storage {self.root!r}: {redact(str(exc), self.options)}. "
                "Install the fsspec backend for this protocol (s3fs for s3://, gcsfs for gs://)"
            ) from None
        self.fs: fsspec.AbstractFileSystem = fs
        self.path: str = path.rstrip("/") or "/"

    def url(self, rel: str = "") -> str:
        return join(self.root, rel) if rel else self.root

    def _p(self, rel: str) -> str:
        return join(self.path, rel) if rel else self.path

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``; retry transient errors with exponential backoff and jitter; FileNotFoundError is final."""
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise
            except Exception as exc:
                if attempt == self.retries:
                    raise StorageError(
                        f"{what} failed after {self.retries + 1} attempts: "
                        f"{type(exc).__name__}: {redact(str(exc), self.options)}"
                    ) from None
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 10.0)
                self.fs.invalidate_cache()
        raise AssertionError("unreachable")  # pragma: no cover

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self._p(rel)

        def put() -> None:
            parent = path.rsplit("/", 1)[0]
            if parent:
                self.fs.makedirs(parent, exist_ok=True)
            self.fs.pipe_file(path, data)

        self.retry(f"writing {self.url(rel)}", put)

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write so that readers see the old content or the new, never a torn file."""
        if is_local(self.root):
            tmp = f"{rel}.tmp-{os.getpid()}-{random.randrange(1 << 30)}"
            self.write_bytes(tmp, data)
            self.retry(f"renaming {self.url(tmp)}", lambda: self.fs.mv(self._p(tmp), self._p(rel)))
        else:  # an object store's PUT is atomic: the object appears whole or not at all
            self.write_bytes(rel, data)

    def read_bytes(self, rel: str) -> bytes:
        return self.retry(f"reading {self.url(rel)}", lambda: self.fs.cat_file(self._p(rel)))

    def exists(self, rel: str) -> bool:
        return bool(self.retry(f"checking {self.url(rel)}", lambda: self.fs.exists(self._p(rel))))

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
