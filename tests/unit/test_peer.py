"""The peer-recovery rule and the state digest: pure logic, no processes."""

from __future__ import annotations

import pytest
import torch

from cluster.rank.peer_transfer import BUCKET_BYTES, _buckets, _flatten, _slots, _unflatten, state_digest
from cluster.seam.peers import PeerPlan, PeerState, plan_recovery

pytestmark = pytest.mark.timeout(30)


def peer(rank: int, step: int, digest: str = "d", unsendable: str = "") -> PeerState:
    return PeerState(rank, step, 0, step, digest, 100, unsendable)


def test_the_highest_step_wins_and_its_lowest_rank_sends() -> None:
    plan = plan_recovery({0: peer(0, 7, "old"), 1: peer(1, 8, "new"), 3: peer(3, 8, "new")})
    assert plan == PeerPlan(1, 8, 0, 8, "new", 100, (1, 3))


@pytest.mark.parametrize(
    ("peers", "why"),
    [
        ({}, "no healthy survivor"),
        ({0: peer(0, 8, "a"), 1: peer(1, 8, "b")}, "hold different states"),
        ({0: peer(0, 6), 1: peer(1, 8)}, "more than one step apart"),
        ({0: peer(0, 8, unsendable="sharded")}, "cannot be sent: sharded"),
    ],
)
def test_every_doubt_falls_back_with_a_reason(peers: dict[int, PeerState], why: str) -> None:
    reason = plan_recovery(peers)
    assert isinstance(reason, str) and why in reason


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4, generator=g)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "train_state": {"global_step": 3, "optimizer": opt.state_dict(), "scheduler": None},
    }


def test_digest_sees_a_one_bit_change_and_ignores_nothing() -> None:
    a, b = _state(), _state()
    assert state_digest(a) == state_digest(b)
    digest, nbytes = state_digest(a)
    assert nbytes == sum(
        t.numel() * t.element_size() for t in _flatten(a)[1]
    )  # every tensor counted, optimizer state included
    w = b["model"]["weight"]
    w.view(torch.int32)[0, 0] ^= 1  # flip the lowest bit of one float
    assert state_digest(b)[0] != digest
    c = _state()
    c["train_state"]["global_step"] = 4  # a plain value too
    assert state_digest(c)[0] != digest
    d = _state()
    sq = d["train_state"]["optimizer"]["state"][0]["exp_avg_sq"]
    sq[0, 0] = torch.nextafter(sq[0, 0], torch.tensor(1.0))  # the next float up
    assert state_digest(d)[0] != digest


def test_flatten_round_trips_and_buckets_split_by_dtype_and_size() -> None:
    state = {
        "a": torch.ones(3),
        "b": [torch.zeros(2, dtype=torch.int64), 5, "x"],
        "c": (torch.empty(0), torch.ones(2, 2)),
    }
    skeleton, tensors = _flatten(state)
    back = _unflatten(skeleton, tensors)
    assert back["b"][1:] == [5, "x"] and torch.equal(back["c"][1], state["c"][1])
    slots = _slots(skeleton)
    buckets = _buckets(slots)
    assert {b[0].dtype for b in buckets} == {torch.float32, torch.int64}
    assert sum(len(b) for b in buckets) == 3  # the empty tensor travels in no bucket
    big = int(BUCKET_BYTES // 4 * 0.6)
    many = _buckets(_slots(_flatten([torch.empty(0)] + [torch.empty(big)] * 3)[0]))
    assert [len(b) for b in many] == [1, 1, 1]  # 0.6 + 0.6 > one bucket


def test_a_sharded_optimizer_is_reported_unsendable(tmp_path: object) -> None:
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from cluster.rank.ddp import unsendable as _unsendable

    model = torch.nn.Linear(2, 2)
    assert _unsendable(torch.optim.AdamW(model.parameters())) == ""
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp_path}/store", 1), rank=0, world_size=1)
    try:
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        assert "shards the optimizer state" in _unsendable(zero)
    finally:
        dist.destroy_process_group()
