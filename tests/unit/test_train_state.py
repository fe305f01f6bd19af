"""The worker's train state round-trips: what ``train_state.pt`` holds is read back, key for key, by the
same code, through the same serialisation a checkpoint uses (``weights_only`` loads)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cluster.core.errors import CheckpointError
from cluster.data.pipeline import LEGACY_ORDER, TORCH_ORDER
from cluster.rank.train_state import TrainState
from cluster.run.checkpoint import deserialize, serialize
from cluster.spec.task import extra_metrics

pytestmark = pytest.mark.timeout(30)


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(3):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def test_every_field_written_is_read_back_through_a_checkpoint_file() -> None:
    model, opt, sched = _trained()
    state = TrainState(
        global_step=3,
        epoch=1,
        step_in_epoch=2,
        world_size=4,
        seed=7,
        optimizer=opt.state_dict(),
        scheduler=sched.state_dict(),
        sampler_order=TORCH_ORDER,
    )
    written = state.state_dict()
    assert set(written) == {f.name for f in dataclasses.fields(TrainState)}
    back = TrainState.from_state_dict(deserialize(serialize(written)))
    assert (back.global_step, back.epoch, back.step_in_epoch, back.world_size, back.seed) == (3, 1, 2, 4, 7)
    assert back.sampler_order == TORCH_ORDER
    # the optimizer and scheduler state load into fresh objects and continue identically
    _, opt2, sched2 = _trained()
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh, lambda s: 1.0 / (s + 1))
    fresh.load_state_dict(back.optimizer)
    assert back.scheduler is not None
    fresh_sched.load_state_dict(back.scheduler)
    torch.testing.assert_close(fresh.state_dict()["state"], opt2.state_dict()["state"], rtol=0, atol=0)
    assert fresh_sched.last_epoch == sched2.last_epoch == 3
    assert fresh.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]


def test_a_missing_or_unknown_key_is_a_clear_error_and_old_checkpoints_still_load() -> None:
    _, opt, _ = _trained()
    good = TrainState(1, 0, 1, 2, 0, opt.state_dict(), None, TORCH_ORDER).state_dict()
    with pytest.raises(CheckpointError, match=r"missing \['seed'\]"):
        TrainState.from_state_dict(
            {k: v for k, v in good.items() if k != "seed"}, "s3://b/run/step_1/train_state.pt"
        )
    with pytest.raises(CheckpointError, match=r"s3://b/run.*unknown \['extra'\]"):
        TrainState.from_state_dict({**good, "extra": 1}, "s3://b/run/step_1/train_state.pt")
    # what earlier versions wrote besides these fields (derivable, or unused by exact resume) is accepted
    legacy = {**good, "sample_offset": 32, "rng": {"torch": torch.get_rng_state()}}
    assert TrainState.from_state_dict(legacy).global_step == 1
    with pytest.raises(CheckpointError, match=r"step_1/train_state.pt has sampler_order=7"):
        TrainState.from_state_dict({**good, "sampler_order": 7}, "s3://b/run/step_1/train_state.pt")


def test_a_train_state_without_sampler_order_resumes_in_the_legacy_order() -> None:
    """Checkpoints written before ``sampler_order`` existed trained the legacy permutation: a resumed run must
    keep it, or its data order would change mid-run (for seeds other than 0)."""
    _, opt, _ = _trained()
    new = TrainState(1, 0, 1, 2, 5, opt.state_dict(), None, TORCH_ORDER).state_dict()
    old = {k: v for k, v in new.items() if k != "sampler_order"}
    back = TrainState.from_state_dict(deserialize(serialize(old)))
    assert back.sampler_order == LEGACY_ORDER
    assert TrainState.from_state_dict(deserialize(serialize(new))).sampler_order == TORCH_ORDER
    # and it is written back, so the next checkpoint of that run says so explicitly
    assert back.state_dict()["sampler_order"] == LEGACY_ORDER


def test_extra_metrics_accept_numbers_and_scalar_tensors_and_name_what_is_wrong() -> None:
    got = extra_metrics({"acc": torch.tensor([0.5]), "n": 3})
    assert float(got["acc"]) == 0.5 and got["acc"].dtype == torch.float64 and got["n"] == 3.0
    with pytest.raises(TypeError, match="second item is a list"):
        extra_metrics([0.5])
    with pytest.raises(TypeError, match=r"'acc' is a tensor of shape \(2,\)"):
        extra_metrics({"acc": torch.zeros(2)})
    with pytest.raises(TypeError, match="'name' is a str"):
        extra_metrics({"name": "x"})


def test_skip_windows_round_trip_and_a_train_state_without_them_skips_nothing() -> None:
    _, opt, _ = _trained()
    windows = [[10, 12], [30, 32]]
    state = TrainState(40, 2, 4, 2, 0, opt.state_dict(), None, TORCH_ORDER, skipped_steps=windows)
    back = TrainState.from_state_dict(deserialize(serialize(state.state_dict())))
    assert back.skipped_steps == [[10, 12], [30, 32]]
    older = {k: v for k, v in state.state_dict().items() if k != "skipped_steps"}  # written before them
    assert TrainState.from_state_dict(deserialize(serialize(older))).skipped_steps == []
