"""training.zero over real gloo process groups: a ZeroRedundancyOptimizer of the task's optimizer (two
param groups) trains what the plain optimizer trains; its checkpoints hold the whole state, consolidated on
rank 0; a resume is bitwise, also at another world size, also into the plain optimizer."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cluster.core.errors import WorkerError
from cluster.rank.worker import Worker
from cluster.run.checkpoint import CheckpointStore
from cluster.run.storage import Storage
from cluster.seam.peers import plan_recovery
from cluster.spec.config import JobConfig
from tests.multiprocess.mp_helpers import mp_context, process, run_workers, tiny_config
from tests.support.tasks import MapStyleTask

pytestmark = pytest.mark.timeout(300)

TASK = f"{__name__}:GroupedTask"


class GroupedTask(MapStyleTask):
    """AdamW with two param groups: weight decay on the weights, none on the biases."""

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        return torch.optim.AdamW(
            [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}], lr=0.02
        )


def _config(storage: str, workers: int, zero: bool) -> JobConfig:
    return tiny_config(
        storage,
        [
            f"task={TASK}",
            f"workers={workers}",
            "training.seed=11",
            "training.epochs=2",
            f"training.zero={str(zero).lower()}",
            "checkpoint.every_epochs=1",
        ],
    )


def _run(tmp: Path, name: str, storage: str, workers: int, zero: bool, plan: list[tuple[int, int]]) -> Any:
    out = tmp / name
    out.mkdir()
    return run_workers(workers, _config(storage, workers, zero), f"{storage}/run", plan, str(out))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.slow  # > 10 s on 2 cores: full suite only
def test_zero_trains_what_the_plain_optimizer_trains_and_resumes_exactly_at_any_world_size(
    tmp_path: Path,
) -> None:
    plain = _run(tmp_path, "plain", f"{tmp_path}/p", 2, False, [(0, 0), (1, 0)])
    zero = _run(tmp_path, "zero", f"{tmp_path}/z", 2, True, [(0, 0), (1, 0)])
    for name, value in plain[0]["params"].items():
        torch.testing.assert_close(zero[0]["params"][name], value, rtol=1e-6, atol=1e-7, msg=name)
    _same(zero[0]["params"], zero[1]["params"])  # both ranks hold the whole model
    n_params = len(plain[0]["params"])
    assert plain[0]["optimizer"] == ("AdamW", n_params)
    kinds = {r["optimizer"][0] for r in zero}
    shards = [r["optimizer"][1] for r in zero]
    assert kinds == {"ZeroRedundancyOptimizer"}
    assert sum(shards) == n_params and all(0 < n < n_params for n in shards)  # each rank: its share

    # the checkpoint holds every parameter's optimizer state, in the task's two groups
    loaded = CheckpointStore(Storage(f"{tmp_path}/z/run")).load_latest()
    assert loaded is not None
    opt = loaded.files["train_state.pt"]["optimizer"]
    assert sorted(opt["state"]) == list(range(n_params))
    assert [g["weight_decay"] for g in opt["param_groups"]] == [0.1, 0.0]

    # stop after epoch 0; resume in new processes at 2 ranks, at 1 rank, and at 1 rank without zero
    _run(tmp_path, "first", f"{tmp_path}/f", 2, True, [(0, 0)])
    for copy in ("f1", "f1plain"):
        shutil.copytree(f"{tmp_path}/f", f"{tmp_path}/{copy}")
    (resumed, _) = _run(tmp_path, "resumed", f"{tmp_path}/f", 2, True, [(-1, -1)])
    assert resumed["resume"].global_step > 0
    _same(zero[0]["params"], resumed["params"])
    (one,) = _run(tmp_path, "one", f"{tmp_path}/f1", 1, True, [(-1, -1)])
    (one_plain,) = _run(tmp_path, "one-plain", f"{tmp_path}/f1plain", 1, False, [(-1, -1)])
    assert one["resume"].world_size == 2
    _same(one_plain["params"], one["params"])
    # 1 rank is not 2 (the gradient sums differ in their last bits), but it trained on from the same state
    for name, value in zero[0]["params"].items():
        torch.testing.assert_close(one["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def _release_entry(rank: int, cfg: JobConfig, run_url: str, port_q: Any, out: str) -> None:
    import os

    os.environ["CLUSTER_INJECT_FAULT"] = "1:3:raise:0"
    worker = Worker(cfg, rank, 2, run_url, 0)
    if rank == 0:
        port = worker.bind_store()
        port_q.put(port)
    else:
        port = port_q.get(timeout=60)
    worker.setup("127.0.0.1", port)
    with contextlib.suppress(WorkerError):  # rank 1 raises; rank 0's all-reduce fails with it
        worker.run_epoch(0, 0)
    state = worker.release(rank, 2, 1) if rank == 0 else None
    torch.save({"state": state}, f"{out}/rank{rank}.pt")
    os._exit(0)


def test_a_survivor_with_a_sharded_optimizer_reports_it_cannot_send_its_state(tmp_path: Path) -> None:
    """The survivor leaves the failed group without a collective (no consolidation) and says why its state
    cannot be sent: the driver then takes the checkpoint path (``plan_recovery``, tests/unit/test_peer.py)."""
    ctx = mp_context()
    q = ctx.Queue()
    cfg = _config(f"{tmp_path}/s", 2, True)
    procs = [process(ctx, _release_entry, (r, cfg, f"{tmp_path}/s/run", q, str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            p.join(5)
    assert [p.exitcode for p in procs] == [0, 0]
    state = torch.load(tmp_path / "rank0.pt", weights_only=False)["state"]
    assert state.global_step == 2
    assert "shards the optimizer state" in state.unsendable
    assert plan_recovery({0: state}) == f"the survivors' state cannot be sent: {state.unsendable}"
