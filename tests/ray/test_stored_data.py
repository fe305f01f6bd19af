"""A run folder committed by the code before ``cluster/`` moved into layers (``tests/fixtures/
runs_before_layers``: the tiny char-LM, 2 epochs of 6 steps, its checkpoint at step 12, events, metrics,
run.json, lease, as ``python -m jobs.train`` wrote them at commit 6ce9ec0) stays readable: ``show`` reads it,
its checkpoint loads and exports, and a resubmission for one more epoch resumes from its step 12 and ends
bitwise equal to the same three epochs trained in one run by today's code. Stored data holds plain types and
kind names, never a class path of this package: a move of modules must not change what it reads."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch

from cluster import load_checkpoint, load_config, train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "runs_before_layers")
NAME = "before-layers"

pytestmark = pytest.mark.timeout(300)

OVERRIDES = [  # the overrides the fixture was written with (its run.json holds them)
    f"name={NAME}",
    "task_args.max_chars=40000",
    "task_args.d_model=16",
    "task_args.n_layers=1",
    "task_args.context=32",
    "training.global_batch_size=32",
    "training.max_steps_per_epoch=6",
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=1",
    "failures.hot_spare=false",
]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, "-m", "cluster", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.fixture
def old_runs(tmp_path: Any) -> str:
    runs = f"{tmp_path}/runs"
    shutil.copytree(FIXTURE, runs)
    return runs


def test_an_old_run_folder_shows_loads_and_exports(old_runs: str, tmp_path: Any) -> None:
    run_url = f"{old_runs}/{NAME}"
    shown = cli("show", run_url)
    assert shown.returncode == 0, shown.stderr
    assert "status     finished" in shown.stdout and "global step 12" in shown.stdout, shown.stdout
    assert "latest verified step 12" in shown.stdout, shown.stdout
    ck = load_checkpoint(run_url)
    assert ck.step == 12 and ck.model and all(torch.isfinite(v).all() for v in ck.model.values())
    out = f"{tmp_path}/model.pt"
    exported = cli("export", run_url, "--out", out)
    assert exported.returncode == 0, exported.stderr
    weights = torch.load(out, weights_only=True)
    assert sorted(weights) == sorted(ck.model) and all(torch.equal(weights[k], ck.model[k]) for k in weights)
    sidecar = json.load(open(f"{out}.json"))
    assert sidecar["step"] == 12, sidecar


def test_an_old_run_folder_resumes_bitwise(ray_local: None, old_runs: str, tmp_path: Any) -> None:
    more = train(
        load_config("jobs/configs/tiny_cpu.yaml", [f"storage={old_runs}", *OVERRIDES, "training.epochs=3"]),
        out=io.StringIO(),
    )
    assert more.status == "finished" and more.global_step == 18, more
    starts = [json.loads(line) for line in open(f"{old_runs}/{NAME}/events/000002.jsonl")]
    resumed = [e for e in starts if e["event"] == "group_started"]
    assert resumed and resumed[0]["resume_step"] == 12, resumed[:1]  # from the old checkpoint, not from 0
    fresh = train(
        load_config(
            "jobs/configs/tiny_cpu.yaml", [f"storage={tmp_path}/fresh", *OVERRIDES, "training.epochs=3"]
        ),
        out=io.StringIO(),
    )
    assert fresh.status == "finished" and fresh.global_step == 18
    got, want = load_checkpoint(more.run_url).model, load_checkpoint(fresh.run_url).model
    assert all(torch.equal(got[k], want[k]) for k in want)
