"""What a user's first run prints: nothing they cannot act on. DDP's note that
``find_unused_parameters=True`` found no unused parameters is not theirs to act on (the worker passes it
on purpose, ``training.fixed_buckets``), so no rank prints it."""

from __future__ import annotations

import os

import pytest

from tests.multiprocess.mp_helpers import run_workers, tiny_config

pytestmark = pytest.mark.timeout(180)

DDP_NOTE = "find_unused_parameters=True was specified in DDP constructor"


def test_ranks_do_not_print_ddps_unused_parameters_note(
    tmp_path: object, capfd: pytest.CaptureFixture[str]
) -> None:
    out = f"{tmp_path}/out"
    os.makedirs(out)
    cfg = tiny_config(
        f"{tmp_path}/runs",
        ["training.fixed_buckets=true", "training.max_steps_per_epoch=2", "training.epochs=1"],
    )
    results = run_workers(2, cfg, f"{tmp_path}/runs/{cfg.name}", [(0, 0)], out)
    assert [r["epochs"][0][1] for r in results] == [2, 2]  # both ranks trained (and ran backward)
    captured = capfd.readouterr()  # the ranks' own stdout and stderr: they inherit this process's
    assert DDP_NOTE not in captured.err + captured.out
