"""Storage URLs, checked and joined as strings (never through ``pathlib``, which mangles ``s3://``): whether a
URL can hold runs (:func:`url_problem`, naming the fix), local paths made absolute, paths joined, and relative
paths kept inside their root. Only the protocol registry of fsspec is asked; nothing is contacted."""

from __future__ import annotations

import os
import re

import fsspec
from fsspec.registry import known_implementations
from fsspec.registry import registry as registered_protocols

from cluster.core.errors import StorageError

PIP_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "abfs": "azure", "az": "azure"}
"""fsspec protocol -> this package's pip extra that installs its backend."""

_NOT_STORAGE = {
    "http": "read-only over HTTP",
    "https": "read-only over HTTP",
    "zip": "an archive (read-only)",
    "tar": "an archive (read-only)",
    "libarchive": "an archive (read-only)",
    "data": "an inline data URL (read-only)",
    "github": "read-only",
    "gist": "read-only",
    "git": "read-only",
    "reference": "a read-only reference set",
    "blockcache": "a cache layer, not storage",
    "cached": "a cache layer, not storage",
    "filecache": "a cache layer, not storage",
    "simplecache": "a cache layer, not storage",
    "dask": "a view of dask workers' disks, not shared storage",
    "generic": "not a storage backend",
}
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):(.*)$", re.S)
_LOCAL_PROTOCOLS = ("file", "local")


def url_problem(url: str, key: str = "storage.url") -> str | None:
    """Why ``url`` cannot hold runs, naming the fix; None when it can. Pure syntax plus an import check of
    the protocol's fsspec backend: nothing is created or contacted. Messages never repeat credentials."""
    u = url.strip()
    if not u:
        return f"{key} is empty; set it to a folder or an fsspec URL such as s3://bucket/runs"
    if "::" in u:
        return f"{key}={u!r} chains fsspec protocols ('::'); give one protocol, e.g. s3://bucket/runs"
    if "://" not in u:
        m = _SCHEME_RE.match(u)
        if m is None or os.path.exists(os.path.expanduser(u)):
            return None
        scheme, rest = m.groups()
        if scheme.lower() in known_implementations or rest.startswith("/"):
            example = f"{scheme}://{rest.lstrip('/') or 'bucket/runs'}"
            return (
                f"{key}={u!r} is not a URL: '{scheme}:' must be followed by '//' (write {example}); "
                f"for a local folder with a colon in its name, write ./{u}"
            )
        return (
            f"{key}={u!r} looks like a URL with protocol {scheme!r} but has no '//', and no such local "
            f"folder exists; write a URL such as s3://bucket/runs, or ./{u} for a new local folder of "
            "that name"
        )
    scheme, _, rest = u.partition("://")
    proto = scheme.lower()
    host = rest.split("/", 1)[0]
    if "@" in host:
        shown = f"{scheme}://***@{host.rsplit('@', 1)[1]}/..."
        return (
            f"{key}={shown} has credentials in it; remove them from the URL and give them in "
            "storage.options (key/secret, token) or the environment (AWS_ACCESS_KEY_ID, "
            "GOOGLE_APPLICATION_CREDENTIALS): URLs are logged and written to run.json, options are not"
        )
    if proto in _LOCAL_PROTOCOLS:
        if not rest.strip("/"):
            return f"{key}={u!r} names no folder; write {scheme}:///absolute/path or a plain path"
        return None
    if proto not in known_implementations and proto not in registered_protocols:
        return (
            f"{key}={u!r}: unknown storage protocol {scheme!r}; use a local folder or an fsspec URL "
            "(s3://, gs://, abfs://, ...); see fsspec's known_implementations"
        )
    if proto in _NOT_STORAGE:
        return (
            f"{key}={u!r}: {scheme}:// is {_NOT_STORAGE[proto]}, and a run must write checkpoints; use a "
            "local folder, a shared mount, or an object store (s3://, gs://, abfs://)"
        )
    if proto == "memory":
        if not rest.strip("/"):
            return f"{key}={u!r} names no folder; write memory://NAME"
        return None
    if not host and not _local_protocol(proto):
        return (
            f"{key}={u!r} names no bucket or host after '{scheme}://'; write {scheme}://BUCKET/prefix "
            f"(e.g. {scheme}://my-bucket/runs)"
        )
    try:
        fsspec.get_filesystem_class(proto)
    except ImportError as exc:
        extra = PIP_EXTRAS.get(proto)
        fix = (
            f"pip install 'cluster[{extra}]'"
            if extra
            else f"install its fsspec backend ({known_implementations.get(proto, {}).get('err') or exc})"
        )
        return f"{key}={u!r}: the fsspec backend for {scheme}:// is not installed; {fix}"
    return None


def _local_protocol(proto: str) -> bool:
    """Whether ``proto``'s filesystem is local paths under another name (``local_file``, as fsspec's own
    local filesystem): its URLs name a folder, not a bucket."""
    try:
        return bool(getattr(fsspec.get_filesystem_class(proto), "local_file", False))
    except (ImportError, ValueError):
        return False


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


def check_relative(rel: str) -> str:
    """Return ``rel`` if it names a path inside a root; raise StorageError for anything that could escape
    it (``..`` segments, absolute paths, URLs, backslashes, NUL)."""
    bad = (
        rel.startswith("/")
        or "://" in rel
        or "\\" in rel
        or "\x00" in rel
        or any(part == ".." for part in rel.split("/"))
    )
    if bad:
        raise StorageError(f"refusing storage path {rel!r}: it would leave the run's folder")
    return rel
