"""broadcast_state across real gloo processes: every dtype and shape arrives bit for bit, digests agree."""

from __future__ import annotations

import datetime
import os
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess.mp_helpers import mp_context, process

pytestmark = pytest.mark.timeout(120)

WORLD, SOURCE = 3, 1


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            "w": torch.randn(300, 70, generator=g),
            "bf": torch.randn(33, generator=g).to(torch.bfloat16),
            "mask": torch.rand(9, generator=g) > 0.5,
            "count": torch.tensor(5, dtype=torch.int64),
            "empty": torch.empty(0, 4),
        },
        "train_state": {
            "global_step": 12,
            "optimizer": {"state": {0: {"step": torch.tensor(12.0)}}},
            "x": None,
        },
    }


def _entry(rank: int, port: int, out: str, bucket: int) -> None:
    try:
        import cluster.rank.peer_transfer as peer

        peer.BUCKET_BYTES = bucket  # small buckets: the split path is exercised too
        store = dist.TCPStore(
            "127.0.0.1", port, WORLD, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
        mine = _state() if rank == SOURCE else None
        got, moved = peer.broadcast_state(mine, SOURCE, torch.device("cpu"))
        torch.save(
            {"state": got, "digest": peer.state_digest(got), "bytes": moved.nbytes}, f"{out}/{rank}.pt"
        )
        dist.destroy_process_group()
    except BaseException:
        with open(f"{out}/{rank}.err", "w") as fh:
            fh.write(traceback.format_exc())
        raise


@pytest.mark.parametrize("bucket", [256 << 20, 1000])
def test_every_rank_receives_the_sources_state_bit_for_bit(tmp_path: object, bucket: int) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp_context()
    procs = [process(ctx, _entry, (r, port, str(tmp_path), bucket)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(90)
        for r, p in enumerate(procs):
            err = f"{tmp_path}/{r}.err"
            assert p.exitcode == 0, open(err).read() if os.path.exists(err) else p.exitcode
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    want = _state()
    results = [torch.load(f"{tmp_path}/{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(results):
        got = res["state"]
        assert got["train_state"]["global_step"] == 12 and got["train_state"]["x"] is None
        for k, t in want["model"].items():
            assert got["model"][k].dtype == t.dtype and torch.equal(got["model"][k], t), (r, k)
        assert torch.equal(got["train_state"]["optimizer"]["state"][0]["step"], torch.tensor(12.0))
        assert res["digest"] == results[SOURCE]["digest"]
    tensor_bytes = sum(t.numel() * t.element_size() for t in want["model"].values()) + 4
    assert results[0]["bytes"] == tensor_bytes
