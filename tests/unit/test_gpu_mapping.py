"""How ranks see the GPUs of their node (``cluster.rank.dist.share_gpus``) and which raised errors retire a
process on a GPU (``cluster.core.errors.device_broken``). Pure functions: no GPU needed."""

from __future__ import annotations

import pytest

from cluster.core.errors import WorkerError, device_broken
from cluster.rank.dist import share_gpus

pytestmark = pytest.mark.timeout(30)


def test_every_rank_of_a_node_sees_the_node_s_group_gpus_and_picks_its_own() -> None:
    # 8 ranks on one node, Ray handing out ids in no particular order
    got = share_gpus([("a", [g]) for g in ["3", "0", "7", "1", "2", "6", "4", "5"]])
    assert {v for v, _ in got} == {"0,1,2,3,4,5,6,7"}
    assert [i for _, i in got] == [3, 0, 7, 1, 2, 6, 4, 5]


def test_non_contiguous_ids_sort_numerically_and_index_into_the_shared_list() -> None:
    got = share_gpus([("a", ["10"]), ("a", ["2"]), ("a", ["5"])])
    assert got == [("2,5,10", 2), ("2,5,10", 0), ("2,5,10", 1)]  # "10" after "5", not before "2"


def test_mixed_nodes_share_only_their_own_node_s_gpus() -> None:
    placements = [("a", ["0"]), ("b", ["1"]), ("a", ["1"]), ("b", ["3"]), ("c", ["0"])]
    got = share_gpus(placements)
    assert got == [("0,1", 0), ("1,3", 0), ("0,1", 1), ("1,3", 1), ("0", 0)]
    for (_node, ids), (visible, index) in zip(placements, got):  # each rank finds its own physical GPU
        assert visible.split(",")[index] == ids[0]


def test_uuid_ids_keep_a_stable_order() -> None:
    got = share_gpus([("a", ["GPU-bbb"]), ("a", ["GPU-aaa"])])
    assert got == [("GPU-aaa,GPU-bbb", 1), ("GPU-aaa,GPU-bbb", 0)]


def test_two_ranks_on_one_gpu_or_a_rank_without_one_is_an_error() -> None:
    with pytest.raises(ValueError, match="rank 1 holds GPU \\['0'\\]"):
        share_gpus([("a", ["0"]), ("a", ["0"])])
    with pytest.raises(ValueError, match="rank 0 was assigned no GPU"):
        share_gpus([("a", [])])
    assert share_gpus([("a", ["0"]), ("b", ["0"])]) == [("0", 0), ("0", 0)]  # same id, other node: fine


def test_ranks_sharing_a_gpu_over_gloo_each_find_it() -> None:
    # gpus_per_worker=0.5: Ray hands two ranks each GPU; with shared=True that is allowed
    got = share_gpus([("a", ["1"]), ("a", ["0"]), ("a", ["1"]), ("a", ["0"])], shared=True)
    assert got == [("0,1", 1), ("0,1", 0), ("0,1", 1), ("0,1", 0)]


def _err(exc_type: str, message: str) -> WorkerError:
    return WorkerError(0, 3, exc_type, message, "")


def test_cuda_errors_retire_the_process_plain_errors_do_not() -> None:
    assert device_broken(_err("AcceleratorError", "CUDA error: device-side assert triggered"))
    assert device_broken(_err("RuntimeError", "CUDA error: an illegal memory access was encountered"))
    assert device_broken(None)  # nothing known about the error: do not trust the context
    assert not device_broken(_err("RuntimeError", "injected fault on rank 0 at step 3"))
    assert not device_broken(_err("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not device_broken(_err("ValueError", "bad label"))
