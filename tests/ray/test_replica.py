"""The replica guard on a real local Ray: one bit of one parameter flipped on one rank, by the fault hooks
(``flip_bit``) or by the task's own ``compute_loss`` (as silent corruption would: nothing in the product is
told). The next check finds it, the run rolls back to the newest checkpoint the replicas agreed on, the
suspect ranks get new processes, and the final weights are bitwise those of a run without the flip."""

from __future__ import annotations

import io

import pytest
import torch

from cluster import load_config, train
from cluster.run.checkpoint import CheckpointStore
from cluster.run.storage import Storage
from tests.support.faults import EPOCHS, NO_SPARE, STEPS, assert_bitwise_equal, events, overrides

pytestmark = pytest.mark.timeout(240)

EVERY = 4  # checks after steps 4, 8, 12, ... and at every checkpoint (every 5 steps, each epoch's end)


def job(storage: str, name: str, world: int, *extra: str) -> list[str]:
    return overrides(
        storage,
        name,
        f"scaling.num_workers={world}",
        "scaling.cpus_per_worker=0.5",
        "task_args.step_sleep_s=0",
        f"failures.replica_check_steps={EVERY}",
        NO_SPARE,  # no rank dies: a flipped bit rolls back in place
        *extra,
    )


def final(run_url: str) -> dict[str, torch.Tensor]:
    latest = CheckpointStore(Storage(run_url)).load_latest()
    assert latest is not None and latest.info.step == EPOCHS * STEPS
    return latest.files["model.pt"]


@pytest.fixture(scope="module")
def references(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    root = str(tmp_path_factory.mktemp("ref"))
    out = {}
    for world in (2, 4):
        result = train(
            load_config("jobs/configs/tiny_cpu.yaml", job(root, f"ref{world}", world)), out=io.StringIO()
        )
        assert result.status == "finished" and result.attempts == 1
        assert not events(result.run_url, "replica_mismatch")  # no false alarm in a healthy run
        out[world] = final(result.run_url)
    return out


# (ranks, how, flip step, the check that finds it, the last check that agreed, the checkpoint resumed)
CASES = [
    (2, "fault", 13, 15, 12, 10),  # found by the check before the epoch end's checkpoint: never committed
    (2, "task", 7, 8, 5, 5),
    (4, "fault", 7, 8, 5, 5),
    (4, "task", 13, 15, 12, 10),
]


@pytest.mark.parametrize(("world", "how", "flip", "found", "agreed", "back"), CASES)
def test_a_flipped_bit_is_found_rolled_back_and_the_run_ends_bitwise_equal(
    references: dict[int, dict],
    tmp_path: object,
    world: int,
    how: str,
    flip: int,
    found: int,
    agreed: int,
    back: int,
) -> None:
    suspect = 1 if world == 2 else 2
    if how == "fault":
        extra = [f"failures.inject=[{{rank: {suspect}, step: {flip}, kind: flip_bit}}]"]
    else:
        extra = [
            "task=tests.support.tasks:FlipsOwnBit",
            f"task_args.flip_rank={suspect}",
            f"task_args.flip_step={flip}",
        ]
    storage = f"{tmp_path}/runs"
    cfg = load_config("jobs/configs/tiny_cpu.yaml", job(storage, "flip", world, *extra))
    result = train(cfg, out=io.StringIO())
    run_url = result.run_url
    assert result.status == "finished" and result.attempts == 2, result.failures
    assert result.failures[0]["kind"] == "replica_mismatch"
    (event,) = events(run_url, "replica_mismatch")
    suspects = [0, 1] if world == 2 else [suspect]  # at 2 ranks there is no majority: both
    assert event["ranks"] == suspects and len(event["hosts"]) == len(suspects)
    assert (event["step"], event["agreed_step"], event["checkpoint_step"]) == (found, agreed, back)
    assert event["params"] and len(set(event["digests"])) == 2
    first, second = events(run_url, "group_started")
    assert (second["resume_source"], second["resume_step"]) == ("checkpoint", back)
    for r in range(world):  # the suspects got new processes; the others kept theirs
        assert (first["pids"][r] != second["pids"][r]) == (r in suspects), (r, first["pids"], second["pids"])
    store = CheckpointStore(Storage(run_url))
    for info in store.list():  # every checkpoint was committed from a state the replicas agreed on
        assert info.manifest["replica_check"]["step"] == info.step
        if info.step > agreed:  # nothing trained after the flip, before the rollback, was committed
            assert info.manifest["attempt"] == 1, info.step
    assert_bitwise_equal(final(run_url), references[world])
