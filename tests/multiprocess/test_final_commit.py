"""The run's last checkpoint (the one a resubmission or an export starts from) failed to commit as the group
ends: rank 0 writes it again from the live state, a few times with a pause, before the driver hears of it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from cluster.run.checkpoint import CheckpointStore
from cluster.run.storage import Storage
from tests.multiprocess.mp_helpers import run_workers, tiny_config
from tests.support.faultfs import Faults

pytestmark = [pytest.mark.timeout(180)]


@pytest.mark.parametrize(("refusals", "async_save"), [(1, False), (3, False), (1, True)])
def test_a_final_checkpoint_that_failed_is_written_again_from_the_live_state(
    tmp_path: Any, refusals: int, async_save: bool
) -> None:
    faults = Faults()
    faults.refuse_writes("manifest.json", refusals)  # each refusal fails one whole commit (not retried)
    run_url = f"faultfile://{tmp_path}/runs/final"
    cfg = tiny_config(
        f"faultfile://{tmp_path}/runs",
        ["training.epochs=1", "checkpoint.every_steps=0", f"checkpoint.async_save={async_save}"],
    )
    cfg = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, options={"faults": faults}))
    (rank0,) = run_workers(1, cfg, run_url, [(0, 0)], str(tmp_path), timeout=150)
    (_, last, _) = rank0["epochs"][-1]
    commits = rank0["commits"]  # the epoch's result's, then the group's end's
    store = CheckpointStore(Storage(f"{tmp_path}/runs/final"))
    if refusals == 1:  # the epoch's commit failed; the rewrite at the group's end committed the same step
        assert [(r.step, r.error is None) for r in commits] == [(last, False), (last, True)]
        assert [c.step for c in store.list()] == [last]
    else:  # one failure and two rewrites, all refused: nothing committed, every failure reported
        assert [(r.step, r.error is None) for r in commits] == [(last, False)] * 3
        assert all("injected refusal" in r.error for r in commits if r.error)
        assert store.list() == []
