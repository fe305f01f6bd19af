"""Real separate hosts for the cluster tests: network namespaces on a bridge, one Ray node in each.

Every namespace, veth and bridge is named with a random tag, so tests on the same machine (and other
people's) never collide, and :meth:`Hosts.teardown` removes exactly what :meth:`Hosts.setup` made. The
interface inside every namespace has the same name (``IFNAME``) so one ``scaling.socket_ifname`` fits all.
"""

from __future__ import annotations

import secrets
import subprocess
import time

from tests.cluster.rayproc import RAY, kill_owned, kill_until_gone, run

IFNAME = "eth0c"
SUBNET = "10.231.0"


class NetnsUnavailable(RuntimeError):
    pass


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], text=True, capture_output=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


class Hosts:
    """``n`` namespaces ``<tag>h0..`` with addresses 10.231.0.1.. on the bridge ``br<tag>``."""

    def __init__(self, n: int) -> None:
        self.tag = "hd" + secrets.token_hex(3)
        self.names = [f"{self.tag}h{i}" for i in range(n)]
        self.bridge = f"br{self.tag}"
        self.made: list[str] = []  # namespaces created so far, for teardown

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def setup(self) -> None:
        first = ip("netns", "add", self.names[0], check=False)
        if first.returncode != 0:
            raise NetnsUnavailable(f"`ip netns add` is not permitted here: {first.stderr.strip()}")
        self.made.append(self.names[0])
        ip("link", "add", self.bridge, "type", "bridge")
        ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            if i:
                ip("netns", "add", ns)
                self.made.append(ns)
            host_end = f"v{self.tag}{i}"
            ip("link", "add", host_end, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            ip("link", "set", host_end, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            ip("-n", ns, "link", "set", IFNAME, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def exec(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def pids(self, i: int) -> list[int]:
        proc = ip("netns", "pids", self.names[i], check=False)
        return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []

    def teardown(self) -> list[str]:
        """Kill every process in the namespaces, delete them and the bridge; return what is left."""
        kill_until_gone(lambda: [p for i in range(len(self.made)) for p in self.pids(i)], timeout=6)
        # Delete the host ends of the veth pairs first (that removes both ends at once); a veth whose
        # namespace is deleted is otherwise destroyed by the kernel asynchronously, a moment later.
        for i in range(len(self.names)):
            ip("link", "del", f"v{self.tag}{i}", check=False)
        for ns in self.made:
            ip("netns", "del", ns, check=False)
        ip("link", "del", self.bridge, check=False)
        deadline = time.monotonic() + 15
        while True:
            left = [ns for ns in self.made if ns in ip("netns", "list").stdout.split()]
            if ip("link", "show", self.bridge, check=False).returncode == 0:
                left.append(self.bridge)
            left += [line for line in ip("-o", "link", "show").stdout.splitlines() if f"v{self.tag}" in line]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)


def start_node(
    hosts: Hosts, i: int, temp_dir: str, env: dict[str, str], head: str | None, *extra: str
) -> None:
    """``ray start`` inside namespace ``i``: the head when ``head`` is None, else a node joining it."""
    where = (
        ["--head", "--port=6379", "--dashboard-host=0.0.0.0", "--dashboard-port=8265"]
        if head is None
        else [f"--address={head}:6379"]
    )
    args = [
        *hosts.exec(i),
        RAY,
        "start",
        *where,
        f"--node-ip-address={hosts.addr(i)}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        *extra,
    ]
    proc = run(args, dict(env, GLOO_SOCKET_IFNAME=IFNAME), timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(
            f"ray start in {hosts.names[i]} failed ({proc.returncode}):\n{proc.stdout[-4000:]}"
        )


def kill_all(hosts: Hosts, markers: list[str]) -> list[int]:
    return kill_owned(markers, [p for i in range(len(hosts.made)) for p in hosts.pids(i)])
