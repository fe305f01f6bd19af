"""What the entry points refuse before Ray starts: an embedded Ray asked for more CPUs than the machine."""

from __future__ import annotations

import os

import pytest

from cluster.api.train import check_embedded_fits
from cluster.core.errors import ConfigError
from cluster.spec.load import load_config

pytestmark = [pytest.mark.timeout(30)]


def test_more_workers_than_cores_on_the_embedded_ray_is_refused_naming_what_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cores = os.cpu_count() or 1
    cfg = load_config(
        None, [f"scaling.num_workers={cores * 8}", "training.global_batch_size=" + str(cores * 8)]
    )
    with pytest.raises(ConfigError) as err:
        check_embedded_fits(cfg)
    text = str(err.value)
    assert f"this machine has {cores}" in text and f"{cores} workers of 1 CPU fit" in text
    assert "scaling.num_workers" in text and "RAY_ADDRESS" in text
    shared = load_config(None, [f"scaling.num_workers={cores * 2}", "scaling.cpus_per_worker=0.5"])
    check_embedded_fits(shared)  # sharing cores on purpose fits
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    check_embedded_fits(cfg)  # a cluster's CPUs are the cluster's business


def test_a_network_interface_the_machine_lacks_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cluster.rank.dist import store_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(None, ["scaling.socket_ifname=nosuch0"])
    with pytest.raises(ConfigError, match=r"scaling.socket_ifname='nosuch0' is not a network interface"):
        check_embedded_fits(cfg)
    # on a cluster's node (checked by rank 0 as the group starts): a ConfigError too, never retried
    with pytest.raises(ConfigError, match=r"'nosuch0' has no IPv4 address on node"):
        store_address("10.0.0.5", True, "nosuch0")
