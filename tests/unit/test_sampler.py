"""Sampler math: DistributedSampler-equivalent sharding, exact resume at a global offset, any world size."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from cluster.data import ResumableDistributedSampler

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


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


def test_matches_torch_distributed_sampler_sharding() -> None:
    """Same permutation -> rank r gets what DistributedSampler gives it, batch by batch."""
    n, b, world, epoch = 512, 32, 4, 2
    mine = shards(n, b, world, epoch)
    perm = ResumableDistributedSampler(n, b, 0, world)
    perm.set_epoch(epoch)
    assert perm._perm is not None
    order = perm._perm.tolist()

    class Perm(torch.utils.data.Dataset[int]):
        def __len__(self) -> int:
            return n

    for r in range(world):
        ds = DistributedSampler(Perm(), num_replicas=world, rank=r, shuffle=False, drop_last=True)
        theirs = [order[i] for i in ds]
        flat = torch.cat(mine[r]).tolist()
        assert flat == theirs[: len(flat)]


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
    from cluster.errors import ConfigError

    with pytest.raises(ConfigError, match=r"fewer than training\.global_batch_size"):
        ResumableDistributedSampler(10, 64, 0, 1)
