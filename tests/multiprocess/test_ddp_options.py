"""The worker's DDP wrap over real gloo process groups: bitwise what a hand-written DDP loop with
``DistributedSampler`` and ``DataLoader`` computes on a plain map-style dataset (with and without buffers),
and ``training.compile`` trains what eager mode trains."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from cluster.run.checkpoint import CheckpointStore
from cluster.run.storage import Storage
from cluster.spec.config import JobConfig
from cluster.spec.task import build_task
from tests.multiprocess.mp_helpers import mp_context, process, run_workers, tiny_config
from tests.support.tasks import MapStyleTask

pytestmark = pytest.mark.timeout(240)

TASK = "tests.support.tasks:MapStyleTask"


class ProbeTask(MapStyleTask):
    """Records, per rank, what training.deterministic must have set in the worker process."""

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        cur = self.current
        assert cur is not None
        probe = {
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        }
        with open(os.path.join(str(self.args["probe_dir"]), f"rank{cur.rank}.json"), "w") as fh:
            json.dump(probe, fh)
        return super().compute_loss(model, batch)


def _config(storage: str, overrides: list[str]) -> JobConfig:
    return tiny_config(
        storage,
        [
            f"task={TASK}",
            "training.seed=7",
            "training.epochs=2",
            "training.max_steps_per_epoch=5",
            "checkpoint.every_epochs=0",
            *overrides,
        ],
    )


def _bare_ddp(rank: int, world: int, cfg: JobConfig, port: int, out: str) -> None:
    """What a user writes by hand: DDP with its defaults, DistributedSampler + DataLoader, set_epoch."""
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        t = cfg.training
        task = build_task(cfg.task, cfg.task_args)
        dataset = task.build_train_dataset()
        torch.manual_seed(t.seed)
        model = DDP(task.build_model())
        optimizer = task.build_optimizer(model.module)
        sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=t.seed, drop_last=True)
        loader = DataLoader(dataset, batch_size=t.global_batch_size // world, sampler=sampler, drop_last=True)
        for epoch in range(t.epochs):
            sampler.set_epoch(epoch)
            for step, batch in enumerate(loader):
                if step == t.max_steps_per_epoch:
                    break
                loss, _ = task.compute_loss(model, batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        torch.save(model.module.state_dict(), f"{out}/bare{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        with open(f"{out}/bare{rank}.err", "w") as fh:
            fh.write(traceback.format_exc())
        raise
    sys.stdout.flush()
    os._exit(0)  # as mp_helpers._entry: results are on disk, skip the interpreter's teardown


def _run_bare(world: int, cfg: JobConfig, out: Path) -> list[dict[str, torch.Tensor]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp_context()
    procs = [process(ctx, _bare_ddp, (r, world, cfg, port, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    for r, p in enumerate(procs):
        p.join(120)
        if p.is_alive():
            p.kill()
        err = out / f"bare{r}.err"
        assert p.exitcode == 0, err.read_text() if err.exists() else f"exit code {p.exitcode}"
    return [torch.load(out / f"bare{r}.pt") for r in range(world)]


@pytest.mark.slow  # > 10 s on 2 cores: full suite only
@pytest.mark.parametrize("batchnorm", [False, True], ids=["no-buffers", "batchnorm-buffers"])
def test_worker_is_bitwise_a_hand_written_ddp_loop_on_a_map_style_dataset(
    tmp_path: Path, batchnorm: bool
) -> None:
    cfg = _config(f"{tmp_path}/s", [f"task_args.batchnorm={str(batchnorm).lower()}"])
    (tmp_path / "w").mkdir()
    (tmp_path / "b").mkdir()
    mine = run_workers(2, cfg, f"{tmp_path}/s/run", [(0, 0), (1, 0)], str(tmp_path / "w"))
    bare = _run_bare(2, cfg, tmp_path / "b")
    assert mine[0]["epochs"][-1][1] == 10
    for rank in range(2):
        assert mine[rank]["params"].keys() == bare[rank].keys()
        for name, value in bare[rank].items():
            torch.testing.assert_close(
                mine[rank]["params"][name], value, rtol=0, atol=0, msg=f"{rank} {name}"
            )
    if batchnorm:
        # Rank 1's running statistics are rank 0's broadcast before the last forward, updated with rank 1's
        # last batch: equal to the bare loop's only if the worker broadcasts buffers as DDP's default does.
        stats = [mine[r]["params"]["1.running_mean"] for r in range(2)]
        assert not torch.equal(stats[0], stats[1]) and not torch.equal(stats[0], torch.zeros(16))


def _cxx_missing() -> bool:
    return shutil.which(os.environ.get("CXX", "g++")) is None


@pytest.mark.slow  # > 10 s on 2 cores: full suite only
@pytest.mark.skipif(_cxx_missing(), reason="torch.compile's CPU backend needs a C++ compiler (g++ or $CXX)")
def test_compiled_training_matches_eager_and_checkpoints_the_plain_model(tmp_path: Path) -> None:
    base = ["training.grad_accum_steps=2", "training.grad_clip=1.0", "training.epochs=1"]
    (tmp_path / "e").mkdir()
    (tmp_path / "c").mkdir()
    eager = run_workers(2, _config(f"{tmp_path}/e", base), f"{tmp_path}/e/run", [(0, 0)], str(tmp_path / "e"))
    compiled_cfg = _config(f"{tmp_path}/c", [*base, "training.compile=true"])
    compiled = run_workers(2, compiled_cfg, f"{tmp_path}/c/run", [(0, 0)], str(tmp_path / "c"), timeout=200)
    moved = False
    for name, value in eager[0]["params"].items():
        torch.testing.assert_close(compiled[0]["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(compiled[1]["params"][name], compiled[0]["params"][name], rtol=0, atol=0)
        moved |= not torch.equal(value, _initial()[name])
    assert moved
    # the checkpoint holds the plain module's state dict: it loads into a freshly built model
    loaded = CheckpointStore(Storage(f"{tmp_path}/c/run")).load_latest()
    assert loaded is not None and loaded.info.step == 5
    fresh = build_task(TASK, compiled_cfg.task_args).build_model()
    fresh.load_state_dict(loaded.files["model.pt"])  # strict: no _orig_mod. or module. prefixes
    torch.testing.assert_close(fresh.state_dict(), compiled[0]["params"], rtol=0, atol=0)


def test_deterministic_sets_up_every_rank_and_leaves_cpu_results_alone(tmp_path: Path) -> None:
    params = {}
    for deterministic in (True, False):
        probe, out = tmp_path / f"probe-{deterministic}", tmp_path / f"o-{deterministic}"
        probe.mkdir()
        out.mkdir()
        cfg = _config(
            f"{tmp_path}/s-{deterministic}",
            [
                f"task={__name__}:ProbeTask",
                f"task_args.probe_dir={probe}",
                f"training.deterministic={str(deterministic).lower()}",
                "training.epochs=1",
            ],
        )
        res = run_workers(2, cfg, f"{tmp_path}/s-{deterministic}/run", [(0, 0)], str(out))
        params[deterministic] = res[0]["params"]
        for rank in range(2):
            seen = json.loads((probe / f"rank{rank}.json").read_text())
            assert seen["deterministic"] is deterministic
            if deterministic:
                assert seen["cublas"] == ":4096:8"
    # deterministic mode changes no CPU result: both variants train the same bits
    torch.testing.assert_close(params[True], params[False], rtol=0, atol=0)


def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    return MapStyleTask().build_model().state_dict()
