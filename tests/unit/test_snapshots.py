"""The ranks' copies in memory for a NaN rollback (``cluster.rank.rollback_points``): when they are taken,
that they do not follow the training after them, which are kept, and which step the ranks agree on."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from cluster.core.errors import ConfigError
from cluster.rank.peer_transfer import state_digest
from cluster.rank.rollback_points import MemorySnapshots, agreed_step
from cluster.rank.train_state import RunPosition, TrainState, apply
from cluster.spec.load import load_config

pytestmark = pytest.mark.timeout(60)


def config(*extra: str) -> Any:
    return load_config("jobs/configs/tiny_cpu.yaml", ["failures.nan_skip_steps=2", *extra])


def session() -> SimpleNamespace:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return SimpleNamespace(
        raw_model=model, optimizer=opt, scheduler=None, sampler=SimpleNamespace(steps_per_epoch=8)
    )


def train_one(s: SimpleNamespace) -> None:
    s.raw_model(torch.randn(2, 4)).pow(2).sum().backward()
    s.optimizer.step()
    s.optimizer.zero_grad()


def walk(mem: MemorySnapshots, s: SimpleNamespace, pos: RunPosition, to: int) -> list[int]:
    taken = []
    while pos.global_step < to:
        train_one(s)
        pos.global_step += 1
        pos.epoch, pos.step_in_epoch = divmod(pos.global_step, 8)
        if pos.step_in_epoch == 0:  # the epoch's last step: as the loop sees it
            pos.epoch, pos.step_in_epoch = pos.epoch - 1, 8
        if mem.after_step(s, pos, 2):
            taken.append(pos.global_step)
    return taken


def test_copies_are_taken_every_n_steps_the_two_newest_kept_and_frozen_at_their_step() -> None:
    cfg = config("failures.nan_snapshot_steps=3")
    mem, s, pos = MemorySnapshots(cfg), session(), RunPosition.start(cfg)
    assert walk(mem, s, pos, 3) == [3]
    at3 = {k: v.clone() for k, v in s.raw_model.state_dict().items()}
    walk(mem, s, pos, 7)
    assert mem.steps() == [3, 6]
    for k, v in at3.items():  # the copy at 3 did not follow steps 4-7
        assert torch.equal(mem.files(3)["model.pt"][k], v), k
    assert walk(mem, s, pos, 9) == [9]
    assert mem.steps() == [6, 9]
    state = TrainState.from_state_dict(mem.files(9)["train_state.pt"])
    assert (state.global_step, state.epoch, state.step_in_epoch) == (9, 1, 1)
    with pytest.raises(KeyError, match=r"no copy in memory at step 3 \(held: \[6, 9\]\)"):
        mem.files(3)


def test_a_copy_restores_the_state_bitwise_and_an_epochs_last_step_points_at_the_next_epoch() -> None:
    cfg = config("failures.nan_snapshot_steps=8")
    mem, s, pos = MemorySnapshots(cfg), session(), RunPosition.start(cfg)
    walk(mem, s, pos, 8)
    want_model = {k: v.clone() for k, v in s.raw_model.state_dict().items()}
    want_opt = state_digest(s.optimizer.state_dict())[0]
    walk(mem, s, pos, 11)  # the live state moves on
    files = mem.files(8)
    state = TrainState.from_state_dict(files["train_state.pt"])
    assert (state.global_step, state.epoch, state.step_in_epoch) == (8, 1, 0)  # the next epoch's start
    back = apply(state, files["model.pt"], s.raw_model, s.optimizer, None, pos)
    assert back.global_step == 8
    for k, v in want_model.items():
        assert torch.equal(s.raw_model.state_dict()[k], v), k
    assert state_digest(s.optimizer.state_dict())[0] == want_opt
    train_one(s)  # the live model trains on; the copy stays as it was (a second rollback may use it)
    for k, v in want_model.items():
        assert torch.equal(mem.files(8)["model.pt"][k], v), k


def test_copies_past_a_resumed_step_are_dropped_and_their_buffers_reused() -> None:
    cfg = config("failures.nan_snapshot_steps=2")
    mem, s, pos = MemorySnapshots(cfg), session(), RunPosition.start(cfg)
    walk(mem, s, pos, 6)
    assert mem.steps() == [4, 6]
    mem.drop_after(5)
    assert mem.steps() == [4]
    mem.drop_after(4)
    assert mem.steps() == [4]
    mem.clear()
    assert mem.steps() == []


def test_no_copies_without_a_rollback_or_when_turned_off() -> None:
    for cfg in (
        load_config("jobs/configs/tiny_cpu.yaml", []),  # a NaN stops the run: nothing to roll back to
        config("failures.nan_snapshot_steps=0"),
    ):
        mem, s, pos = MemorySnapshots(cfg), session(), RunPosition.start(cfg)
        assert not mem.on and walk(mem, s, pos, 100) == [] and mem.steps() == []


def test_the_ranks_agree_on_the_newest_step_every_rank_holds_with_one_digest() -> None:
    assert agreed_step([{4: "a", 8: "b"}, {4: "a", 8: "b"}]) == 8
    assert agreed_step([{4: "a", 8: "b"}, {4: "a", 8: "X"}]) == 4  # rank 1 differs at 8
    assert agreed_step([{4: "a", 8: "b"}, {8: "b"}]) == 8
    assert agreed_step([{4: "a"}, {8: "b"}]) is None  # no step in common
    assert agreed_step([{4: "a", 8: "b"}, {}]) is None  # a fresh process holds none
    assert agreed_step([{4: "a"}, {4: "b"}]) is None
    assert agreed_step([]) is None


def test_digests_cover_only_copies_before_the_window_and_see_one_flipped_bit() -> None:
    cfg = config("failures.nan_snapshot_steps=2")
    mem, s, pos = MemorySnapshots(cfg), session(), RunPosition.start(cfg)
    walk(mem, s, pos, 6)
    d = mem.digests(before=6)
    assert list(d) == [4]
    w = mem.files(4)["model.pt"]["weight"]
    w.view(torch.int32)[0, 0] ^= 1 << 3
    assert mem.digests(before=6)[4] != d[4]


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"failures.nan_snapshot_steps=-1 must be 0"):
        config("failures.nan_snapshot_steps=-1")
