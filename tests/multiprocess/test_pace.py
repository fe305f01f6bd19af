"""``StepPace`` under real DDP over a real gloo group of two processes: a rank that is slower in its own part
of the step (here 200 ms of input wait) shows it in ``compute_s``; the other rank's ``compute_s`` leaves
out the time it waits for it, though both ranks' steps last the same: in the gradient all-reduce, and, for
a model with buffers, in DDP's buffer broadcast at the start of each forward.

Each rank computes on one thread, and the lag is many times a step's own work (a tiny model); each bound
lies half a lag from both the right measure and the wrong one (one that counted the wait): what a busy
machine adds to the ranks' own work moves no result across a bound."""

from __future__ import annotations

import socket
import time
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cluster.rank.pace import StepPace
from tests.multiprocess.mp_helpers import mp_context, process

pytestmark = pytest.mark.timeout(120)

LAG_S, STEPS = 0.2, 12


def _rank(rank: int, port: int, buffers: bool, q: Any) -> None:
    try:
        # One intra-op thread (OMP_NUM_THREADS here would come too late: torch is imported): on a busy
        # machine a pool's threads wait for a preempted sibling, which stretches a step's own part
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        torch.manual_seed(0)
        norm = nn.BatchNorm1d(64) if buffers else nn.Identity()  # running statistics: buffers
        layers = [nn.Linear(32, 64), norm, nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)]
        raw = nn.Sequential(*layers)
        model = DDP(raw, gradient_as_bucket_view=True)  # as the worker wraps it; buffers synced at forward
        opt = torch.optim.SGD(raw.parameters(), lr=0.01)
        pace = StepPace()
        pace.attach(raw, torch.device("cpu"), syncing=model if buffers else None)
        for _ in range(STEPS):
            t0 = time.perf_counter()
            pace.begin()
            if rank == 1:
                time.sleep(LAG_S)  # a slow input fetch on this rank only
            model(torch.randn(16, 32)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            pace.end(time.perf_counter() - t0)
        p = pace.take()
        dist.destroy_process_group()
        q.put((rank, p))
    except BaseException:
        q.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("buffers", [False, True], ids=["no-buffers", "buffers-broadcast-at-forward"])
def test_the_slow_rank_s_own_part_is_longer_and_the_other_s_excludes_its_wait(buffers: bool) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp_context()
    q = ctx.Queue()
    procs = [process(ctx, _rank, (r, port, buffers, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r in (0, 1):
        assert not isinstance(got[r], str), got[r]
    fast, slow = got[0], got[1]
    assert fast.steps == slow.steps == STEPS
    assert slow.compute_s - fast.compute_s > 0.5 * LAG_S, (fast, slow)  # about LAG_S; 0 if it counted waits
    # rank 0 waits for rank 1 at every step's all-reduce: its step is as long, its own part is not
    assert fast.step_s > 0.5 * LAG_S and fast.compute_s < fast.step_s - 0.5 * LAG_S, fast
