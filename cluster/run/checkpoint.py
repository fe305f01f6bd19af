"""The checkpoint store: write, commit, list, verify, load, retain; plus the asynchronous writer.

Commit protocol (``checkpoints/step_NNNNNNNNN/``): every file is written first, then ``manifest.json``
with the sha256 and size of each file, last and atomically. A checkpoint exists only once its manifest
does and its checksums verify; "latest" is the highest verified step, and a torn or corrupt one is skipped
(and reported), never loaded. Retention deletes a manifest before its files. Loading uses
``torch.load(..., weights_only=True)``: a checkpoint is data, never code.

What storage acknowledged is not taken on trust: a commit reads its checkpoint back (every file's sha256)
before it counts, and retention deletes nothing before the newest checkpoint it keeps was read back after
its commit (by that commit, or by the retention itself), so neither silent write corruption nor bit rot
after a commit can leave a run without a checkpoint that verifies. Each checkpoint is read back once in its
lifetime in the writer's path (at its commit), not at every retention. A commit's outcome is what a
reader sees: published and verifying is committed, whatever fails after it (retention's failure is a
warning, and retention runs again at the next commit).
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.core.errors import CheckpointError, StorageError
from cluster.core.urls import check_relative
from cluster.run.state_bytes import check_loadable as check_loadable
from cluster.run.state_bytes import deserialize as deserialize
from cluster.run.state_bytes import loader_reason
from cluster.run.state_bytes import nonfinite as nonfinite
from cluster.run.state_bytes import serialize as serialize
from cluster.run.storage import Storage

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CKPT_DIR = "checkpoints"
QUARANTINE = f"{CKPT_DIR}/quarantine"
DISCARDED = f"{CKPT_DIR}/discarded"
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


class CheckpointUnreadableError(StorageError):
    """The checkpoints could not be read (storage failed after its retries) or a verified one holds a state
    the safe loader refuses. Which state the run is in is unknown: a failure of the attempt, never a reason
    to start from an older checkpoint or from step 0."""


class CheckpointStore:
    """Checkpoints of one run, under ``<run_url>/checkpoints/``.

    ``list``/``load_latest`` see only ``step_N`` folders: ``quarantine/`` (checkpoints that failed
    verification, moved aside by :meth:`retain`) and ``discarded/`` (the best and milestones of a path a
    rollback left, set aside by :meth:`discard_after`) are kept for people, never resumed from.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.fence: Callable[[], None] | None = None
        """Called before a commit writes anything, again before its manifest, and before retention or a
        discard deletes: raises when this writer may no longer write (``cluster.run.lease``: another job took
        the run over)."""
        self.last_skipped: list[tuple[int, str]] = []
        """(step, reason) of every checkpoint the last ``load_latest`` passed over, newest first."""
        self.last_quarantined: list[tuple[int, str]] = []
        """(step, reason) of the checkpoints the last ``retain`` (or ``commit``, its own when it did not read
        back as written) moved to ``checkpoints/quarantine/``."""
        self.last_set_aside: list[int] = []
        """Steps the last ``discard_after`` moved to ``checkpoints/discarded/`` instead of deleting."""
        self._passed: set[tuple[int, str]] = set()
        """(step, checksums) of the checkpoints this object read back whole (its commits' read-backs,
        retention's): retention reads the best one back once, not at every commit. Never counted for the
        newest one a retention keeps: that one is read back after its commit, each time (:meth:`retain`)."""

    def commit(self, step: int, files: dict[str, bytes], meta: dict[str, Any]) -> CheckpointInfo:
        """Write every file, then the manifest last, then read the checkpoint back. Until the manifest lands
        the checkpoint does not exist; it is committed once what storage returns verifies.

        A manifest already at this step (a checkpoint re-written after a resume from an older one) is
        deleted first, so no reader ever pairs the old manifest with half-written new files. A checkpoint
        that does not read back as written (storage acknowledged the write and kept other bytes) is moved to
        ``checkpoints/quarantine/`` (``self.last_quarantined``) and a CheckpointError raised: the commit
        failed, whatever storage said. StorageError when storage fails, the read-back included.
        """
        d = step_dir(step)
        self.last_quarantined = []
        self._fenced()
        self.storage.rm(f"{d}/{MANIFEST}")
        self._clear_temporaries(d)
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
        body = json.dumps(manifest, indent=1).encode()
        self._fenced()  # (a takeover while the files were written)
        self.storage.write_atomic(f"{d}/{MANIFEST}", body)
        info = CheckpointInfo(step=step, url=self.storage.url(d), manifest=manifest)
        self._read_back(info, body)
        return info

    def _clear_temporaries(self, d: str) -> None:
        """Remove the temporary manifests a writer killed mid-publish left in a step folder being written
        again (a local folder's; an object store's manifest is one PUT, with no temporary)."""
        if not self.storage.local:
            return
        for name in self.storage.listdir(d):
            if name.startswith(f"{MANIFEST}.tmp-"):
                self.storage.rm(f"{d}/{name}")

    def _read_back(self, info: CheckpointInfo, body: bytes) -> None:
        """Read a checkpoint just written back from storage, manifest and files, and check them against
        what was written (sha256 of each file: no deserialisation). CheckpointError, after moving it aside,
        when storage holds other bytes."""
        try:
            stored: bytes | None = self.storage.read_bytes(f"{step_dir(info.step)}/{MANIFEST}")
        except FileNotFoundError:
            stored = None
        why = None
        if stored is None:
            why = f"{info.url}/{MANIFEST} is missing right after its write"
        elif stored != body:
            why = f"{info.url}/{MANIFEST} reads back other bytes than were written"
        else:
            try:
                self.read_verified(info)
            except CheckpointError as exc:
                why = str(exc)
        if why is None:
            self._passed.add(_key(info))
            return
        why = f"the checkpoint at step {info.step} does not read back as written: {why}"
        try:
            self._quarantine(info.step, f"{why} (storage returns other bytes than it acknowledged)")
        except StorageError as exc:
            logger.warning("could not move the checkpoint at step %d aside: %s", info.step, exc)
        raise CheckpointError(f"{why}; storage acknowledged the write but returns other bytes: not committed")

    def _fenced(self) -> None:
        if self.fence is not None:
            self.fence()

    def steps_on_storage(self) -> list[int]:
        """Every step folder, committed or not, ascending. StorageError when the listing fails."""
        steps = [_parse_step(n) for n in self.storage.listdir(CKPT_DIR)]
        return sorted(s for s in steps if s is not None)

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints (manifest present and parseable), ascending by step. Not checksummed.
        StorageError when the listing or a manifest cannot be read: never a shorter list."""
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
        """The checkpoint at ``step``, or None and why it does not count as committed. StorageError when
        the manifest cannot be read."""
        info, why, _ = self._manifest(step)
        return info, why

    def _manifest(self, step: int) -> tuple[CheckpointInfo | None, str, bool]:
        """As :meth:`read_manifest`, plus whether a manifest is there (a corrupt one, when info is None)."""
        d = step_dir(step)
        url = self.storage.url(d)
        try:
            manifest = json.loads(self.storage.read_bytes(f"{d}/{MANIFEST}"))
        except FileNotFoundError:
            return None, f"{url} has no {MANIFEST}: its write never committed (torn or in flight)", False
        except (ValueError, UnicodeDecodeError):
            return None, f"{url}/{MANIFEST} is not valid JSON (corrupted)", True
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict) or not all(
            isinstance(e, dict) and "sha256" in e and "size" in e for e in files.values()
        ):
            return None, f"{url}/{MANIFEST} lacks a valid 'files' table (corrupted)", True
        return CheckpointInfo(step=step, url=url, manifest=manifest), "", True

    def read_verified(self, info: CheckpointInfo) -> dict[str, bytes]:
        """Read every file of a checkpoint and check size and sha256. CheckpointError when it does not
        verify (a file missing, torn or corrupt, a name outside the folder); StorageError when a read
        failed after its retries (nothing is known about the checkpoint then)."""
        out = {}
        for name, entry in info.manifest["files"].items():
            try:
                rel = check_relative(f"{step_dir(info.step)}/{name}")
            except StorageError as exc:
                raise CheckpointError(f"{info.url}/{MANIFEST} names {name!r}: {exc}") from None
            try:
                data = self.storage.read_bytes(rel)
            except FileNotFoundError:
                raise CheckpointError(f"{info.url}/{name} is missing") from None
            if len(data) != int(entry["size"]) or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise CheckpointError(f"{info.url}/{name} fails its checksum (torn or corrupted)")
            out[name] = data
        return out

    def load_latest(self, max_step: int | None = None) -> LoadedCheckpoint | None:
        """Load the highest verified checkpoint (at most ``max_step``), skipping and reporting bad ones.

        Only a checkpoint that is not committed (no manifest), or committed and fails verification, is
        passed over; each is reported with its reason, in ``skipped`` of the result and in
        ``self.last_skipped`` (also when nothing is left and None is returned). None means no checkpoint
        verifies. A read that fails after its retries, or a verified state the safe loader refuses, raises
        :class:`CheckpointUnreadableError`: an outage is never taken for "no checkpoint".
        """
        skipped: list[tuple[int, str]] = []
        self.last_skipped = skipped
        where = self.storage.url(CKPT_DIR)
        try:
            steps = self.steps_on_storage()
        except StorageError as exc:
            raise CheckpointUnreadableError(f"cannot list the checkpoints under {where}: {exc}") from None
        for step in reversed(steps):
            if max_step is not None and step > max_step:
                continue
            try:
                info, why = self.read_manifest(step)
                if info is None:
                    skipped.append((step, why))
                    continue
                raw = self.read_verified(info)
            except CheckpointError as exc:
                skipped.append((step, str(exc)))
                continue
            except StorageError as exc:
                raise CheckpointUnreadableError(
                    f"cannot read the checkpoint at {self.storage.url(step_dir(step))}: {exc}; nothing is "
                    "resumed from an older checkpoint or from step 0 while storage does not answer"
                ) from None
            return LoadedCheckpoint(info=info, files=load_files(info, raw), skipped=skipped)
        return None

    def load_step(self, step: int) -> dict[str, Any]:
        info = self._info(step)
        if info is None:
            raise CheckpointError(
                f"checkpoint at step {step} has no manifest under {self.storage.url(CKPT_DIR)}"
            )
        return {name: deserialize(data) for name, data in self.read_verified(info).items()}

    def verifies(self, info: CheckpointInfo) -> str | None:
        """None when the checkpoint verifies, read back from storage now; else why not. StorageError when it
        cannot be read."""
        try:
            self.read_verified(info)
        except CheckpointError as exc:
            return str(exc)
        return None

    def retain(
        self,
        keep_last: int,
        keep_best: bool = False,
        keep_every: int = 0,
        read_back: CheckpointInfo | None = None,
    ) -> builtins.list[int]:
        """Keep the newest ``keep_last`` committed checkpoints from the newest one that verifies now down,
        with ``keep_best`` the best-scored one (:func:`best_of`), and every one whose step is a multiple of
        ``keep_every`` (when positive); delete the other committed ones below the newest kept (manifest
        first, then files).

        Nothing is deleted before the NEWEST kept checkpoint was read back from storage and its checksums
        checked: in this call, or ``read_back``, the checkpoint the caller's own :meth:`commit` read back
        just before (the writer's path: no second read while its manifest is the one written). One that
        fails is moved to ``checkpoints/quarantine/`` (``self.last_quarantined``), never deleted and never
        left to shadow the older ones, and the next newest is read back, until one verifies; when none
        does, nothing is deleted. So bit rot after a commit never costs the last checkpoint that verifies.
        The older kept ones (the rest of ``keep_last``, the milestones) count on the read-back they passed
        at their own commit (a commit that does not read back is quarantined at once), each read once in
        its lifetime, not at every retention; the best is read back once by this object (not when this
        object committed it), one that fails moved aside and the next best kept. A normal retention in the
        writer's path reads no checkpoint, from a fresh process one (two with ``keep_best``, when the best
        is not the newest). The checkpoints beyond those are deleted without being read. Step folders
        without a manifest older than the newest kept one are leftovers of torn writes and go too; newer
        ones may be in flight and stay. Returns the deleted steps. StorageError when storage fails: then
        nothing more is deleted.
        """
        self.last_quarantined = []
        infos = self.list()
        newest = self._newest_verified(infos, read_back)
        if newest is None:
            return []
        live = [i for i in infos if i.step <= newest.step]  # the newer ones failed and were moved aside
        keep = {i.step for i in live[-max(1, keep_last) :]}
        if keep_best:
            best = self._best_kept(live)
            if best is not None:
                keep.add(best.step)
        if keep_every > 0:
            keep.update(i.step for i in live if i.step > 0 and i.step % keep_every == 0)
        quarantined = {s for s, _ in self.last_quarantined}
        deleted = []
        for step in self.steps_on_storage():
            if step in keep or step in quarantined:
                continue
            found, why, present = self._manifest(step)
            if found is None and present:  # a corrupt manifest (never in flight: it is written atomically)
                self._quarantine(step, why)
            elif step < newest.step:
                self._delete(step)
                deleted.append(step)
        return deleted

    def _newest_verified(
        self, infos: builtins.list[CheckpointInfo], read_back: CheckpointInfo | None
    ) -> CheckpointInfo | None:
        """The newest of ``infos`` that verifies now: ``read_back`` (read back by its commit) when it is
        still the one on storage, else read back here; the ones that fail, newest first, are moved aside."""
        fresh = _key(read_back) if read_back is not None else None
        for info in reversed(infos):
            if _key(info) == fresh or self._verified_or_quarantined(info):
                return info
        return None

    def _best_kept(self, live: builtins.list[CheckpointInfo]) -> CheckpointInfo | None:
        """The best-scored of ``live`` that verifies: read back once by this object (its commit's read-back
        counts), one that fails moved aside and the next best taken."""
        candidates = builtins.list(live)
        while (best := best_of(candidates)) is not None:
            if _key(best) in self._passed or self._verified_or_quarantined(best):
                return best
            candidates.remove(best)
        return None

    def _verified_or_quarantined(self, info: CheckpointInfo) -> bool:
        why = self.verifies(info)
        if why is None:
            self._passed.add(_key(info))
            return True
        self._quarantine(info.step, why)
        return False

    def _quarantine(self, step: int, why: str) -> None:
        """Move a checkpoint that failed verification to ``checkpoints/quarantine/``: out of every reader's
        way, kept for whoever investigates."""
        dst = self._move_aside(step, QUARANTINE)
        logger.warning("checkpoint at step %d fails verification, moved to %s: %s", step, dst, why)
        self.last_quarantined.append((step, f"{why}; moved to {dst}"))

    def _move_aside(self, step: int, folder: str) -> str:
        """Move ``step_N/`` to ``folder/step_N/`` (``step_N.2/``, ... when taken: nothing there is ever
        overwritten); returns its new URL."""
        self._fenced()
        name = step_dir(step).rsplit("/", 1)[1]
        dst, n = f"{folder}/{name}", 1
        while self.storage.exists(dst):
            n += 1
            dst = f"{folder}/{name}.{n}"
        self.storage.move(step_dir(step), dst, last=MANIFEST)
        self._forget(step)
        return self.storage.url(dst)

    def _forget(self, step: int) -> None:
        self._passed = {k for k in self._passed if k[0] != step}

    def _delete(self, step: int) -> None:
        self._fenced()
        d = step_dir(step)
        self.storage.rm(f"{d}/{MANIFEST}")  # first: a reader never sees a manifest without its files
        self._forget(step)
        self.storage.rm(d, recursive=True)

    def discard_after(
        self,
        step: int,
        keep_best: bool = True,
        keep_every: int = 0,
        may_keep: Callable[[CheckpointInfo], bool] | None = None,
    ) -> builtins.list[int]:
        """Take every checkpoint newer than ``step`` off the run's path: after a rollback or a rewind they
        belong to a path the run no longer takes, and no later recovery may resume from them. Nothing at
        or before ``step`` is touched (so the newest verified checkpoint there stays).

        The best-scored one (``keep_best``) and the milestones (steps that are multiples of a positive
        ``keep_every``) among them are moved to ``checkpoints/discarded/`` (``self.last_set_aside``)
        instead of being deleted, unless ``keep_best=False`` / ``keep_every=0`` or ``may_keep`` refuses them
        (a replica rollback keeps only those whose replicas agreed: ``cluster.rank.replica``); the others are
        deleted, newest first (manifest first, then files), so a crash part way leaves a run as if
        discarded after a later step. Returns every step taken off the path, ascending.
        """
        newer = [s for s in self.steps_on_storage() if s > step]
        infos = [i for i in self.list() if i.step > step] if newer else []
        best = best_of(self.list()) if keep_best and infos else None
        aside = {i.step for i in infos if keep_every > 0 and i.step % keep_every == 0}
        if best is not None and best.step > step:
            aside.add(best.step)
        if may_keep is not None:
            aside = {i.step for i in infos if i.step in aside and may_keep(i)}
        self.last_set_aside = []
        for s in reversed(newer):
            if s in aside:
                self._set_aside(s)
            else:
                self._delete(s)
        return newer

    def _set_aside(self, step: int) -> None:
        self._move_aside(step, DISCARDED)
        self.last_set_aside.append(step)


def _signature(info: CheckpointInfo) -> str:
    """What identifies a checkpoint's content: its manifest's checksums."""
    return json.dumps(info.manifest.get("files"), sort_keys=True)


def _key(info: CheckpointInfo) -> tuple[int, str]:
    return info.step, _signature(info)


def load_files(info: CheckpointInfo, raw: dict[str, bytes]) -> dict[str, Any]:
    """Deserialize a verified checkpoint's files; CheckpointUnreadableError naming the file when the safe
    loader refuses one (its checksum matched, so it is what was written: skipping it would hide that)."""
    out = {}
    for name, data in raw.items():
        try:
            out[name] = deserialize(data)
        except Exception as exc:  # an unpickling refusal (weights_only) or a stream torch cannot parse
            raise CheckpointUnreadableError(
                f"{info.url}/{name} verifies but cannot be loaded safely ({loader_reason(exc)}): it is what "
                "was written, so no older checkpoint is taken in its place; move it aside (or rewind past "
                "it) to resume from an older one"
            ) from None
    return out


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
    quarantined: list[tuple[int, str]] = field(default_factory=list)
    """(step, reason) of checkpoints that failed verification, moved to ``checkpoints/quarantine/``: older
    ones retention checked (also when retention failed later), or this one when it did not read back as
    written (``error`` says so)."""
    retention_error: str | None = None
    """Why retention failed after this commit (a warning: the commit stands, ``error`` stays None, and
    retention runs again at the next commit)."""


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
        self.last: CommitRecord | None = None
        """The newest write's record, drained or not."""
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._abandon = False
        self._pool = HostBuffers()
        self._model_checked = False
        self.rows_seq = 0
        """The event count the rows written beside commits are placed by (``Worker.run_epoch`` sets it)."""

    def save(
        self,
        step: int,
        epoch: int,
        meta: dict[str, Any],
        files: dict[str, Any],
        rows: list[dict[str, Any]] | None = None,
    ) -> float:
        """Checkpoint ``files`` (name -> object) at ``step``; return the seconds training was blocked.
        ``rows``: rank 0's step rows since the last checkpoint, written beside the commit once it is
        committed (:func:`cluster.run.logs.write_commit_rows`)."""
        t0 = time.perf_counter()
        self.wait()
        host = snapshot(files, self._pool)
        stall = time.perf_counter() - t0
        args = (step, epoch, meta, host, stall, rows or [])
        if self.async_save:
            self._thread = threading.Thread(target=self._write, args=args, name=f"ckpt-{step}", daemon=True)
            self._thread.start()
        else:
            self._write(*args)
            stall = time.perf_counter() - t0
            self.records[-1].stall_s = stall
        return stall

    def _write(
        self,
        step: int,
        epoch: int,
        meta: dict[str, Any],
        host: dict[str, Any],
        stall: float,
        rows: list[dict[str, Any]],
    ) -> None:
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
            self._check_loadable(host, blobs)
            if self._abandon:
                return
            info = self.store.commit(step, blobs, {**meta, "epoch": epoch})  # published and read back
            record.url, record.bytes = info.url, info.total_bytes
            self._write_rows(step, epoch, meta, rows, stall)
            self._retain(record, info)
        except Exception as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            own = [q for q in self.store.last_quarantined if q[0] == step]  # when it did not read back whole
            record.quarantined = own
        record.write_s = time.perf_counter() - t0
        with self._lock:
            self.records.append(record)
            self.last = record
        if self.on_commit is not None:
            self.on_commit(record)

    def _retain(self, record: CommitRecord, info: CheckpointInfo) -> None:
        """Retention after a commit that read back whole. Its failure is a warning, not a failed commit:
        the checkpoint is committed (published, and it verifies), and retention runs again at the next
        commit; until then nothing more is deleted than before."""
        try:
            self.store.retain(self.keep_last, self.keep_best, self.keep_every, read_back=info)
        except Exception as exc:  # the commit stands; anything retention raised is reported, not raised
            record.retention_error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "checkpoint at step %d is committed, but retention failed after it (it runs again at the "
                "next commit): %s",
                record.step,
                record.retention_error,
            )
        finally:
            record.quarantined = list(self.store.last_quarantined)

    def _write_rows(
        self, step: int, epoch: int, meta: dict[str, Any], rows: list[dict[str, Any]], stall: float
    ) -> None:
        """The step rows up to a commit, beside it: a failure to write them is logged, the commit stands
        (the driver has them too unless it died)."""
        if not rows:
            return
        at = [{**r, "checkpoint_stall_s": stall} if r["global_step"] == step else r for r in rows]
        from cluster.run.logs import write_commit_rows  # pyarrow: only where a writer commits

        try:
            write_commit_rows(self.store.storage, at, step, epoch, int(meta.get("attempt", 0)), self.rows_seq)
        except Exception as exc:  # the commit holds the training; the rows are a copy
            logger.warning("could not write the step rows of the checkpoint at step %d: %s", step, exc)

    def _check_loadable(self, host: dict[str, Any], blobs: dict[str, bytes]) -> None:
        """Load each blob back through the safe loader before anything is written (CheckpointError naming
        the offending value when it is refused). The model's weights only at the first checkpoint (their
        types do not change); the small files every time (a scheduler may put a new type there)."""
        for name, blob in blobs.items():
            if name == "model.pt" and self._model_checked:
                continue
            try:
                deserialize(blob)
            except Exception:
                check_loadable(host[name], name)  # names where the refused value sits
                raise
        self._model_checked = True

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
