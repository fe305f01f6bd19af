"""Issue 42, item 5: ``python -m cluster export RUN --out m.pt`` replaces its file atomically. A re-export
that fails mid-write (here: a file-size limit, ``ulimit -f``, as a full disk would) leaves the old file and
its sidecar whole and consistent (the sidecar's sha256 is the file's) and no temporary file beside them."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from typing import Any

import pytest
import torch

from cluster.api.export import export_checkpoint
from cluster.run.checkpoint import CheckpointStore, serialize
from cluster.run.storage import Storage

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def commit(run: str, step: int, n: int) -> None:
    weights = {"w": torch.full((n,), float(step))}
    CheckpointStore(Storage(run)).commit(
        step, {"model.pt": serialize(weights), "train_state.pt": serialize({})}, {"epoch": 0}
    )


def sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def test_a_re_export_that_fails_mid_write_keeps_the_old_file_and_its_sidecar(tmp_path: Any) -> None:
    run, out = f"{tmp_path}/runs/lm", f"{tmp_path}/out/m.pt"
    os.makedirs(f"{tmp_path}/out")
    Storage(run).write_bytes("run.json", json.dumps({"config": {"task": "my:Task"}}).encode())
    commit(run, 5, 1_000)  # ~4 KB of weights
    export_checkpoint(run, out)
    old, old_sidecar = open(out, "rb").read(), open(out + ".json").read()
    assert json.loads(old_sidecar)["sha256"] == sha256(out) and json.loads(old_sidecar)["step"] == 5

    commit(run, 10, 500_000)  # ~2 MB: past the limit below
    cmd = [sys.executable, "-m", "cluster", "export", run, "--out", out]
    script = f"ulimit -f 256; exec {shlex.join(cmd)}"  # 256 KiB at most per file written
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode != 0, f"the export under the size limit did not fail:\n{done.stdout}{done.stderr}"
    assert "File too large" in done.stderr or "too large" in done.stderr.lower(), done.stderr

    assert open(out, "rb").read() == old, "the old file was torn or replaced by a failed export"
    assert open(out + ".json").read() == old_sidecar
    assert json.loads(old_sidecar)["sha256"] == sha256(out)
    assert sorted(os.listdir(f"{tmp_path}/out")) == ["m.pt", "m.pt.json"]  # no temporary file left

    side = export_checkpoint(run, out)  # without the limit: both replaced, and consistent
    assert side["step"] == 10 and json.load(open(out + ".json"))["sha256"] == sha256(out)
    loaded = torch.load(out, weights_only=True)
    assert torch.equal(loaded["w"], torch.full((500_000,), 10.0))
    assert sorted(os.listdir(f"{tmp_path}/out")) == ["m.pt", "m.pt.json"]
