"""``cluster.rank.evaluate.evaluate`` over real gloo groups of 1, 2 and 3 processes.

The same model evaluated at any world size gives bitwise the same result, equal to one process computing
the mean over every sample itself; each rank's own BatchNorm statistics (which differ between ranks during
training) are left as they were, while the evaluation used rank 0's (what a checkpoint holds)."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cluster import Task, TensorBatchDataset, load_config
from cluster.data.pipeline import EvalLoader
from cluster.rank.evaluate import EvalResult, evaluate
from cluster.spec.config import JobConfig
from tests.multiprocess.mp_helpers import mp_context, process

pytestmark = pytest.mark.timeout(120)

SAMPLES, BATCH = 203, 16  # 13 batches, the last of 11 samples: uneven shares at 2 and 3 ranks


class BNTask(Task):
    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Dropout(0.5), nn.Linear(12, 3)
        )

    def build_eval_dataset(self) -> TensorBatchDataset:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(SAMPLES, 6, generator=g)
        return TensorBatchDataset(x, torch.randint(0, 3, (SAMPLES,), generator=g))

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = batch
        logits = model(x)
        return nn.functional.cross_entropy(logits, y), {"acc": (logits.argmax(1) == y).double().mean()}


class NoisyEvalSet:
    """A map-style eval set whose reads draw random numbers (noise, as an augmentation would): a loader
    process must draw the same ones an in-turn read does. Module level: loader processes unpickle it."""

    def __init__(self) -> None:
        self.x, self.y = BNTask().build_eval_dataset().tensors

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]


def config() -> JobConfig:
    return load_config(None, [f"evaluation.batch_size={BATCH}"])


def model_with_stats(rank: int) -> nn.Module:
    """The same weights on every rank; running statistics that differ by rank, as after DDP training."""
    model = BNTask().build_model()
    bn = model[1]
    assert isinstance(bn, nn.BatchNorm1d)
    with torch.no_grad():
        bn.running_mean.copy_(torch.linspace(-1, 1, 12) * (rank + 1))
        bn.running_var.fill_(1.0 + rank)
    return model


def _rank(rank: int, world: int, port: int, q: Any, data: str = "plain", loaders: int = 0) -> None:
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        task = BNTask()
        model = model_with_stats(rank)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        dataset = task.build_eval_dataset() if data == "plain" else NoisyEvalSet()
        reader = EvalLoader(dataset, loaders, 2, torch.device("cpu")).batches if loaders else None
        cpu = torch.device("cpu")
        res = evaluate(task, model, dataset, config(), 7, rank, world, cpu, reader=reader)
        after = model.state_dict()
        kept = all(torch.equal(before[k], after[k]) for k in before)
        dist.destroy_process_group()
        q.put((rank, (res, kept, model.training)))
    except BaseException:
        q.put((rank, traceback.format_exc()))


def run(world: int, data: str = "plain", loaders: int = 0) -> list[tuple[EvalResult, bool, bool]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp_context()
    q = ctx.Queue()
    procs = [process(ctx, _rank, (r, world, port, q, data, loaders)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=90) for _ in range(world))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    for r in range(world):
        assert not isinstance(got[r], str), f"rank {r} failed:\n{got[r]}"
    return [got[r] for r in range(world)]


def by_hand() -> tuple[float, float]:
    """Rank 0's model over every sample, in one process: the mean loss and accuracy."""
    torch.set_num_threads(1)
    model = model_with_stats(0).eval()
    x, y = BNTask().build_eval_dataset().tensors
    with torch.no_grad():
        logits = model(x)
    per_sample = nn.functional.cross_entropy(logits, y, reduction="none")
    return float(per_sample.double().mean()), float((logits.argmax(1) == y).double().mean())


def test_the_result_is_the_same_at_every_world_size_and_uses_rank_0_s_statistics() -> None:
    results = {w: run(w) for w in (1, 2, 3)}
    reference = results[1][0][0]
    assert reference.samples == SAMPLES and reference.batches == 13
    for world, ranks in results.items():
        for rank, (res, kept, training) in enumerate(ranks):
            # bitwise: the per-batch means are summed in batch order whichever rank computed them
            assert (res.loss, res.metrics) == (reference.loss, reference.metrics), (world, rank)
            assert res.samples == SAMPLES
            assert kept, f"rank {rank} of {world}: its own buffers were not restored"
            assert training, "the model was left in eval mode"
    loss, acc = by_hand()
    # the mean over samples, not over ranks' or batches' means (the last batch is shorter: an unweighted
    # mean of the batches' means is 1.2e-4 away, the mean of 2 ranks' means 1.6e-3); the batches' losses
    # are float32, hence 1e-6
    assert reference.loss == pytest.approx(loss, rel=1e-6)
    assert reference.metrics["acc"] == pytest.approx(acc, rel=1e-12)
    # rank 1's own statistics would have given another loss: the evaluation used rank 0's
    other = model_with_stats(1).eval()
    x, y = BNTask().build_eval_dataset().tensors
    with torch.no_grad():
        assert float(nn.functional.cross_entropy(other(x), y)) != pytest.approx(loss, rel=1e-6)


@pytest.mark.slow  # > 10 s on 2 cores: full suite only
def test_loader_processes_read_the_same_batches_as_an_in_turn_read_even_with_random_draws() -> None:
    """``evaluation.loader_workers``: each batch is read in a loader process after seeding its generator as
    an in-turn read is seeded, so a noisy eval set gives bitwise the same result, at any world size."""
    in_turn = run(2, "noisy")[0][0]
    for world in (1, 2):
        for res, kept, training in run(world, "noisy", loaders=1):
            assert (res.loss, res.metrics) == (in_turn.loss, in_turn.metrics), world
            assert res.samples == SAMPLES and kept and training
    plain = run(1)[0][0]
    assert in_turn.loss != plain.loss  # the noise was drawn: the test would see a seeding mistake


def test_best_and_early_stop_checkpoints_are_taken_by_every_rank_under_zero(tmp_path: Any) -> None:
    """With ``training.zero`` a checkpoint is a collective (the optimizer state is gathered on rank 0): the
    checkpoints an evaluation asks for (a new best, the early stop) must be taken on every rank at the same
    step, or the ranks would wait on each other until the timeout. Scored by the highest loss, which falls:
    step 2 stays the best, and patience=2 ends the run at step 6."""
    from cluster.run.checkpoint import CheckpointStore
    from cluster.run.storage import Storage
    from tests.multiprocess.mp_helpers import run_workers, tiny_config

    storage = f"{tmp_path}/s"
    cfg = tiny_config(
        storage,
        [
            "training.zero=true",
            "training.max_steps_per_epoch=10",
            "task_args.eval_chars=2048",
            "evaluation.every_steps=2",
            "evaluation.patience=2",
            "checkpoint.best_metric=loss",
            "checkpoint.best_mode=max",
            "checkpoint.every_steps=0",
        ],
    )
    out = tmp_path / "o"
    out.mkdir()
    ranks = run_workers(2, cfg, f"{storage}/run", [(0, 0)], str(out), timeout=150)
    assert [r["epochs"][0][1] for r in ranks] == [6, 6]  # both ranks stopped at step 6
    infos = CheckpointStore(Storage(f"{storage}/run")).list()
    assert [i.step for i in infos] == [2, 6]
    assert infos[0].manifest["score"]["metric"] == "loss"
    assert (
        infos[1].manifest["early_stopped"]["step"] == 2 and infos[1].manifest["early_stopped"]["since"] == 2
    )
    for info in infos:  # gathered whole: optimizer state for every parameter (the char-LM has no buffers)
        state = CheckpointStore(Storage(f"{storage}/run")).load_step(info.step)
        assert len(state["train_state.pt"]["optimizer"]["state"]) == len(state["model.pt"])
