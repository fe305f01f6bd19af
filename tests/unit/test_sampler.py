"""Sampler math: DistributedSampler-equivalent sharding, exact resume at a global offset, any world size."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from cluster.data.pipeline import LEGACY_ORDER, TORCH_ORDER, ResumableDistributedSampler

pytestmark = pytest.mark.timeout(30)


def shards(n: int, b: int, world: int, epoch: int, start: int = 0, seed: int = 0) -> list[list[torch.Tensor]]:
    out = []
    for r in range(world):
        s = ResumableDistributedSampler(n, b, r, world, seed=seed)
        s.set_epoch(epoch, start)
        out.append(list(s))
    return out


def test_each_epoch_is_a_permutation_trained_once() -> None:
    n, b, world = 1000, 64, 4
    per_rank = shards(n, b, world, epoch=3)
    seen = torch.cat([idx for rank in per_rank for idx in rank])
    assert len(seen) == (n // b) * b
    assert len(set(seen.tolist())) == len(seen)  # no repeats
    assert all(len(idx) == b // world for rank in per_rank for idx in rank)


def test_epochs_differ_and_are_reproducible() -> None:
    a = shards(256, 32, 2, epoch=0)[0][0]
    assert torch.equal(a, shards(256, 32, 2, epoch=0)[0][0])
    assert not torch.equal(a, shards(256, 32, 2, epoch=1)[0][0])
    assert not torch.equal(a, shards(256, 32, 2, epoch=0, seed=1)[0][0])


class _Sized(torch.utils.data.Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
@pytest.mark.parametrize(("n", "b", "world"), [(512, 32, 4), (1000, 48, 3), (300, 20, 1), (97, 8, 2)])
def test_each_rank_gets_what_torch_distributed_sampler_gives_it_for_every_seed(
    seed: int, n: int, b: int, world: int
) -> None:
    """Rank r's batches, flattened, are DistributedSampler(shuffle=True, seed, drop_last=True)'s indices for
    rank r after set_epoch(e), in order (up to the last full global batch)."""
    for epoch in (0, 1, 5):
        mine = shards(n, b, world, epoch, seed=seed)
        for r in range(world):
            ds = DistributedSampler(
                _Sized(n), num_replicas=world, rank=r, shuffle=True, seed=seed, drop_last=True
            )
            ds.set_epoch(epoch)
            theirs = list(ds)
            steps = n // b
            assert len(mine[r]) == steps and all(len(x) == b // world for x in mine[r])
            assert torch.cat(mine[r]).tolist() == theirs[: steps * (b // world)]


def test_resume_mid_epoch_continues_torch_distributed_sampler_order() -> None:
    n, b, world, seed, cut = 480, 24, 3, 7, 5
    ds = DistributedSampler(_Sized(n), num_replicas=world, rank=1, shuffle=True, seed=seed, drop_last=True)
    ds.set_epoch(2)
    mine = ResumableDistributedSampler(n, b, 1, world, seed=seed)
    mine.set_epoch(2, cut)
    per = b // world
    assert torch.cat(list(mine)).tolist() == list(ds)[cut * per : (n // b) * per]


def test_legacy_order_keeps_the_old_permutation_and_equals_the_new_one_for_seed_0() -> None:
    n, b = 256, 32
    for seed in (0, 3):
        legacy = ResumableDistributedSampler(n, b, 0, 1, seed=seed, order=LEGACY_ORDER)
        legacy.set_epoch(2)
        g = torch.Generator().manual_seed(seed * 1_000_003 + 2)  # what runs before order 2 trained
        assert torch.cat(list(legacy)).tolist() == torch.randperm(n, generator=g)[: (n // b) * b].tolist()
        new = ResumableDistributedSampler(n, b, 0, 1, seed=seed, order=TORCH_ORDER)
        new.set_epoch(2)
        assert (torch.cat(list(new)).tolist() == torch.cat(list(legacy)).tolist()) == (seed == 0)
    # telling the sampler its order after set_epoch (as resume does) takes effect on the next iteration
    s = ResumableDistributedSampler(n, b, 0, 1, seed=3)
    s.set_epoch(2)
    s.order = LEGACY_ORDER
    assert torch.cat(list(s)).tolist() == torch.cat(list(legacy)).tolist()
    with pytest.raises(ValueError, match="unknown sampler order 9"):
        ResumableDistributedSampler(n, b, 0, 1, order=9).set_epoch(0)


@pytest.mark.parametrize(("world_before", "world_after"), [(2, 2), (4, 2), (2, 3), (3, 1)])
def test_resume_at_offset_with_any_world_size_neither_repeats_nor_skips(
    world_before: int, world_after: int
) -> None:
    n, b, epoch, cut = 960, 48, 1, 7
    before = shards(n, b, world_before, epoch)
    done = torch.cat([idx for rank in before for idx in rank[:cut]])
    after = shards(n, b, world_after, epoch, start=cut)
    rest = torch.cat([idx for rank in after for idx in rank])
    everything = torch.cat([done, rest]).tolist()
    assert len(everything) == len(set(everything)) == (n // b) * b
    # each remaining step's global batch is the same, whatever the world size
    full = ResumableDistributedSampler(n, b, 0, 1)
    full.set_epoch(epoch)
    for step in range(cut, n // b):
        union = sorted(torch.cat([after[r][step - cut] for r in range(world_after)]).tolist())
        assert union == sorted(full.global_batch(step).tolist())


def test_max_steps_and_too_small_dataset() -> None:
    s = ResumableDistributedSampler(1000, 10, 0, 1, max_steps_per_epoch=5)
    s.set_epoch(0, 2)
    assert len(s) == 3
    assert len(list(s)) == 3
    from cluster.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"fewer than training\.global_batch_size"):
        ResumableDistributedSampler(10, 64, 0, 1)


def test_skipped_steps_keep_their_place_and_the_loader_leaves_them_out() -> None:
    """A skipped step's batch is still yielded in place (positions never shift: the next step trains the
    batch it would have trained); the loader's micro-batches leave it out."""
    from cluster.data.pipeline import MicroBatches
    from cluster.spec.schedule import steps_to_skip

    plain = ResumableDistributedSampler(96, 8, 1, 2, seed=3)
    plain.set_epoch(1, 2)
    skipping = ResumableDistributedSampler(96, 8, 1, 2, seed=3)
    # epoch 1 of 12 steps, resumed at its step 2: 14 global steps done; windows in global steps (1-based)
    skip = steps_to_skip([(10, 16), (19, 19), (30, 40)], 12, 2, 12)
    assert skip == {2, 3, 6}  # global 15, 16 and 19; 10-14 were before the resume point; 30+ is past it
    skipping.set_epoch(1, 2, skip)
    assert [b.tolist() for b in skipping] == [b.tolist() for b in plain]
    micro = MicroBatches(2, seed=3)
    micro.source = skipping
    steps = sorted({pos[1] for pos, _, _ in micro})
    assert steps == [s for s in range(2, 12) if s not in skip]
    assert steps_to_skip([], 12, 2, 12) == frozenset()
    assert steps_to_skip([(1, 100)], 0, 0, 12) == frozenset(range(12))
