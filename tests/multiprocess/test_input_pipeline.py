"""training.loader_workers: batches prepared ahead by real DataLoader processes train the same bits as the
training thread's own fetches, resume mid-epoch exactly, and never hand out a batch of an old position."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from cluster.core.errors import ConfigError
from cluster.data.pipeline import InputPipeline, ResumableDistributedSampler, fetch_batch
from cluster.run.checkpoint import MANIFEST, CheckpointStore, step_dir
from cluster.run.storage import Storage
from cluster.spec.config import JobConfig
from cluster.spec.task import Task
from tests.multiprocess.mp_helpers import mp_context, process, run_workers, tiny_config

pytestmark = pytest.mark.timeout(240)


class NoisyItems(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """A plain map-style dataset (no ``get_batch``) whose items draw random numbers (an augmentation) when
    ``noise`` is not 0."""

    def __init__(self, n: int, noise: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x[:, 0] > 0).long()
        self.noise = noise

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return (self.x[i] + self.noise * torch.randn(6) if self.noise else self.x[i]), self.y[i], i


class NoisyTask(Task):
    """task_args: noise (0.1), audit_dir (optional: one JSON line per micro-batch with its sample ids)."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))

    def build_train_dataset(self) -> NoisyItems:
        return NoisyItems(256, float(self.args.get("noise", 0.1)))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        x, y, ids = batch
        audit = self.args.get("audit_dir")
        if audit and self.current is not None:
            with open(os.path.join(str(audit), f"rank{self.current.rank}.jsonl"), "a") as fh:
                fh.write(json.dumps({"step": self.current.global_step, "ids": ids.tolist()}) + "\n")
        return nn.functional.cross_entropy(model(x), y), {}


class Unpicklable(Dataset[int]):
    def __init__(self) -> None:
        self.transform = lambda i: i

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        return int(self.transform(i))


def _config(storage: str, loaders: int, overrides: list[str] | None = None) -> JobConfig:
    return tiny_config(
        storage,
        [
            "training.seed=5",
            "training.epochs=2",
            "training.max_steps_per_epoch=5",
            "training.grad_accum_steps=2",
            f"training.loader_workers={loaders}",
            "checkpoint.every_epochs=0",
            *(overrides or []),
        ],
    )


def _dirs(tmp_path: Path, *names: str) -> list[Path]:
    out = [tmp_path / n for n in names]
    for p in out:
        p.mkdir()
    return out


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, rtol=0, atol=0, msg=name)


def _audit(path: Path) -> list[tuple[int, list[int]]]:
    return [(r["step"], r["ids"]) for r in map(json.loads, open(path))]


@pytest.mark.slow  # > 10 s on 2 cores: full suite only
def test_loader_processes_train_the_same_batches_and_bits_as_the_training_thread(tmp_path: Path) -> None:
    # A get_batch dataset (the char-LM) and plain items, with gradient accumulation (random draws in the
    # dataset differ by design: the module docstring of cluster.data.pipeline).
    # An epoch trained again from another step in the same processes: a fresh iterator from that step.
    plan = [(0, 0), (0, 2), (1, 0)]
    results = {}
    for task in ("jobs.tasks.charlm:CharLMTask", f"{__name__}:NoisyTask"):
        for loaders in (0, 2):
            audit, out = _dirs(tmp_path, f"a-{task[-9:]}-{loaders}", f"o-{task[-9:]}-{loaders}")
            overrides = [f"task={task}", f"task_args.audit_dir={audit}", "task_args.noise=0"]
            cfg = _config(f"{tmp_path}/s-{task[-9:]}-{loaders}", loaders, overrides)
            res = run_workers(2, cfg, f"{tmp_path}/s-{task[-9:]}-{loaders}/run", plan, str(out))
            assert [e[1] for e in res[0]["epochs"]] == [5, 8, 13]
            results[task, loaders] = res, audit
    for task in ("jobs.tasks.charlm:CharLMTask", f"{__name__}:NoisyTask"):
        (inline, _), (loaded, _) = results[task, 0], results[task, 2]
        for rank in range(2):
            _assert_bitwise(inline[rank]["params"], loaded[rank]["params"])
    # the same samples, micro-batch by micro-batch, in the same order
    noisy = f"{__name__}:NoisyTask"
    for rank in range(2):
        inline_ids = _audit(results[noisy, 0][1] / f"rank{rank}.jsonl")
        loaded_ids = _audit(results[noisy, 2][1] / f"rank{rank}.jsonl")
        assert loaded_ids == inline_ids and len(inline_ids) == 13 * 2
        # the restarted epoch trained its steps 3..5 again, the same samples as the first time
        assert [ids for _, ids in inline_ids[10:16]] == [ids for _, ids in inline_ids[4:10]]


@pytest.mark.slow  # > 10 s on 2 cores: full suite only
def test_resume_mid_epoch_with_loader_processes_is_bitwise_an_uninterrupted_run(tmp_path: Path) -> None:
    (full_out, part_out, resumed_out) = _dirs(tmp_path, "full", "part", "resumed")
    ckpt = ["checkpoint.every_steps=3", "checkpoint.keep_last=5", f"task={__name__}:NoisyTask"]
    full = run_workers(
        2, _config(f"{tmp_path}/f", 2, ckpt), f"{tmp_path}/f/run", [(0, 0), (1, 0)], str(full_out)
    )
    run = f"{tmp_path}/p/run"
    run_workers(2, _config(f"{tmp_path}/p", 2, ckpt), run, [(0, 0)], str(part_out))
    # Keep the checkpoint of step 3 (mid-epoch 0) only, as if the job had died at step 4.
    store = CheckpointStore(Storage(run))
    for info in store.list():
        if info.step != 3:
            store.storage.rm(f"{step_dir(info.step)}/{MANIFEST}")
    assert [i.step for i in store.list()] == [3]
    resumed = run_workers(2, _config(f"{tmp_path}/p", 2, ckpt), run, [(-1, -1), (1, 0)], str(resumed_out))
    assert resumed[0]["resume"].global_step == 3 and resumed[0]["resume"].step_in_epoch == 3
    assert resumed[0]["epochs"][-1][1] == full[0]["epochs"][-1][1] == 10
    for rank in range(2):
        _assert_bitwise(full[rank]["params"], resumed[rank]["params"])


def test_a_new_epoch_never_gets_a_batch_prefetched_for_the_old_position() -> None:
    dataset = NoisyItems(256, 0.1)
    inputs = InputPipeline(dataset, loader_workers=2, prefetch=2, grad_accum=2, seed=5)
    sampler = ResumableDistributedSampler(len(dataset), 32, rank=1, world_size=2, seed=5)
    device = torch.device("cpu")
    try:
        inputs.open(device)
        sampler.set_epoch(0, 0)
        inputs.start_epoch(sampler, device)
        first = next(iter(sampler))
        batch = inputs.fetch(torch.tensor_split(first, 2)[0], (0, 0, 0))  # the loaders prefetch more
        assert batch[2].tolist() == torch.tensor_split(first, 2)[0].tolist()
        # cut short (a stop), then the epoch again from step 3, then another epoch
        for epoch, start in ((0, 3), (1, 6)):
            sampler.set_epoch(epoch, start)
            inputs.start_epoch(sampler, device)
            for step, local_idx in enumerate(sampler, start=start):
                for micro, chunk in enumerate(torch.tensor_split(local_idx, 2)):
                    got = inputs.fetch(chunk, (epoch, step, micro))
                    assert got[2].tolist() == chunk.tolist()
                    assert torch.equal(got[1], fetch_batch(dataset, chunk)[1])
    finally:
        inputs.close()


def test_an_unpicklable_dataset_is_a_config_error_naming_the_setting() -> None:
    inputs = InputPipeline(Unpicklable(), loader_workers=1, prefetch=2, grad_accum=1, seed=0)
    with pytest.raises(ConfigError, match=r"training\.loader_workers=1 .* or set training\.loader_workers=0"):
        inputs.open(torch.device("cpu"))


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _loaders_then_die(cfg: JobConfig, out: str) -> None:
    """A rank that starts its loader processes, writes their pids (and the fork server's), then dies by
    SIGKILL, as a rank does when its node's OOM killer or a fault takes it."""
    import signal

    from cluster.data.pipeline import InputPipeline as Pipeline

    pipeline = Pipeline(tiny_dataset(), 2, 2, 1, 0)
    pipeline.open(torch.device("cpu"))
    servers = _children(os.getpid())
    loaders = [c for s in servers for c in _children(s)]
    with open(f"{out}/pids.json", "w") as fh:
        json.dump({"servers": servers, "loaders": loaders}, fh)
    os.kill(os.getpid(), signal.SIGKILL)


def tiny_dataset() -> Any:
    from cluster.data.pipeline import TensorBatchDataset

    return TensorBatchDataset(torch.arange(64.0).reshape(32, 2), torch.zeros(32, dtype=torch.long))


@pytest.mark.timeout(60)
def test_loader_processes_end_when_their_rank_is_killed(tmp_path: Path) -> None:
    import time

    from cluster.data.pipeline import _alive

    proc = process(mp_context(), _loaders_then_die, (None, str(tmp_path)))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -9
    pids = json.loads((tmp_path / "pids.json").read_text())
    assert len(pids["loaders"]) == 2 and pids["servers"]
    deadline = time.monotonic() + 15
    left = pids["loaders"] + pids["servers"]
    while left and time.monotonic() < deadline:
        left = [p for p in left if _alive(p)]
        time.sleep(0.2)
    for pid in left:  # never leave them behind, whatever the outcome
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
    assert not left, f"loader processes {left} outlived their rank"


def test_step_rows_say_how_long_the_step_waited_for_its_batches(tmp_path: Path) -> None:
    """``input_wait_s``: rank 0's wait for its batches in a logged step; a read that takes 40 ms shows."""
    waits = {}
    for name, sleep in (("slow", 0.04), ("fast", 0.0)):
        cfg = tiny_config(
            str(tmp_path / "runs"),
            [
                f"name={name}",
                "task=tests.support.tasks:Broken",
                f"task_args={{mode: ok, read_sleep_s: {sleep}}}",
                "training.global_batch_size=8",
                "training.epochs=1",
            ],
        )
        out = tmp_path / name
        out.mkdir()
        (rank0,) = run_workers(1, cfg, str(tmp_path / "runs" / name), [(0, 0)], str(out))
        rows = [r for r in rank0["rows"] if "input_wait_s" in r]  # the step rows (not the eval's)
        assert len(rows) == 8 and all(r["input_wait_s"] <= r["step_time_s"] for r in rows)
        waits[name] = min(r["input_wait_s"] for r in rows)
    assert waits["slow"] >= 0.04 > waits["fast"]
