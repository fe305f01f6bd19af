"""The replica guard's pure parts: the parameter digest (a single flipped bit anywhere changes it, equal
tensors agree), who is a suspect, and the driver's rollback over a real checkpoint store."""

from __future__ import annotations

import pickle

import pytest
import torch

from cluster.core.errors import ConfigError, Failure, WorkerError
from cluster.driver import replica_rollback
from cluster.rank import replica
from cluster.rank.replica import ReplicaMismatchError, digest, flip_bit, suspects
from cluster.run.checkpoint import CheckpointStore
from cluster.run.quarantine import Quarantine
from cluster.run.storage import Storage
from cluster.seam import mismatch
from cluster.spec.load import load_config
from tests.support.fakes import ScriptedGroup, make

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.uint8]


def sample(dtype: torch.dtype, n: int = 37, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_single_flipped_bit_in_any_position_changes_the_digest(dtype: torch.dtype) -> None:
    base = [sample(torch.float32, 11), sample(dtype)]
    want = digest(base)
    width = base[1].element_size() * 8
    for index in (0, 5, 36):
        for bit in range(width):
            t = base[1].clone()
            flip_bit(t, index, bit)
            got = digest([base[0], t])
            assert not torch.equal(got, want), f"{dtype} element {index} bit {bit}"
            assert torch.equal(got[0], want[0])  # the other tensor's digest is its own


def test_equal_tensors_give_equal_digests_and_a_swap_or_an_order_change_does_not() -> None:
    a, b = sample(torch.float32, 100, 1), sample(torch.float32, 100, 2)
    assert torch.equal(digest([a, b]), digest([a.clone(), b.clone()]))
    swapped = a.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert not torch.equal(digest([swapped, b]), digest([a, b]))
    assert not torch.equal(digest([b, a]), digest([a, b]))  # the tensor's position counts too
    # a float sum would not see it: 1 ulp moved from one element to another
    c = torch.tensor([1.0, 3.0])
    d = torch.tensor([1.0 + 2**-23, 3.0 - 2**-22])
    assert float(c.sum()) == float(d.sum())
    assert not torch.equal(digest([c]), digest([d]))


def test_a_flip_beyond_the_first_slice_of_a_large_tensor_is_seen() -> None:
    t = torch.zeros(replica.CHUNK + 7)
    want = digest([t])
    flip_bit(t, replica.CHUNK + 3, 0)
    assert not torch.equal(digest([t]), want)


def test_suspects_are_the_ranks_outside_a_strict_majority() -> None:
    assert suspects([[1, 2], [1, 2], [1, 2]]) == []
    assert suspects([[1], [1], [9], [1]]) == [2]
    assert suspects([[1], [9]]) == [0, 1]  # at 2 ranks: no majority, both suspect
    assert suspects([[1], [1], [9], [9]]) == [0, 1, 2, 3]
    assert suspects([[1], [2], [3]]) == [0, 1, 2]
    assert suspects([[1], [1], [1], [8], [9]]) == [3, 4]


def mismatch_error(suspect: list[int], agreed: int = 10) -> WorkerError:
    exc = ReplicaMismatchError(
        "replicas disagree at step 12", {"replica": {"step": 12, "suspects": suspect, "agreed_step": agreed}}
    )
    back = pickle.loads(pickle.dumps(exc))  # it crosses from the actor to the driver
    assert str(back) == str(exc) and back.detail == exc.detail
    return WorkerError(0, 13, "ReplicaMismatchError", str(back), "tb", back.detail)


def test_a_mismatch_is_a_failure_of_its_own_kind_that_names_its_suspects() -> None:
    failure = mismatch.failure_of(mismatch_error([2, 3]))
    assert failure is not None and failure.kind == "replica_mismatch" and failure.rank == 2
    assert mismatch.suspect_ranks(failure) == {2, 3}
    other = WorkerError(1, 5, "RuntimeError", "boom", "tb")
    assert mismatch.failure_of(other) is None
    assert mismatch.suspect_ranks(Failure("user_error", 1, "boom", other)) == set()


def commit(store: CheckpointStore, step: int, agreed: bool, score: float | None = None) -> None:
    meta: dict = {"epoch": 0}
    if agreed:
        meta["replica_check"] = {"step": step, "digest": "ab"}
    if score is not None:
        meta["score"] = {"metric": "loss", "mode": "min", "value": score}
    store.commit(step, {"model.pt": b"w"}, meta)


def test_rollback_keeps_nothing_after_the_last_agreement_and_sets_aside_only_what_agreed(
    tmp_path: object,
) -> None:
    store = CheckpointStore(Storage(f"{tmp_path}/run"))
    commit(store, 5, True)
    commit(store, 10, True)  # a milestone that agreed, newer than the agreement reported
    commit(store, 15, False, score=0.1)  # the best, but no check agreed on it
    commit(store, 20, False)  # a milestone without an agreement
    back = replica_rollback.roll_back(store, agreed_step=7, keep_every=10)
    assert back == {"checkpoint_step": 5, "discarded": [15, 20], "set_aside": [10]}
    assert [i.step for i in store.list()] == [5]


def test_after_mismatch_records_the_event_and_rolls_back(tmp_path: object) -> None:
    storage = Storage(f"{tmp_path}/run")
    store = CheckpointStore(storage)
    commit(store, 5, True)
    commit(store, 15, False)
    cfg = load_config(None, [])
    seen: list[tuple[str, dict]] = []
    failure = mismatch.failure_of(mismatch_error([1], agreed=10))
    assert failure is not None
    fenced: list[int] = []
    store.fence = lambda: fenced.append(1)  # the run's lease (the driver sets it on its folder's store)
    quarantine = Quarantine(storage, after=1)
    replica_rollback.after_mismatch(
        failure,
        store,
        cfg,
        lambda kind, **f: seen.append((kind, f)),
        ["h0", "h1"],
        ["n0", "n1"],
        quarantine,
    )
    ((kind, fields),) = seen
    assert kind == "replica_mismatch"
    assert fields["ranks"] == [1] and fields["hosts"] == ["h1"] and fields["nodes"] == ["n1"]
    assert fields["step"] == 12 and fields["agreed_step"] == 10
    assert fields["checkpoint_step"] == 5 and fields["discarded"] == [15]
    assert fenced  # the deletion asked the lease first
    assert [i.step for i in store.list()] == [5]
    assert quarantine.nodes == ["n1"]  # an incident on the suspect's node, none on the other
    assert [i.kind for i in quarantine.records["n1"].incidents] == ["replica_mismatch"]


def test_a_negative_interval_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"failures\.replica_check_steps=-1"):
        load_config(None, ["failures.replica_check_steps=-1"])


def test_the_drivers_rollback_goes_through_its_run_folders_store_fenced_by_its_lease() -> None:
    """The run folder owns one checkpoint store: the driver fences it with its lease when the run starts,
    and a replica rollback deletes through it (each deletion asks the lease first)."""
    failure = mismatch.failure_of(mismatch_error([1], agreed=10))
    assert failure is not None

    class MismatchGroup(ScriptedGroup):
        def classify(self, exc: BaseException, starting: bool = False) -> Failure:
            return failure if str(exc) == failure.message else super().classify(exc, starting)

    driver, _ = make({0: [failure]}, ["failures.max_failures=10"], group_cls=MismatchGroup)
    commit(driver.folder.checkpoints, 5, True)
    commit(driver.folder.checkpoints, 15, False)
    driver.run()
    assert driver.lease is not None and driver.folder.checkpoints.fence == driver.lease.check
    assert driver.record.folder is driver.folder  # the record reads the same folder's checkpoints
    (event,) = [e for e in driver.events.records() if e["event"] == "replica_mismatch"]
    assert event["discarded"] == [15] and event["checkpoint_step"] == 5
    assert 15 not in [i.step for i in driver.folder.checkpoints.list()]
