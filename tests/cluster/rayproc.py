"""Real Ray processes for the cluster tests: start a head (or a node) with a HOME and temp dir of its own,
run the ``ray`` CLI against it, and stop exactly the processes it started (never ``ray stop``, which
kills every Ray on the machine by name)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
RAY = os.path.join(BIN, "ray")
# What `--working-dir` must not upload: the virtualenv, git objects, run outputs, datasets.
EXCLUDES = [".venv", ".git", "runs", "data", ".pytest_cache", ".ruff_cache", ".mypy_cache", "__pycache__"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_env(home: str, **extra: str) -> dict[str, str]:
    """The environment of a Ray node or client: this venv first on PATH, a HOME of its own (Ray keeps
    ~/.ray/auth_token there), token auth off unless ``extra`` turns it on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        HOME=home,
        PATH=BIN + os.pathsep + env.get("PATH", ""),
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def _procs() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, cmdline) for every live process."""
    out: dict[int, tuple[int, str, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                stat = fh.read()
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        out[int(name)] = (int(fields[1]), fields[0], cmd)
    return out


def owned_pids(markers: Iterable[str], roots: Iterable[int] = ()) -> list[int]:
    """Live (non-zombie) processes whose command line contains a marker, plus all their descendants."""
    procs = _procs()
    markers = list(markers)
    owned = {p for p, (_, st, cmd) in procs.items() if st != "Z" and any(m in cmd for m in markers)}
    owned |= {p for p in roots if p in procs}
    changed = True
    while changed:
        changed = False
        for pid, (ppid, st, _) in procs.items():
            if ppid in owned and pid not in owned and st != "Z":
                owned.add(pid)
                changed = True
    owned.discard(os.getpid())
    return sorted(p for p in owned if procs[p][1] != "Z")


def kill_until_gone(find: Callable[[], list[int]], timeout: float = 20.0) -> list[int]:
    """SIGKILL what ``find`` returns until it returns nothing or ``timeout`` passes; return what is left."""
    deadline = time.monotonic() + timeout
    left = find()
    while left and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.3)
        left = find()
    return left


def kill_owned(markers: Iterable[str], roots: Iterable[int] = (), timeout: float = 20.0) -> list[int]:
    """SIGKILL every process :func:`owned_pids` finds until none is left; return what is still alive.
    ``roots`` count only on the first look (a dead root's PID may be reused by someone else)."""
    markers = list(markers)
    first = [owned_pids(markers, roots)]
    return kill_until_gone(lambda: first.pop() if first else owned_pids(markers, ()), timeout)


def run(
    args: list[str], env: dict[str, str], timeout: float, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command to completion, stdout and stderr together in ``.stdout``."""
    return subprocess.run(
        args,
        env=env,
        cwd=cwd or REPO,
        timeout=timeout,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        check=False,
    )


class Head:
    """``ray start --head`` on loopback with free ports; ``stop()`` kills only its own processes."""

    def __init__(self, temp_dir: str, home: str, num_cpus: int = 4, **env_extra: str) -> None:
        self.temp_dir = temp_dir
        self.env = ray_env(home, **env_extra)
        self.port = free_port()
        self.dashboard_port = free_port()
        self.num_cpus = num_cpus

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self, timeout: float = 90) -> None:
        args = [
            RAY,
            "start",
            "--head",
            f"--num-cpus={self.num_cpus}",
            f"--port={self.port}",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]
        proc = run(args, self.env, timeout)
        if proc.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start --head failed ({proc.returncode}):\n{proc.stdout[-4000:]}")

    def job(
        self, *args: str, timeout: float = 240, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``ray job ARGS --address <this head>``."""
        sub, rest = args[0], list(args[1:])
        return run([RAY, "job", sub, "--address", self.address, *rest], env or self.env, timeout)

    def stop(self) -> None:
        left = kill_owned([self.temp_dir])
        if left:
            raise RuntimeError(f"processes of the Ray head in {self.temp_dir} survived SIGKILL: {left}")
