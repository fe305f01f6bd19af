"""SIGKILL of the checkpointing process (rank 0) while an asynchronous upload is in flight: the torn
checkpoint is never visible as latest, because its manifest is written last."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from cluster.run.checkpoint import MANIFEST, CheckpointStore, step_dir
from cluster.run.storage import Storage

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The child commits step 1, then saves step 2 asynchronously through a storage that is slow (it writes a
# file in small chunks, or stalls right after a file), and keeps "training" until it is killed.
CHILD = r"""
import sys, time, torch
from cluster.run.checkpoint import CheckpointStore, CheckpointWriter
from cluster.run.storage import Storage

root, mode, ready = sys.argv[1], sys.argv[2], sys.argv[3]
storage = Storage(root)
writer = CheckpointWriter(CheckpointStore(storage), keep_last=3)
state = {"w": torch.full((4_000_000,), 1.0)}  # 16 MB
writer.save(1, 0, {}, {"model.pt": state, "train_state.pt": {"step": 1}})
writer.wait()
real = storage.write_bytes

def slow_write(rel, data):
    if mode == "mid-file" and rel.endswith("model.pt"):
        fs, path = storage.open_fs_path(rel)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with open(path, "wb") as fh:
            for i in range(0, len(data), 1 << 20):
                fh.write(data[i:i + (1 << 20)])
                fh.flush()
                if i >= 4 << 20:
                    open(ready, "w").close()
                time.sleep(0.5)
        return
    real(rel, data)
    if mode == "after-file" and rel.endswith("model.pt"):
        open(ready, "w").close()
        time.sleep(600)

storage.write_bytes = slow_write
state["w"].fill_(2.0)
writer.save(2, 0, {}, {"model.pt": state, "train_state.pt": {"step": 2}})
while True:  # the training loop goes on while the upload runs
    time.sleep(0.1)
"""


@pytest.mark.parametrize("mode", ["mid-file", "after-file"])
def test_sigkill_during_async_upload_leaves_previous_as_latest(tmp_path: Any, mode: str) -> None:
    root, ready = f"{tmp_path}/run", f"{tmp_path}/ready"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, root, mode, ready], env=env)
    try:
        deadline = time.monotonic() + 90
        while not os.path.exists(ready):
            assert proc.poll() is None, f"child exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "the upload never started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # the torn step is on storage, with data but without a manifest
    assert os.path.getsize(f"{root}/{step_dir(2)}/model.pt") > 0
    assert not os.path.exists(f"{root}/{step_dir(2)}/{MANIFEST}")

    store = CheckpointStore(Storage(root))
    assert store.steps_on_storage() == [1, 2]
    assert [i.step for i in store.list()] == [1]
    loaded = store.load_latest()
    assert loaded is not None and loaded.info.step == 1
    assert torch.equal(loaded.files["model.pt"]["w"], torch.full((4_000_000,), 1.0))
    assert loaded.skipped and loaded.skipped[0][0] == 2 and "never committed" in loaded.skipped[0][1]
