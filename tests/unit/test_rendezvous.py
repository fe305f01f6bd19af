"""Rank 0's rendezvous store listens on one address of its own, never on every interface
(``cluster.rank.dist.bind_store``, ``store_address``): loopback when the group is on one node, else the node's
address (or ``scaling.socket_ifname``'s); its socket is ours, so an IPv4 client is not seen as IPv4-mapped
IPv6, which /etc/hosts does not list (the store's host-name lookup of it waits on DNS, 5 s where DNS does
not answer). gloo listens on the same choice (``listen_on``). Real TCPStores read back from the kernel's
table of listening sockets, no Ray."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch.distributed as dist

from cluster.core.errors import ConfigError
from cluster.rank.dist import bind_store, interface_address, interface_of, listen_on, store_address

pytestmark = pytest.mark.timeout(60)


def listening(port: int) -> list[str]:
    """The local addresses listening on ``port``, as the kernel's tables say (hex, as in /proc/net/tcp*)."""
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as fh:
            for row in fh.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A" and local.endswith(f":{port:04X}"):
                    found.append(local.rsplit(":", 1)[0])
    return found


def other_address() -> str | None:
    """An IPv4 address of this machine that is not loopback, if it has one."""
    for _, name in socket.if_nameindex():
        address = interface_address(name)
        if address and not address.startswith("127."):
            return address
    return None


def connect(host: str, port: int, timeout_s: float = 5) -> dist.TCPStore:
    return dist.TCPStore(host, port, 3, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


@pytest.mark.parametrize("ipv4", [True, False], ids=["ipv4-node", "ipv6-node"])
def test_the_store_listens_on_loopback_only_by_default_and_serves_its_clients(ipv4: bool) -> None:
    store, port = bind_store(3, 10, ipv4)
    assert listening(port) == (["0100007F"] if ipv4 else ["00000000000000000000000001000000"])
    host = "127.0.0.1" if ipv4 else "::1"
    clients = [connect(host, port) for _ in range(2)]
    clients[0].set("from-rank-1", b"1")
    clients[1].add("count", 2)
    assert store.get("from-rank-1") == b"1"
    assert clients[0].add("count", 1) == 3
    del clients, store


def test_the_store_listens_on_the_node_address_it_is_given_and_nowhere_else() -> None:
    address = other_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    store, port = bind_store(2, 10, host=address)
    assert listening(port) == [socket.inet_aton(address)[::-1].hex().upper()]
    assert connect(address, port).add("n", 1) == 1
    with pytest.raises(Exception, match=r"(?i)connect|refused|timed? ?out"):
        connect("127.0.0.1", port, 1)  # not every interface: loopback is not listened on
    del store


def test_the_address_is_loopback_on_one_node_else_the_interface_or_the_node() -> None:
    assert store_address("10.0.0.5", spans_nodes=False) == "127.0.0.1"
    assert store_address("fd00::5", spans_nodes=False) == "::1"
    assert store_address("10.0.0.5", spans_nodes=True) == "10.0.0.5"
    assert store_address("10.0.0.5", spans_nodes=True, socket_ifname="lo") == "127.0.0.1"
    assert store_address("10.0.0.5", spans_nodes=False, socket_ifname="lo") == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"scaling\.socket_ifname='no-such-if0' has no IPv4 address"):
        store_address("10.0.0.5", spans_nodes=True, socket_ifname="no-such-if0")


def test_gloo_is_pointed_at_the_interface_holding_the_address(monkeypatch: pytest.MonkeyPatch) -> None:
    assert interface_of("127.0.0.1") is not None
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    listen_on("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == interface_of("127.0.0.1")
    assert interface_address(os.environ["GLOO_SOCKET_IFNAME"]) == "127.0.0.1"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    listen_on("203.0.113.77")  # held by no interface: left as it was (logged)
    assert "GLOO_SOCKET_IFNAME" not in os.environ
