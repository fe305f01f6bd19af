"""The checkpoint store: write, commit, list, verify, load, retain; plus the asynchronous writer.

Commit protocol (``checkpoints/step_NNNNNNNNN/``): every file is written first, then ``manifest.json``
with the sha256 and size of each file, last and atomically. A checkpoint exists only once its manifest
does and its checksums verify; "latest" is the highest verified step, and a torn or corrupt one is skipped
(and reported), never loaded. Retention deletes a manifest before its files. Loading uses
``torch.load(..., weights_only=True)``: a checkpoint is data, never code.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.errors import CheckpointError, StorageError
from cluster.storage import Storage

MANIFEST = "manifest.json"
CKPT_DIR = "checkpoints"
FORMAT_VERSION = 1


def step_dir(step: int) -> str:
    return f"{CKPT_DIR}/step_{step:09d}"


def _parse_step(name: str) -> int | None:
    if not name.startswith("step_"):
        return None
    try:
        return int(name[5:])
    except ValueError:
        return None


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint (its manifest exists); ``verified`` only after checksums were checked."""

    step: int
    url: str
    manifest: dict[str, Any]

    @property
    def epoch(self) -> int:
        return int(self.manifest.get("epoch", 0))

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.manifest.get("files", {}).values())


@dataclass
class LoadedCheckpoint:
    info: CheckpointInfo
    files: dict[str, Any]
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """(step, reason) of newer checkpoints that were skipped because they failed verification."""


def serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def deserialize(data: bytes) -> Any:
    """Load with ``weights_only=True``: tensors and plain containers only; pickled code is refused."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


class CheckpointStore:
    """Checkpoints of one run, under ``<run_url>/checkpoints/``."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.last_skipped: list[tuple[int, str]] = []
        """(step, reason) of every checkpoint the last ``load_latest`` passed over, newest first."""

    def commit(self, step: int, files: dict[str, bytes], meta: dict[str, Any]) -> CheckpointInfo:
        """Write every file, then the manifest last. Until the manifest lands the checkpoint does not exist.

        A manifest already at this step (a checkpoint re-written after a resume from an older one) is
        deleted first, so no reader ever pairs the old manifest with half-written new files.
        """
        d = step_dir(step)
        self.storage.rm(f"{d}/{MANIFEST}")
        entries = {}
        for name, data in files.items():
            self.storage.write_bytes(f"{d}/{name}", data)
            entries[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        manifest = {
            **meta,
            "step": step,
            "format": FORMAT_VERSION,
            "files": entries,
            "committed_at": time.time(),
        }
        self.storage.write_atomic(f"{d}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        return CheckpointInfo(step=step, url=self.storage.url(d), manifest=manifest)

    def steps_on_storage(self) -> list[int]:
        """Every step folder, committed or not, ascending."""
        steps = [_parse_step(n) for n in self.storage.listdir(CKPT_DIR)]
        return sorted(s for s in steps if s is not None)

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints (manifest present and parseable), ascending by step. Not checksummed."""
        out = []
        for step in self.steps_on_storage():
            info = self._info(step)
            if info is not None:
                out.append(info)
        return out

    def _info(self, step: int) -> CheckpointInfo | None:
        info, _ = self.read_manifest(step)
        return info

    def read_manifest(self, step: int) -> tuple[CheckpointInfo | None, str]:
        """The checkpoint at ``step``, or None and why it does not count as committed."""
        d = step_dir(step)
        url = self.storage.url(d)
        try:
            manifest = json.loads(self.storage.read_bytes(f"{d}/{MANIFEST}"))
        except FileNotFoundError:
            return None, f"{url} has no {MANIFEST}: its write never committed (torn or in flight)"
        except (ValueError, UnicodeDecodeError):
            return None, f"{url}/{MANIFEST} is not valid JSON (corrupted)"
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict) or not all(
            isinstance(e, dict) and "sha256" in e and "size" in e for e in files.values()
        ):
            return None, f"{url}/{MANIFEST} lacks a valid 'files' table (corrupted)"
        return CheckpointInfo(step=step, url=url, manifest=manifest), ""

    def read_verified(self, info: CheckpointInfo) -> dict[str, bytes]:
        """Read every file of a checkpoint and check size and sha256; raise CheckpointError on mismatch."""
        out = {}
        for name, entry in info.manifest["files"].items():
            try:
                data = self.storage.read_bytes(f"{step_dir(info.step)}/{name}")
            except FileNotFoundError:
                raise CheckpointError(f"{info.url}/{name} is missing") from None
            if len(data) != int(entry["size"]) or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise CheckpointError(f"{info.url}/{name} fails its checksum (torn or corrupted)")
            out[name] = data
        return out

    def load_latest(self, max_step: int | None = None) -> LoadedCheckpoint | None:
        """Load the highest verified checkpoint (at most ``max_step``), skipping and reporting bad ones.

        Every newer step folder passed over is reported with its reason, in ``skipped`` of the result and
        in ``self.last_skipped`` (also when nothing loadable is left and None is returned).
        """
        skipped: list[tuple[int, str]] = []
        self.last_skipped = skipped
        for step in reversed(self.steps_on_storage()):
            if max_step is not None and step > max_step:
                continue
            info, why = self.read_manifest(step)
            if info is None:
                skipped.append((step, why))
                continue
            try:
                raw = self.read_verified(info)
                files = {name: deserialize(data) for name, data in raw.items()}
            except (CheckpointError, StorageError) as exc:
                skipped.append((info.step, str(exc)))
                continue
            except Exception as exc:  # an unpickling refusal (weights_only) or a truncated stream
                skipped.append(
                    (info.step, f"{info.url} cannot be loaded safely: {type(exc).__name__}: {exc}")
                )
                continue
            return LoadedCheckpoint(info=info, files=files, skipped=skipped)
        return None

    def load_step(self, step: int) -> dict[str, Any]:
        info = self._info(step)
        if info is None:
            raise CheckpointError(
                f"checkpoint at step {step} has no manifest under {self.storage.url(CKPT_DIR)}"
            )
        return {name: deserialize(data) for name, data in self.read_verified(info).items()}

    def retain(self, keep_last: int, keep_best: bool = False, keep_every: int = 0) -> builtins.list[int]:
        """Delete all but the newest ``keep_last`` committed checkpoints (manifest first, then files), and,
        with ``keep_best``, the best-scored one (:func:`best_of`), and every one whose step is a multiple of
        ``keep_every`` (when positive).

        Uncommitted step folders older than the newest committed one are leftovers of torn writes and go
        too. Returns the deleted steps.
        """
        infos = self.list()
        committed = [i.step for i in infos]
        if not committed:
            return []
        keep = set(committed[-max(1, keep_last) :])
        best = best_of(infos) if keep_best else None
        if best is not None:
            keep.add(best.step)
        if keep_every > 0:
            keep.update(s for s in committed if s > 0 and s % keep_every == 0)
        newest = committed[-1]
        deleted = []
        for step in self.steps_on_storage():
            if step in keep or step > newest:
                continue
            self._delete(step)
            deleted.append(step)
        return deleted

    def _delete(self, step: int) -> None:
        d = step_dir(step)
        self.storage.rm(f"{d}/{MANIFEST}")  # first: a reader never sees a manifest without its files
        self.storage.rm(d, recursive=True)

    def discard_after(self, step: int) -> builtins.list[int]:
        """Delete every checkpoint newer than ``step`` (manifest first, then files): after a rollback they
        belong to a path the run no longer takes. Returns the deleted steps."""
        deleted = []
        for newer in self.steps_on_storage():
            if newer > step:
                self._delete(newer)
                deleted.append(newer)
        return deleted


def nonfinite(state: Any) -> str | None:
    """The name of the first floating-point tensor of a state dict holding a NaN or an infinity; None when
    every value is finite (or ``state`` is not a dict). One read of each tensor and no copy: its float64
    sum is NaN or infinite exactly when an element is (float32 or narrower values cannot overflow it)."""
    if not isinstance(state, dict):
        return None
    for name, t in state.items():
        floating = isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0
        if floating and not math.isfinite(float(t.sum(dtype=torch.float64))):
            return str(name)
    return None


def score_of(info: CheckpointInfo) -> tuple[str, str, float] | None:
    """(metric, mode, value) of the evaluation a checkpoint was scored by (``checkpoint.best_metric``); None
    when it was not (no evaluation at its step, or no best_metric)."""
    s = info.manifest.get("score")
    if not isinstance(s, dict) or s.get("mode") not in ("min", "max"):
        return None
    value = s.get("value")
    if not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return str(s.get("metric")), str(s["mode"]), float(value)


def best_of(infos: builtins.list[CheckpointInfo]) -> CheckpointInfo | None:
    """The best-scored checkpoint, by the metric and mode of the newest scored one (a run whose
    best_metric changed compares only like with like); on a tie the earliest step, the first to reach it."""
    scored = [(info, sc) for info in infos if (sc := score_of(info)) is not None]
    if not scored:
        return None
    metric, mode, _ = scored[-1][1]
    sign = 1.0 if mode == "min" else -1.0
    same = [(sign * v, info.step, info) for info, (m, md, v) in scored if (m, md) == (metric, mode)]
    return min(same, key=lambda t: (t[0], t[1]))[2]


def snapshot(obj: Any, pool: HostBuffers | None = None) -> Any:
    """A deep copy with every tensor copied to host memory: what the background writer may own.

    With a ``pool`` the copies land in host buffers kept from the previous snapshot (no allocation, no
    page faults: the copy runs at memory bandwidth), pinned when the source is on a GPU.
    """
    pool = pool if pool is not None else HostBuffers(reuse=False)
    out = pool.copy_tree(obj, ())
    pool.sync()
    return out


class HostBuffers:
    """Host tensors reused from one checkpoint to the next, keyed by their place in the state tree.

    Safe because the writer has at most one checkpoint in flight and waits for it before the next
    snapshot overwrites these buffers. Costs one host copy of the state, held for the run's lifetime.
    """

    def __init__(self, reuse: bool = True) -> None:
        self.reuse = reuse
        self._bufs: dict[tuple[Any, ...], torch.Tensor] = {}
        self._cuda = False

    def copy_tree(self, obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy(obj, path)
        if isinstance(obj, dict):
            return {k: self.copy_tree(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.copy_tree(v, (*path, i)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self.copy_tree(v, (*path, i)) for i, v in enumerate(obj))
        return obj

    def _copy(self, t: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        t = t.detach()
        buf = self._bufs.get(path) if self.reuse else None
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or t.is_sparse or t.is_quantized:
            if t.is_sparse or t.is_quantized or t.layout != torch.strided:
                return t.to("cpu", copy=True)
            pin = t.is_cuda
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            if self.reuse:
                self._bufs[path] = buf
        if t.is_cuda:
            self._cuda = True
            buf.copy_(t, non_blocking=True)
        else:
            buf.copy_(t)
        return buf

    def sync(self) -> None:
        """Wait for the device-to-host copies issued with ``non_blocking``."""
        if self._cuda:
            torch.cuda.synchronize()
            self._cuda = False


@dataclass
class CommitRecord:
    step: int
    epoch: int
    url: str
    bytes: int
    stall_s: float
    write_s: float
    error: str | None = None


class CheckpointWriter:
    """Rank 0's writer. ``save`` blocks only to copy state to host memory; the rest runs in a thread.

    At most one checkpoint is in flight (the next ``save`` waits for the previous: bounded memory). A
    write that fails is recorded with its error and never committed. ``close(flush=True)`` waits for the
    one in flight; ``close(flush=False)`` abandons it (its manifest is never written if not yet).
    """

    def __init__(
        self,
        store: CheckpointStore,
        keep_last: int,
        async_save: bool = True,
        on_commit: Callable[[CommitRecord], None] | None = None,
        keep_best: bool = False,
        refuse_nonfinite: bool = True,
        keep_every: int = 0,
    ) -> None:
        self.store = store
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.keep_every = keep_every
        self.refuse_nonfinite = refuse_nonfinite
        """Weights with a NaN or infinite value (a diverged run) are never committed, so retention never
        deletes the good checkpoints for them. Checked on the host copy, in the writing thread."""
        self.async_save = async_save
        self.on_commit = on_commit
        self.records: list[CommitRecord] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._abandon = False
        self._pool = HostBuffers()

    def save(self, step: int, epoch: int, meta: dict[str, Any], files: dict[str, Any]) -> float:
        """Checkpoint ``files`` (name -> object) at ``step``; return the seconds training was blocked."""
        t0 = time.perf_counter()
        self.wait()
        host = snapshot(files, self._pool)
        stall = time.perf_counter() - t0
        if self.async_save:
            self._thread = threading.Thread(
                target=self._write, args=(step, epoch, meta, host, stall), name=f"ckpt-{step}", daemon=True
            )
            self._thread.start()
        else:
            self._write(step, epoch, meta, host, stall)
            stall = time.perf_counter() - t0
            self.records[-1].stall_s = stall
        return stall

    def _write(self, step: int, epoch: int, meta: dict[str, Any], host: dict[str, Any], stall: float) -> None:
        t0 = time.perf_counter()
        record = CommitRecord(step=step, epoch=epoch, url="", bytes=0, stall_s=stall, write_s=0.0)
        try:
            bad = nonfinite(host.get("model.pt")) if self.refuse_nonfinite else None
            if bad is not None:
                raise CheckpointError(
                    f"the weights at step {step} are not finite (NaN or inf in {bad!r}): not committed, so "
                    "the checkpoints before it are kept"
                )
            blobs = {name: serialize(obj) for name, obj in host.items()}
            if self._abandon:
                return
            info = self.store.commit(step, blobs, {**meta, "epoch": epoch})
            record.url, record.bytes = info.url, info.total_bytes
            self.store.retain(self.keep_last, self.keep_best, self.keep_every)
        except Exception as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.write_s = time.perf_counter() - t0
        with self._lock:
            self.records.append(record)
        if self.on_commit is not None:
            self.on_commit(record)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def drain(self) -> list[CommitRecord]:
        """Records of writes finished since the last drain."""
        with self._lock:
            out, self.records = self.records, []
        return out

    def close(self, flush: bool = True) -> None:
        if not flush:
            self._abandon = True
        self.wait()
