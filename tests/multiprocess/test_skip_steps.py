"""Skipped steps (training.skip_steps) through the real worker: no batch, no update, no step row; the step
count and the learning-rate schedule move on as if the steps had trained."""

from __future__ import annotations

import os

import pytest
import torch

from tests.multiprocess.mp_helpers import run_workers, tiny_config

pytestmark = pytest.mark.timeout(180)


def test_skipped_steps_train_nothing_and_the_schedule_moves_on(tmp_path: object) -> None:
    common = ["training.max_steps_per_epoch=8", "training.epochs=1"]
    rows = {}
    for name, extra in (("plain", []), ("skipping", ['training.skip_steps=["3-5"]'])):
        out = f"{tmp_path}/{name}"
        os.makedirs(out)
        cfg = tiny_config(f"{tmp_path}/runs", [f"name={name}", *common, *extra])
        (rank0,) = run_workers(1, cfg, f"{tmp_path}/runs/{name}", [(0, 0)], out)
        rows[name] = {r["global_step"]: r for r in rank0["rows"]}
        assert rank0["epochs"][0][1] == 8  # the epoch ends at step 8 either way
    plain, skipping = rows["plain"], rows["skipping"]
    assert sorted(skipping) == [1, 2, 6, 7, 8]  # no row for a step that trained nothing
    for step in (1, 2):
        assert skipping[step]["loss"] == plain[step]["loss"]
    # the schedule stepped over 3-5 (CharLM's warm-up and cosine: the rate changes at every step)
    assert len({plain[s]["lr"] for s in plain}) == 8
    for step in (6, 7, 8):
        assert skipping[step]["lr"] == plain[step]["lr"]
    # the weights at step 6 trained 2 steps, not 5: the same batch gives another loss
    assert skipping[6]["loss"] != plain[6]["loss"]
    assert torch.isfinite(torch.tensor([r["loss"] for r in skipping.values()])).all()
