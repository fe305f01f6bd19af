"""The embedded single-machine Ray that ``train()`` starts when no cluster is given.

Only what Ray supports is used: ``ray.init`` arguments, Ray's system config (``_system_config``, the same
settings as ``RAY_<name>`` environment variables) and environment variables that Ray's own daemons read.
Nothing of ``ray._private`` is replaced, so a new Ray release cannot break this start silently.

While training, Ray's own processes take CPU from the workers, and on a machine whose cores the workers fill
each such tick stalls every rank (the others wait for the preempted one at the next all-reduce). The embedded
Ray therefore turns off what only feeds parts it does not run (the dashboard, the state API, a metrics
scraper): see ``_SYSTEM_CONFIG`` and ``_QUIET_ENV``. A setting the user has made keeps the user's value.

Nothing is left behind by a driver that dies (SIGKILL, the OOM killer): Ray ties its GCS and raylet to the
driver, but the raylet's DashboardAgent and RuntimeEnvAgent, handed to PID 1, ignore SIGTERM and wait a
minute on the dead GCS, and workers linger a few seconds. Every process of the embedded Ray carries the
session's marker (``SESSION_ENV``, inherited from ``ray.init``: the driver's pid and machine and a random
id), read back from ``/proc/PID/environ`` (kept readable in the agents, which rename themselves, by
``SPT_NOENV``: see ``_QUIET_ENV``): never a process name. A watcher process started with the Ray
(this file run as a script, standard library only) stops the session's processes by PID once its driver is
gone; should the watcher have died too, the next embedded start on this machine stops what is left of
sessions whose driver is certainly gone (``cluster.run.lease.pid_gone_here``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

# The module's own name, also when it runs as the watcher script (``__name__`` is ``__main__`` then).
logger = logging.getLogger("cluster.api.local_ray")

SESSION_ENV = "CLUSTER_EMBEDDED_RAY"
"""In the environment of every process of an embedded Ray: ``<driver pid> <random id> <machine>``, the
machine as ``cluster.run.lease.this_machine`` writes it (the kernel's boot id and the pid namespace)."""
_STOP = b"q"
"""What :func:`shutdown` writes to the watcher: the driver stopped its Ray itself."""
_watcher: tuple[subprocess.Popen[bytes], int] | None = None
"""The watcher of the embedded Ray this process started, and the write end of its pipe."""

# Ray settings (``RayConfig``) of the embedded Ray. The dashboard, the state API and a metrics scraper are
# what read these, and the embedded Ray runs none of them.
_SYSTEM_CONFIG: dict[str, Any] = {
    "task_events_report_interval_ms": 0,  # every process sends task events to the GCS once a second
    "enable_metrics_collection": False,  # every process exports metrics to the dashboard agent
    # The raylet's OOM guard reads the memory of every process 4 times a second (Ray's 250 ms), a visible
    # share of the raylet's CPU while the workers train. Once a second still stops a runaway worker in time.
    "memory_monitor_refresh_ms": 1000,
    # Ray starts worker processes at niceness 15, below its daemons; the training ranks should not yield to
    # them (scaling.worker_niceness). Lowering niceness later needs CAP_SYS_NICE; starting at 0 needs nothing.
    "worker_niceness": 0,
    # The raylet connects to its own object store (started on another thread a moment earlier) and every
    # worker to the raylet over a Unix socket; a socket not yet listening is retried after this many ms.
    # Ray's 1000 ms makes a start on a loaded machine wait a whole second now and then; the budget stays 10 s.
    "raylet_client_connect_timeout_milliseconds": 50,
    "raylet_client_num_connect_attempts": 200,
}
# Settings that only make sense together: a user's value for one of them drops the embedded defaults of all.
_SYSTEM_CONFIG_GROUPS = [("raylet_client_connect_timeout_milliseconds", "raylet_client_num_connect_attempts")]
# Read from the environment by Ray's Python daemons, which inherit it from ``ray.init``.
_QUIET_ENV = {
    # The log monitor globs the log folder 10 times a second while it follows fewer than this many files;
    # with 0 it globs every LOG_NAME_UPDATE_INTERVAL_S. New files are still followed from their first line.
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "1",
    # The dashboard agent's per-process CPU and memory sampling, shown only by the dashboard.
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    # Ray's DashboardAgent and RuntimeEnvAgent rename themselves (``ray::DashboardAgent``) with Ray's copy of
    # setproctitle, which by default writes the title over the process's environment block: the session
    # marker (SESSION_ENV) in /proc/PID/environ is gone, and a dead driver's agents cannot be found to stop.
    # With SPT_NOENV (read by that setproctitle) the title is written over the command line only.
    "SPT_NOENV": "1",
}


def start(num_cpus: int) -> None:
    """Start an embedded local Ray (never attaching to another ``ray start`` on this machine), after stopping
    what embedded Rays of drivers gone from this machine left (module doc), with a watcher that stops this
    one's processes should this process die before :func:`shutdown`."""
    import ray

    from cluster.run.lease import this_machine

    marker = f"{os.getpid()} {uuid.uuid4().hex} {this_machine()}"
    if os.path.isdir("/proc"):  # Linux: what a dead driver left is found by its marker in /proc
        reap_dead_sessions()
        _start_watcher(marker)
    # No runtime_env: Ray puts the driver's working directory on the workers' sys.path, and the worker
    # processes inherit this process's environment (PYTHONPATH included) through the raylet started
    # here. A runtime_env would make Ray start job-specific processes for the actors instead of using the
    # ones it prestarts during ray.init.
    try:
        with _env(_QUIET_ENV), _env({SESSION_ENV: marker}, force=True):
            ray.init(
                address="local",  # not /tmp/ray/ray_current_cluster: someone else's `ray start`
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=True,
                configure_logging=False,
                _system_config=_system_config(os.environ),
            )
    except BaseException:
        _stop_watcher()
        raise


def _system_config(environ: Mapping[str, str]) -> dict[str, Any]:
    """The embedded defaults, less every setting the user gave Ray through ``RAY_<name>`` (and its group)."""
    user = {k for k in _SYSTEM_CONFIG if f"RAY_{k}" in environ}
    for group in _SYSTEM_CONFIG_GROUPS:
        if user & set(group):
            user |= set(group)
    return {k: v for k, v in _SYSTEM_CONFIG.items() if k not in user}


def shutdown() -> None:
    """``ray.shutdown()``: stops the embedded Ray of :func:`start` (and its watcher); a driver connected to a
    cluster only disconnects, nothing of the cluster is touched."""
    import ray

    try:
        ray.shutdown()
    finally:
        _stop_watcher()


@contextlib.contextmanager
def _env(values: dict[str, str], force: bool = False) -> Iterator[None]:
    """Set the variables the user has not set (``force``: all of them), for the processes started inside;
    then restore."""
    saved = {k: os.environ.get(k) for k in values if force or k not in os.environ}
    os.environ.update({k: values[k] for k in saved})
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


# ---------------------------------------------------------------------- nothing left behind (module doc)
def _start_watcher(marker: str) -> None:
    """Start the watcher of the session ``marker``: a child in a session of its own (a Ctrl-C in the terminal
    does not reach it) reading a pipe that only this process writes, with close-on-exec (so none of Ray's
    processes holds it): it ends when this process says stop or dies."""
    global _watcher
    _stop_watcher()
    read_fd, write_fd = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != SESSION_ENV}
    try:
        proc = subprocess.Popen(
            # -I: the standard library alone, nothing from this process's PYTHONPATH or working directory
            [sys.executable, "-I", os.path.abspath(__file__), marker, str(os.getpid())],
            stdin=read_fd,
            stdout=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        os.close(write_fd)
        logger.warning(
            "could not start the watcher of the embedded Ray (%s): should this process be killed, its Ray's "
            "processes are stopped at the next embedded start on this machine",
            exc,
        )
        return
    finally:
        os.close(read_fd)
    _watcher = (proc, write_fd)


def _stop_watcher() -> None:
    """Tell the watcher that this process stopped its Ray itself, and wait for it to end."""
    global _watcher
    if _watcher is None:
        return
    proc, write_fd = _watcher
    _watcher = None
    try:
        os.write(write_fd, _STOP)
    except OSError as exc:  # it is gone already (killed): nothing to tell
        logger.info("the embedded Ray's watcher (pid %d) is gone: %s", proc.pid, exc)
    finally:
        os.close(write_fd)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        logger.warning("the embedded Ray's watcher (pid %d) did not end: killed", proc.pid)
        proc.kill()
        proc.wait(10)


def _watch(marker: str, driver: int) -> int:
    """The watcher's loop (its stdin: the pipe of :func:`_start_watcher`). Ends at once on the driver's stop
    byte; when the driver is gone instead (it is no longer this process's parent: the kernel hands the
    children of a process that died to another), stops every process of the session, by PID."""
    eof_at: float | None = None
    while os.getppid() == driver:
        if eof_at is not None:  # the pipe closed without a stop: the driver is dying (its files close first)
            time.sleep(0.02 if time.monotonic() - eof_at < 5 else 1.0)
            continue
        ready, _, _ = select.select([0], [], [], 1.0)
        if not ready:
            continue
        data = os.read(0, 64)
        if _STOP in data:
            return 0
        if not data:
            eof_at = time.monotonic()
    stopped = _kill_sessions({marker})
    if stopped:
        logger.warning(
            "the driver (pid %d) of an embedded Ray is gone: stopped its Ray's %d processes left (pids %s)",
            driver,
            len(stopped),
            ", ".join(map(str, stopped)),
        )
    return 0


def reap_dead_sessions() -> list[int]:
    """Stop the processes of embedded Rays whose driver ran on this machine and is certainly gone (only
    those: by their marker, read from /proc/PID/environ, never by name); their pids."""
    from cluster.run.lease import pid_gone_here

    dead = set()
    for marker in _sessions():
        pid, _, rest = marker.partition(" ")
        machine = rest.partition(" ")[2]
        if pid.isdigit() and pid_gone_here(machine, int(pid)):
            dead.add(marker)
    stopped = _kill_sessions(dead) if dead else []
    if stopped:
        logger.warning(
            "stopped %d processes (pids %s) left by embedded Rays whose driver is gone from this machine",
            len(stopped),
            ", ".join(map(str, stopped)),
        )
    return stopped


def _kill_sessions(markers: set[str], rounds: int = 20) -> list[int]:
    """SIGKILL (Ray's agents ignore SIGTERM) every live process carrying one of ``markers``, until none is
    left (one may have been starting meanwhile); never this process or its ancestors. The pids killed."""
    spare = _ancestors()
    killed: list[int] = []
    for _ in range(rounds):
        found = [pid for m, pids in _sessions().items() if m in markers for pid in pids if pid not in spare]
        if not found:
            break
        killed += [pid for pid in found if _kill(pid, markers)]
        time.sleep(0.05)
    return killed


def _kill(pid: int, markers: set[str]) -> bool:
    """SIGKILL ``pid`` if it still carries one of ``markers``; through a pidfd where the kernel has them, so
    that a pid reused meanwhile by another process is never signalled."""
    try:
        fd: int | None = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    except ProcessLookupError:
        return False
    except OSError as exc:  # no pidfds (a kernel before 5.3): the marker is checked just before the kill
        logger.debug("pidfd_open(%d): %s; signalled by pid", pid, exc)
        fd = None
    try:
        if _marker_of(pid) not in markers:
            return False
        if fd is None:
            os.kill(pid, signal.SIGKILL)
        else:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _sessions() -> dict[str, list[int]]:
    """The live processes of this machine that carry a session marker: marker -> pids (a zombie's
    environment reads empty: it is not listed)."""
    out: dict[str, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            marker = _marker_of(int(name))
            if marker:
                out.setdefault(marker, []).append(int(name))
    return out


def _marker_of(pid: int) -> str | None:
    key = f"{SESSION_ENV}=".encode()
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            entries = fh.read().split(b"\0")
    except OSError:  # gone, or another user's: not ours to judge
        return None
    for entry in entries:
        if entry.startswith(key):
            return entry[len(key) :].decode(errors="replace")
    return None


def _ancestors() -> set[int]:
    """This process and every process above it."""
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return out


if __name__ == "__main__":  # the watcher (``_start_watcher``): python -I local_ray.py MARKER DRIVER_PID
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(_watch(sys.argv[1], int(sys.argv[2])))
