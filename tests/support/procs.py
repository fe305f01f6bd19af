"""Processes a test started, found by a marker of the test's own: an environment variable set on the
command it starts, which every process below it inherits (Ray's daemons and workers too, even once they
rename their process title and leave the tree for PID 1). Read back from /proc/PID/environ; killed by PID,
never by name."""

from __future__ import annotations

import os
import signal
import uuid

MARK = "CLUSTER_TEST_MARK"


def new_mark() -> str:
    return uuid.uuid4().hex


def state(pid: int) -> str | None:
    """The process's state letter (``Z``: a zombie), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def marked(mark: str) -> dict[int, str]:
    """Live (not zombie) processes whose environment holds ``MARK=mark``: pid -> its name."""
    needle = f"{MARK}={mark}".encode()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            with open(f"/proc/{name}/comm") as fh:
                comm = fh.read().strip()
        except OSError:  # gone meanwhile, or a zombie's
            continue
        if needle in env and state(int(name)) not in (None, "Z"):
            found[int(name)] = comm
    return found


def kill_marked(mark: str) -> None:
    """SIGKILL every live process carrying ``mark`` (what the test started), by PID."""
    for pid in marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def children(pid: int) -> list[int]:
    """The direct children of ``pid``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(name))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
