"""Issue 42, item 5, on object storage: a re-export whose sidecar cannot be written after its file was (each
a PUT) never leaves the old sidecar vouching for the new file's bytes. (A local folder under a file-size
limit: tests/multiprocess/test_export_atomic.py.)"""

from __future__ import annotations

import hashlib
import io
import json
import uuid
from typing import Any

import pytest
import torch

from cluster.api.export import export_checkpoint
from cluster.core.errors import StorageError
from cluster.run.checkpoint import CheckpointStore, serialize
from cluster.run.storage import Storage
from tests.support.faultfs import Faults

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def commit(run: str, step: int) -> None:
    files = {"model.pt": serialize({"w": torch.full((64,), float(step))}), "train_state.pt": serialize({})}
    CheckpointStore(Storage(run)).commit(step, files, {"epoch": 0})


def test_a_sidecar_that_fails_after_its_file_never_vouches_for_other_bytes(tmp_path: Any) -> None:
    run, bucket = f"{tmp_path}/runs/lm", f"exp-{uuid.uuid4().hex}"
    commit(run, 5)
    faults = Faults()
    options = {"faults": faults, "target_protocol": "memory"}
    out = f"fault://{bucket}/m.pt"
    export_checkpoint(run, out, storage_options=options)
    exported = Storage(f"memory://{bucket}")
    assert json.loads(exported.read_bytes("m.pt.json"))["step"] == 5

    commit(run, 10)
    faults.fail("write", "m.pt.json", times=10)  # the file's PUT lands, the sidecar's keeps failing
    with pytest.raises((StorageError, OSError), match="injected failure of write"):
        export_checkpoint(run, out, storage_options=options)
    data = exported.read_bytes("m.pt")
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True)["w"], torch.full((64,), 10.0))
    if exported.exists("m.pt.json"):  # a sidecar left must name these bytes
        said = json.loads(exported.read_bytes("m.pt.json"))["sha256"]
        assert said == hashlib.sha256(data).hexdigest(), "the old sidecar vouches for the new file's bytes"
