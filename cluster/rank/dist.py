"""The process group, written once: rendezvous store, init with an explicit timeout, device, cleanup.

Rendezvous is race-free: rank 0 binds a TCPStore on port 0 (the kernel picks a free port while the
socket is already bound) and publishes the address; the other ranks connect to it. Nobody picks a port
and hopes it is still free. Nothing listens on every interface: the store and gloo listen on one address
(:func:`store_address`; docs/cluster.md, "Security").
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from cluster.core.errors import ConfigError

logger = logging.getLogger(__name__)


def bind_store(
    world_size: int, timeout_s: float, ipv4: bool = True, host: str | None = None
) -> tuple[dist.TCPStore, int]:
    """Rank 0: listen on ``host`` (an address of this machine; default loopback: ``127.0.0.1``, or ``::1``
    without ``ipv4``) on a kernel-chosen port; return
    the store and the port. Never every interface: see :func:`store_address` for which address.

    The listening socket is ours, bound to that one address, and handed to the store
    (``master_listen_fd``; the store owns and closes it). torch's own listens dual-stack on every interface,
    so a client's address reaches it as IPv4-mapped IPv6 (``::ffff:127.0.0.1``), and the store looks up
    that address's host name on every connect (``getnameinfo``, for its log lines): /etc/hosts does not list
    that form, so each connect waits on DNS, in the store's one event-loop thread; where DNS drops or does
    not answer reverse queries (air-gapped clusters, sandboxes, a loaded resolver) a connect stalls for the
    resolver timeout (5 s) and every connect queued behind it with it. Measured with 31 clients connecting
    at once (torch 2.13): 3-13 of them took 5-10 s through torch's socket, none over 0.05 s through this
    one, connecting to 127.0.0.1."""
    host = host or ("127.0.0.1" if ipv4 else "::1")
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(LISTEN_BACKLOG)
    port = listener.getsockname()[1]
    kwargs: dict[str, Any] = {"master_listen_fd": listener.detach()}
    if torch.torch_version.TorchVersion(torch.__version__) < "2.8":
        kwargs["use_libuv"] = False  # libuv took a given socket without listening on it before 2.8
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        **kwargs,
    )
    return store, int(store.port)


LISTEN_BACKLOG = 4096
"""Pending connections rank 0's store accepts (the kernel caps it at ``net.core.somaxconn``)."""


def store_address(node_ip: str, spans_nodes: bool, socket_ifname: str | None = None) -> str:
    """The one address rank 0's store (and every rank's gloo) listens on, and every rank connects to: the
    address of ``socket_ifname`` (``scaling.socket_ifname``) when set; else the loopback address when the
    whole group is on rank 0's node (nothing off the machine can reach it; its name is in /etc/hosts: no
    DNS, see :func:`bind_store`); else the node's address (Ray's)."""
    if socket_ifname:
        found = interface_address(socket_ifname)
        if found is None:  # a ConfigError: the same on every attempt, so never retried
            names = ", ".join(n for _, n in socket.if_nameindex())
            raise ConfigError(
                f"scaling.socket_ifname={socket_ifname!r} has no IPv4 address on node {socket.gethostname()} "
                f"(its interfaces: {names}); name the interface of the network the nodes share "
                "(`ip -4 addr`), or remove scaling.socket_ifname"
            )
        return found
    if not spans_nodes:
        return "::1" if ":" in node_ip else "127.0.0.1"
    return node_ip


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` (Linux), or None."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` (Linux), or None."""
    if ":" in address:
        try:
            with open("/proc/net/if_inet6") as fh:
                rows = [line.split() for line in fh]
        except OSError:
            return None
        want = socket.inet_pton(socket.AF_INET6, address).hex()
        return next((row[5] for row in rows if len(row) >= 6 and row[0] == want), None)
    for _, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def listen_on(address: str) -> None:
    """Make this process's next gloo group listen on ``address`` only (``GLOO_SOCKET_IFNAME``: gloo binds to
    the address of the interface it names; by default it binds to whatever the host name resolves to).
    Leaves it as it is when the interface is not found (logged)."""
    name = interface_of(address)
    if name is None:
        logger.warning("no network interface holds %s; gloo listens where the host name resolves", address)
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name


def connect_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(
        host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def pick_device(use_gpu: bool, index: int = 0) -> torch.device:
    """The rank's GPU, ``index`` into the devices this process sees (see :func:`share_gpus`), or the CPU.
    Makes it the calling thread's current device (CUDA keeps one per thread: see :func:`bind_thread`)."""
    if not use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "scaling.use_gpu=true but this worker sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    if index >= torch.cuda.device_count():
        raise RuntimeError(
            f"this rank's GPU is device {index} of CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}, but the process sees {torch.cuda.device_count()}"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def bind_thread(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's current CUDA device. CUDA's current device is per thread and
    starts at 0; a Ray actor runs its methods on a pool of threads, so every method that does CUDA work
    calls this first (else a rank with device 3 would allocate on device 0, another rank's GPU)."""
    if device is not None and device.type == "cuda" and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)


def share_gpus(placements: list[tuple[str, list[str]]], shared: bool = False) -> list[tuple[str, int]]:
    """Per rank: the ``CUDA_VISIBLE_DEVICES`` it should run with and its own GPU's index in that list.

    ``placements[rank]`` is (node id, the GPU ids Ray assigned the rank). Every rank on a node sees the ids
    of all the group's GPUs on that node (sorted: numerically when they are numbers), so NCCL sees the
    node's topology (P2P/NVLink between the ranks there) instead of one isolated device per process; each
    rank selects its own GPU by its id's position. What Ray Train does for its workers too. Two ranks of
    one node holding the same GPU is an error (NCCL would stop with "Duplicate GPU detected") unless
    ``shared`` (fractional GPUs over gloo)."""
    by_node: dict[str, set[str]] = {}
    for rank, (node, ids) in enumerate(placements):
        if not ids:
            raise ValueError(f"rank {rank} was assigned no GPU on node {node[:12]}")
        mine = by_node.setdefault(node, set())
        taken = mine.intersection(ids)
        if taken and not shared:
            raise ValueError(
                f"rank {rank} holds GPU {sorted(taken)} of node {node[:12]}, as another rank does"
            )
        mine.update(ids)
    lists = {node: sorted(ids, key=_gpu_key) for node, ids in by_node.items()}
    return [(",".join(lists[node]), lists[node].index(ids[0])) for node, ids in placements]


def _gpu_key(gpu_id: str) -> tuple[int, int, str]:
    return (0, int(gpu_id), "") if gpu_id.isdigit() else (1, 0, gpu_id)


def init_process_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float,
    backend: str = "auto",
) -> str:
    """``backend`` ("auto": nccl on CUDA, gloo on CPU), with an explicit timeout. Returns the backend.

    Under gloo it also records the group's TCP connections to its peers (see :func:`sever_peers`)."""
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if backend == "nccl" else {}
    before = _socket_inodes() if backend == "gloo" else {}
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,  # type: ignore[arg-type]
    )
    if backend == "gloo":
        _record_peer_connections(before)
    return backend


# ----------------------------------------------------------------------------- leaving a failed gloo group
# A gloo collective fails only when a peer's connection closes (or at the process-group timeout). When a rank
# dies, its neighbours fail at once; but a rank whose collective failed keeps its own connections open for
# as long as its process group object lives, and DistributedDataParallel keeps that object alive for the
# life of the process (``destroy_process_group`` and ``ProcessGroup.abort`` do not close them under gloo,
# torch 2.13). The ranks waiting on that live-but-failed rank would wait until the timeout. So a rank that
# leaves a failed group shuts down (shutdown(2), not close: the file descriptors stay gloo's) the TCP
# connections its group opened to its peers: each peer's collective fails at once, it leaves in turn, and
# the failure reaches every rank in milliseconds, with every process and its memory intact.
_peer_connections: dict[int, int] = {}  # fd -> socket inode, of the current gloo group's peer connections


def _socket_inodes() -> dict[int, int]:
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: nothing recorded, nothing severed (the timeout still applies)
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(name)] = int(target[8:-1])
    return out


def _tcp_table() -> dict[int, tuple[str, int, int]]:
    """socket inode -> (TCP state as in /proc/net/tcp: 01 established, 0A listening; local port; remote
    port)."""
    out: dict[int, tuple[str, int, int]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh)
                for line in fh:
                    parts = line.split()
                    local, remote = parts[1].rsplit(":", 1)[1], parts[2].rsplit(":", 1)[1]
                    out[int(parts[9])] = (parts[3], int(local, 16), int(remote, 16))
        except OSError:
            continue
    return out


def _record_peer_connections(before: dict[int, int]) -> None:
    """Find the group's peer connections among the sockets that appeared while it was created: gloo's
    listener is the new listening socket of each rank, and a peer connection is one accepted on this rank's
    listener or made to a peer's (the ports are exchanged once, here). Other sockets that other threads
    opened meanwhile (Ray's) match neither and are never touched."""
    table = _tcp_table()
    new = {fd: inode for fd, inode in _socket_inodes().items() if before.get(fd) != inode}
    mine = sorted({table[i][1] for i in new.values() if i in table and table[i][0] == "0A"})
    ports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ports, mine)
    theirs = {p for i, rank_ports in enumerate(ports) if i != dist.get_rank() for p in rank_ports}
    _peer_connections.clear()
    for fd, inode in new.items():
        state, local, remote = table.get(inode, ("", 0, 0))
        if state == "01" and (local in mine or remote in theirs):
            _peer_connections[fd] = inode


def sever_peers() -> int:
    """Shut down this process's connections of the current gloo group (still the same sockets); return how
    many. Blocked collectives on both ends fail at once."""
    now = _socket_inodes()
    count = 0
    for fd, inode in list(_peer_connections.items()):
        if now.get(fd) != inode:
            continue  # closed, and the number reused for something else: not ours to touch
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError as exc:
            logger.debug("shutdown of gloo connection fd %d: %s", fd, exc)
    _peer_connections.clear()
    return count


def destroy_process_group() -> None:
    """Safe to call on every exit path, initialised or not."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a broken group (a peer died) may fail to tear down; the process moves on
            logger.warning("destroy_process_group failed: %s: %s", type(exc).__name__, exc)


SETUP_AGREE_S = 5.0
"""How long a rank that failed in set-up waits for the other ranks' errors, to tell an error every rank
raises (a bug: the run stops) from one rank's (retried)."""


def same_on_every_rank(store: dist.TCPStore | None, rank: int, world_size: int, signature: str) -> bool:
    """Whether every rank failed its set-up with the same error (``signature``), agreed through the
    rendezvous store: each failing rank posts its error there and waits up to ``SETUP_AGREE_S`` for the
    others'. False when there is nothing to agree through (never connected, or the store went with rank
    0's process)."""
    if world_size == 1:
        return True
    if store is None:  # never connected: nothing to agree through
        return False
    keys = [f"cluster/setup_error/{r}" for r in range(world_size)]
    try:
        store.set(keys[rank], signature)
        deadline = time.monotonic() + SETUP_AGREE_S
        while not store.check(keys):
            if time.monotonic() > deadline:
                return False  # another rank set up without this error (or is slower than the wait)
            time.sleep(0.05)
        return all(store.get(k).decode() == signature for k in keys)
    except Exception as exc:  # the store went with rank 0's process: no agreement to be had
        logger.warning("could not compare the set-up error with the other ranks': %s", exc)
        return False


def mean_over_ranks(total: float, count: float, device: torch.device) -> float:
    """``sum(total) / sum(count)`` over every rank of the group (one collective; count at least 1)."""
    totals = torch.tensor([total, count], dtype=torch.float64)
    if device.type == "cuda":
        totals = totals.to(device)
    dist.all_reduce(totals)
    return float(totals[0]) / max(float(totals[1]), 1.0)
