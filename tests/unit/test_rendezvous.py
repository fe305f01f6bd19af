"""Rank 0's rendezvous store listens on an IPv4 socket of its own and the ranks of its node connect over
loopback (``cluster.dist.bind_store``, ``store_host``): torch's own socket listens dual-stack, so each
client's address reaches the store as IPv4-mapped IPv6, which /etc/hosts does not list, and the store's
host-name lookup of it waits on DNS (5 s where DNS does not answer). Real TCPStores, no Ray."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from cluster.dist import bind_store, store_host

pytestmark = pytest.mark.timeout(60)


def _listening_in(table: str, port: int) -> bool:
    with open(f"/proc/net/{table}") as fh:
        rows = fh.read().splitlines()[1:]
    # local address column: HEXADDR:HEXPORT; state 0A is LISTEN
    return any(r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A" for r in rows)


@pytest.mark.parametrize("ipv4", [True, False], ids=["ipv4-node", "ipv6-node"])
def test_the_store_listens_ipv4_only_on_an_ipv4_node_and_serves_its_clients(ipv4: bool) -> None:
    store, port = bind_store(3, 10, ipv4)
    assert _listening_in("tcp", port) is ipv4  # ours: IPv4 only
    assert _listening_in("tcp6", port) is not ipv4  # torch's own: dual-stack, for an IPv6 node
    clients = [
        dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=datetime.timedelta(seconds=10))
        for _ in range(2)
    ]
    clients[0].set("from-rank-1", b"1")
    clients[1].add("count", 2)
    assert store.get("from-rank-1") == b"1"
    assert clients[0].add("count", 1) == 3
    del clients, store


def test_ranks_on_rank_0_s_node_connect_over_loopback_the_others_to_its_address() -> None:
    assert store_host("node-a", "node-a", "10.0.0.5") == "127.0.0.1"
    assert store_host("node-b", "node-a", "10.0.0.5") == "10.0.0.5"
    assert store_host("node-a", "node-a", "fd00::5") == "fd00::5"  # no IPv4 listener on an IPv6 node
