"""A filesystem that breaks on purpose: a real fsspec filesystem (local, or s3fs against moto) underneath,
failing at the Nth write, move or delete, or failing every read for a window.

The product is used as it is: a :class:`~cluster.run.storage.Storage` opened on ``faultfile:///abs/path`` (a
local folder) or ``fault://bucket/prefix`` (any other fsspec protocol, named in ``target_protocol``) gets
this filesystem from fsspec's own registry, with the :class:`Faults` plan in its options::

    faults = Faults(at=("write", 3), crash=True)
    Storage("fault://bucket/runs/r", {"faults": faults, "target_protocol": "s3", "target_options": opts})

``crash``: the Nth operation raises and so does everything after it, reads included (the writer is gone);
otherwise only the Nth operation fails. Writes are ``pipe_file``, ``open`` for writing and ``copy``; moves
``mv``; deletes ``rm``/``rm_file``. ``Faults.counts`` says how many of each kind an operation made, so a
test can walk every injection point.

Two more plans: :meth:`Faults.fail` fails the next operations of a kind on some paths (a refused delete, a
lost connection), and :meth:`Faults.corrupt_writes` is silent write corruption: the write is acknowledged
and storage keeps other bytes (one byte flipped) than it was given.
"""

from __future__ import annotations

import math
import time
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.registry import register_implementation

KINDS = ("write", "move", "delete", "read")


class InjectedFault(ConnectionError):
    """What storage raises at an injection point: transient-looking, so the product retries it."""


class Faults:
    """Where to break. ``at``: (kind, n), the n-th (from 1) operation of that kind; ``reads_down``: every
    read fails while true; :meth:`read_outage`: for a window of time."""

    def __init__(self, at: tuple[str, int] | None = None, crash: bool = False) -> None:
        self.at = at
        self.crash = crash
        self.counts = dict.fromkeys(KINDS, 0)
        self.fired = False
        self.crashed = False
        self.reads_down = False
        self._down_until = 0.0
        self._down_paths = ""
        self._refuse_paths, self._refuse_left = "", 0
        self._fail: dict[str, tuple[str, int]] = {}
        self._corrupt_paths, self._corrupt_left = "", 0
        self.corrupted: list[str] = []
        """The paths whose written bytes were corrupted, in order."""

    def refuse_writes(self, paths: str, times: int) -> None:
        """Refuse (PermissionError: storage does not retry it) the next ``times`` writes of a path that
        contains ``paths``."""
        self._refuse_paths, self._refuse_left = paths, times

    def fail(self, kind: str, paths: str, times: int = 1) -> None:
        """Fail (a transient-looking :class:`InjectedFault`) the next ``times`` operations of ``kind`` on a
        path that contains ``paths``."""
        assert kind in KINDS, kind
        self._fail[kind] = (paths, times)

    def corrupt_writes(self, paths: str, times: int = 1 << 30) -> None:
        """Silent write corruption: the next ``times`` writes of a path that contains ``paths`` succeed, but
        storage keeps their bytes with one byte flipped (what a faulty disk, controller or gateway does)."""
        self._corrupt_paths, self._corrupt_left = paths, times

    def corrupt(self, what: str, data: bytes) -> bytes:
        """``data`` as storage will keep it for a write of ``what``."""
        if not self._corrupt_left or self._corrupt_paths not in what or not data:
            return data
        self._corrupt_left -= 1
        self.corrupted.append(what)
        out = bytearray(data)
        out[len(out) // 2] ^= 0x5A
        return bytes(out)

    def read_outage(self, seconds: float = math.inf, paths: str = "") -> None:
        """Fail every read (of a path containing ``paths``) for the next ``seconds``."""
        self._down_until, self._down_paths = time.monotonic() + seconds, paths

    def hit(self, kind: str, what: str) -> None:
        if self.crashed:
            raise InjectedFault(f"the writer is gone (crashed earlier); refused {kind} of {what}")
        self.counts[kind] += 1
        outage = self.reads_down or (time.monotonic() < self._down_until and self._down_paths in what)
        if kind == "read" and outage:
            raise InjectedFault(f"injected read outage: {what}")
        if kind == "write" and self._refuse_left and self._refuse_paths in what:
            self._refuse_left -= 1
            raise PermissionError(f"injected refusal: {what}")
        paths, left = self._fail.get(kind, ("", 0))
        if left and paths in what:
            self._fail[kind] = (paths, left - 1)
            raise InjectedFault(f"injected failure of {kind}: {what}")
        if self.at == (kind, self.counts[kind]):
            self.fired = True
            self.crashed = self.crash
            raise InjectedFault(f"injected fault at {kind} #{self.counts[kind]}: {what}")

    def __repr__(self) -> str:  # fsspec tokenizes options with str(): one plan, one stable token
        return f"Faults(at={self.at}, crash={self.crash})"


class FaultFS(AbstractFileSystem):
    """``fault://``: every call goes to ``target_protocol``'s filesystem after :meth:`Faults.hit`."""

    protocol = "fault"
    cachable = False  # each Storage gets its own plan

    def __init__(
        self,
        faults: Faults | None = None,
        target_protocol: str = "file",
        target_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.faults = faults or Faults()
        self.inner: AbstractFileSystem = fsspec.filesystem(target_protocol, **(target_options or {}))

    # writes
    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self.faults.hit("write", path)
        self.inner.pipe_file(path, self.faults.corrupt(path, value), **kwargs)

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        writing = any(c in mode for c in "wax+")
        self.faults.hit("write" if writing else "read", path)
        fh = self.inner.open(path, mode, **kwargs)
        return _CorruptingFile(fh, self.faults, path) if writing and "b" in mode else fh

    def copy(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.faults.hit("write", f"{path1} -> {path2}")
        self.inner.copy(path1, path2, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.inner.makedirs(path, exist_ok=exist_ok)  # no data: not an injection point

    # moves and deletes
    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.faults.hit("move", f"{path1} -> {path2}")
        self.inner.mv(path1, path2, **kwargs)

    def rm(self, path: str, recursive: bool = False, **kwargs: Any) -> None:
        self.faults.hit("delete", path)
        self.inner.rm(path, recursive=recursive, **kwargs)

    def rm_file(self, path: str) -> None:
        self.faults.hit("delete", path)
        self.inner.rm_file(path)

    # reads
    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> Any:
        self.faults.hit("read", path)
        return self.inner.cat_file(path, start=start, end=end, **kwargs)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self.faults.hit("read", path)
        return self.inner.ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        self.faults.hit("read", path)
        return self.inner.info(path, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        self.faults.hit("read", path)
        return bool(self.inner.exists(path, **kwargs))

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.faults.hit("read", path)
        return self.inner.find(path, *args, **kwargs)

    def size(self, path: str) -> Any:
        self.faults.hit("read", path)
        return self.inner.size(path)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.inner.invalidate_cache(path)


class _CorruptingFile:
    """A file opened for writing whose ``write`` passes the bytes through :meth:`Faults.corrupt`; everything
    else (``flush``, ``fileno`` for an fsync, closing) is the real file's."""

    def __init__(self, fh: Any, faults: Faults, path: str) -> None:
        self._fh, self._faults, self._path = fh, faults, path

    def write(self, data: bytes) -> int:
        return int(self._fh.write(self._faults.corrupt(self._path, bytes(data))))

    def __enter__(self) -> _CorruptingFile:
        self._fh.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._fh.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


class LocalFaultFS(FaultFS):
    """``faultfile:///abs/path``: a local folder (its paths are the OS's: renames and fsync as on disk)."""

    protocol = "faultfile"
    local_file = True

    def __init__(self, faults: Faults | None = None, **kwargs: Any) -> None:
        kwargs.pop("target_protocol", None)
        super().__init__(faults, target_protocol="file", **kwargs)


register_implementation("fault", FaultFS, clobber=True)
register_implementation("faultfile", LocalFaultFS, clobber=True)
