"""Rank 0's store is connected to in waves (16, 32, 64, ...): every other rank once, in order."""

from __future__ import annotations

import pytest

from cluster.worker_group import connect_waves

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("n", [1, 2, 16, 17, 32, 100, 1000])
def test_waves_cover_every_rank_but_0_once(n: int) -> None:
    waves = connect_waves(n)
    assert [r for w in waves for r in w] == list(range(1, n))
    assert [len(w) for w in waves[:-1]] == [16 * 2**i for i in range(len(waves) - 1)]
    assert len(waves) <= max(1, n.bit_length() - 3)


def test_thirty_two_ranks_connect_in_two_waves() -> None:
    assert [len(w) for w in connect_waves(32)] == [16, 15]
