"""One writer per run: the run's lease, with a generation that fences out a writer that was taken over.

A job's driver takes the lease before it writes anything to the run; every write that changes what a reader
will trust (a checkpoint's commit, retention, a rollback's or rewind's deletes, an event segment) first checks
that no newer generation exists, so a driver that was paused (SIGSTOP, a network partition) and wakes up after
another job took the run over can no longer write: a fencing token, as leases in etcd or ZooKeeper give.

Layout: ``<run>/lease/gen_000001.json``, ``gen_000002.json``, ... Each generation's file is CREATED
EXCLUSIVELY by the job that takes it (local storage: ``O_EXCL``; S3: a conditional put, ``If-None-Match: *``;
other object stores: a check then a write, a documented best effort), so two jobs never hold one generation.
The holder rewrites its own file every ``beat_s`` with a beat counter one higher, and a last time with
``released: true`` when it ends. The highest generation is the holder.

Liveness is judged by the holder's beat counter advancing while the reader watches, on the reader's own clock
(up to ``LIVE_BEATS`` beat intervals): never by comparing two machines' clocks. A released lease, or one whose
beat stood still that long, is taken at once by the next generation; a live one refuses the new job
(:class:`LeaseHeldError`, exit 2) naming the holder, unless it asked to take over (``--takeover``).

One shortcut: a holder that ran on this machine, in this process namespace (the lease names its kernel boot id
and pid namespace), and whose process no longer exists (or is a zombie) is gone for certain, so the run is
taken without watching: a driver resubmitted after a crash on the same head node starts at once. Anything less
certain (another machine, another namespace, the pid taken by a new process) watches the beat as above.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.core.errors import FencedError, LeaseHeldError, StorageError
from cluster.run.folder import RunFolder
from cluster.run.storage import Storage

if TYPE_CHECKING:
    from cluster.spec.config import JobConfig

logger = logging.getLogger(__name__)

LEASE_DIR = "lease"
BEAT_S = 5.0
"""How often the holder beats (``CLUSTER_LEASE_BEAT_S`` overrides it, e.g. in tests)."""
LIVE_BEATS = 2.5
"""A holder whose beat did not advance for this many of its beat intervals, watched on the reader's clock,
is gone."""
GENERATION_ENV = "CLUSTER_LEASE_GENERATION"
"""Set on the workers: the generation their driver holds, which rank 0's checkpoint commits check."""


@dataclass(frozen=True)
class Holder:
    """What a generation's file says."""

    generation: int
    job: str
    host: str
    pid: int
    since: float
    beat: int
    beat_s: float
    released: bool
    machine: str = ""
    """The kernel boot id and pid namespace the holder ran in ("" when unknown): :func:`gone_here`."""

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"job {self.job} on {self.host} (pid {self.pid}, generation {self.generation}, since {since})"


def beat_s() -> float:
    return float(os.environ.get("CLUSTER_LEASE_BEAT_S", BEAT_S))


def _name(generation: int) -> str:
    return f"{LEASE_DIR}/gen_{generation:06d}.json"


def generations(run: Storage) -> list[int]:
    """The generations on storage, in order (an unreadable listing raises StorageError)."""
    out = []
    for name in run.listdir(LEASE_DIR):
        if name.startswith("gen_") and name.endswith(".json"):
            try:
                out.append(int(name[4:-5]))
            except ValueError:
                logger.warning("ignoring %s/%s: not a lease generation", LEASE_DIR, name)
    return sorted(out)


def read_holder(run: Storage, generation: int) -> Holder | None:
    try:
        data: Any = json.loads(run.read_bytes(_name(generation)))
        return Holder(
            generation=int(data["generation"]),
            job=str(data.get("job", "?")),
            host=str(data.get("host", "?")),
            pid=int(data.get("pid", 0)),
            since=float(data.get("since", 0.0)),
            beat=int(data.get("beat", 0)),
            beat_s=float(data.get("beat_s", BEAT_S)),
            released=bool(data.get("released", False)),
            machine=str(data.get("machine", "")),
        )
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:  # torn by a crash mid-write: no beat to watch
        logger.warning("lease generation %d does not parse (%s): taken as gone", generation, exc)
        return None


def current(run: Storage) -> Holder | None:
    """The newest generation's holder, or None when the run was never leased."""
    gens = generations(run)
    return read_holder(run, gens[-1]) if gens else None


def _create(run: Storage, rel: str, data: bytes) -> bool:
    """Create ``rel`` only if it does not exist; False when it does (someone else created it)."""
    path = run._p(rel)

    def put() -> bool:
        try:
            if run.local:
                run.fs.makedirs(path.rsplit("/", 1)[0] or "/", exist_ok=True)
                with open(path, "xb") as fh:  # O_EXCL
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                return True
            if run.fs.protocol in ("s3", "s3a") or "s3" in tuple(run.fs.protocol):
                run.fs.pipe_file(path, data, mode="create")  # If-None-Match: *
                return True
            if run.fs.exists(path):  # best effort: no atomic create on this backend
                return False
            run.fs.pipe_file(path, data)
            return True
        except FileExistsError:
            return False

    return run.retry(f"creating {run.url(rel)}", put)


def this_machine() -> str:
    """This process's kernel boot id and pid namespace (Linux), "" elsewhere: two processes with the same
    value see the same pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _process_gone(pid: int) -> bool:
    """Whether no process ``pid`` exists here (a zombie, killed and not yet reaped, counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, another user's
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def pid_gone_here(machine: str, pid: int) -> bool:
    """Process ``pid``, recorded with ``machine`` (its :func:`this_machine`), ran on this machine, in this pid
    namespace, and is gone (or a zombie): certainly not alive. False whenever that is not certain."""
    mine = this_machine()
    return bool(mine) and machine == mine and pid != os.getpid() and _process_gone(pid)


def gone_here(holder: Holder) -> bool:
    """The holder ran on this machine, in this pid namespace, and its process is gone: certainly not alive."""
    return pid_gone_here(holder.machine, holder.pid)


def is_alive(run: Storage, holder: Holder, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Whether ``holder`` still beats: watch its counter for up to ``LIVE_BEATS`` of its intervals on this
    machine's monotonic clock. A released lease is not alive."""
    if holder.released:
        return False
    deadline = time.monotonic() + LIVE_BEATS * holder.beat_s
    while time.monotonic() < deadline:
        sleep(min(holder.beat_s / 4, max(0.0, deadline - time.monotonic())))
        now = read_holder(run, holder.generation)
        if now is None or now.released:
            return False
        if now.beat != holder.beat:
            return True
        if generations(run)[-1] != holder.generation:
            return False  # someone else took it meanwhile: the caller looks again
    return False


class Lease:
    """The generation this process holds (:meth:`take`), its beat, and the fence its trusted writes check."""

    def __init__(self, run: Storage, generation: int, job: str, every_s: float) -> None:
        self.run = run
        self.generation = generation
        self.job = job
        self.every_s = every_s
        self.since = time.time()
        self.beat = 0
        self.took_over: Holder | None = None
        """The holder this job took the run from while its lease was not released (a crash, --takeover)."""
        self.fenced_by: Holder | None = None
        """Set once a newer generation is seen: nothing more may be written."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged = False
        self._released = False

    # ------------------------------------------------------------------ taking
    @classmethod
    def take(
        cls,
        run: Storage,
        job: str,
        takeover: bool = False,
        say: Callable[[str], None] | None = None,
    ) -> Lease:
        """Take the run's next generation. A live holder refuses it (LeaseHeldError) unless ``takeover``."""
        every = beat_s()
        for _ in range(20):  # each round: someone else created the generation we wanted; look again
            gens = generations(run)
            newest = gens[-1] if gens else 0
            holder = read_holder(run, newest) if newest else None
            if holder is not None and not holder.released and not takeover and gone_here(holder):
                if say is not None:
                    say(
                        f"the run's lease was held by {holder.describe()}, whose process is gone from this "
                        "machine: taking the run over"
                    )
            elif holder is not None and not holder.released and not takeover:
                if say is not None:
                    say(
                        f"the run's lease is held by {holder.describe()}; watching its beat for up to "
                        f"{LIVE_BEATS * holder.beat_s:.0f}s to see whether it is alive"
                    )
                if is_alive(run, holder):
                    raise LeaseHeldError(
                        f"another job is training run {run.root}: {holder.describe()}, and it is alive (its "
                        "lease beats). Wait for it to end, stop it (python -m cluster stop), or, once it is "
                        "gone, resubmit with --takeover (cluster.train(..., takeover=True))"
                    )
                if generations(run)[-1] != newest:
                    continue
            lease = cls(run, newest + 1, job, every)
            if _create(run, _name(lease.generation), lease._body(released=False)):
                if holder is not None and not holder.released:
                    logger.warning("took the run over from %s", holder.describe())
                    lease.took_over = holder
                return lease
        raise StorageError(f"could not take the lease of {run.root}: other jobs kept taking it first")

    @classmethod
    def take_for(
        cls,
        cfg: JobConfig,
        takeover: bool = False,
        say: Callable[[str], None] | None = None,
        folder: RunFolder | None = None,
    ) -> Lease:
        """Take the lease of ``cfg``'s run (``<storage.url>/<name>``; ``folder``, when the caller made it
        already) for this job (its Ray submission id, else this process) before anything is written;
        ``say`` (default: print) tells of a holder watched or taken over."""
        run = (folder or RunFolder.of(cfg)).storage
        job = os.environ.get("RAY_JOB_SUBMISSION_ID") or f"python pid {os.getpid()}"
        return cls.take(run, job, takeover=takeover, say=say or print)

    def _body(self, released: bool) -> bytes:
        return json.dumps(
            {
                "generation": self.generation,
                "job": self.job,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "machine": this_machine(),
                "since": self.since,
                "beat": self.beat,
                "beat_s": self.every_s,
                "released": released,
            }
        ).encode()

    # ------------------------------------------------------------------ beating
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="cluster-lease-beat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._beat()

    def _beat(self) -> None:
        try:
            self.check()
            self.beat += 1
            # atomic: a reader that met a half-written file would take the live holder for gone
            self.run.write_atomic(_name(self.generation), self._body(released=False))
        except FencedError:
            self._stop.set()
        except StorageError as exc:  # storage down: the next beat tries again
            if not self._logged:
                logger.warning("could not renew the run's lease: %s", exc)
                self._logged = True

    def release(self) -> None:
        """The job ends: stop beating and mark the lease released (the next job takes it at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self._released or self.fenced_by is not None:
            return  # released already, or not ours any more
        self._released = True
        try:
            self.check()
            self.beat += 1
            self.run.write_atomic(_name(self.generation), self._body(released=True))
        except StorageError as exc:
            logger.warning("could not release the run's lease (the next job waits for it): %s", exc)

    # ------------------------------------------------------------------ fencing
    def check(self) -> None:
        """Raise FencedError when a newer generation exists (once seen, always)."""
        if self.fenced_by is None:
            fenced_by = fence_check(self.run, self.generation)
            if fenced_by is None:
                return
            self.fenced_by = fenced_by
        raise FencedError(fenced_message(self.fenced_by, self.generation))


def fence_check(run: Storage, generation: int) -> Holder | None:
    """The holder of a generation newer than ``generation``, or None (one listing of ``lease/``)."""
    gens = generations(run)
    if gens and gens[-1] > generation:
        return read_holder(run, gens[-1]) or Holder(gens[-1], "?", "?", 0, 0.0, 0, BEAT_S, False)
    return None


def fenced_message(by: Holder, generation: int) -> str:
    return (
        f"this job (lease generation {generation}) was taken over by {by.describe()}: it may no longer "
        "write to the run, and stops. Nothing it committed before is lost"
    )


class Fence:
    """A generation to check before a trusted write (``check``); used by the workers and the event log."""

    def __init__(self, run: Storage, generation: int) -> None:
        self.run = run
        self.generation = generation

    def check(self) -> None:
        by = fence_check(self.run, self.generation)
        if by is not None:
            raise FencedError(fenced_message(by, self.generation))
