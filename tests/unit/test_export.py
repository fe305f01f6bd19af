"""`python -m cluster export`: a checkpoint's verified weights as one .safetensors or .pt file, with a
sidecar naming where they came from; read back by safetensors and torch.load(weights_only=True)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, safe_open
from torch import nn

from cluster.__main__ import main
from cluster.api.export import export_checkpoint
from cluster.core.errors import ConfigError
from cluster.run.checkpoint import CheckpointStore, serialize
from cluster.run.storage import Storage

pytestmark = pytest.mark.timeout(60)


class Tied(nn.Module):
    """An embedding and an output layer that share one weight (as language models tie them)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight
        self.norm = nn.LayerNorm(4)


def make_run(tmp_path: Any) -> tuple[str, dict[str, torch.Tensor]]:
    run = f"{tmp_path}/runs/lm"
    storage = Storage(run)
    storage.write_bytes(
        "run.json", json.dumps({"config": {"task": "my:Task", "task_args": {"d": 4}}}).encode()
    )
    store = CheckpointStore(storage)
    torch.manual_seed(0)
    for step in (5, 10):
        model = Tied()
        meta = {"epoch": 0, "score": {"metric": "loss", "mode": "min", "value": 1.0 / step}}
        store.commit(step, {"model.pt": serialize(model.state_dict()), "train_state.pt": serialize({})}, meta)
    return run, model.state_dict()


def test_safetensors_and_pt_hold_the_latest_weights_with_a_sidecar(tmp_path: Any) -> None:
    run, latest = make_run(tmp_path)
    out = f"{tmp_path}/m.safetensors"
    side = export_checkpoint(run, out)
    back = load_file(out)
    assert back.keys() == latest.keys()
    for k, v in latest.items():
        assert torch.equal(back[k], v), k
    assert side["tied"] == [["emb.weight", "out.weight"]]  # stored whole twice: safetensors shares nothing
    with safe_open(out, "pt") as fh:
        assert fh.metadata() == {"run": run, "step": "10"}
    written = json.load(open(out + ".json"))
    assert written["step"] == 10 and written["task"] == "my:Task" and written["task_args"] == {"d": 4}
    assert written["sha256"] == hashlib.sha256(open(out, "rb").read()).hexdigest()
    assert written["parameters"] == sum(v.numel() for v in latest.values())

    pt = f"{tmp_path}/m.pt"
    export_checkpoint(run, pt, step=5, dtype="bf16")
    loaded = torch.load(pt, weights_only=True)
    assert all(v.dtype == torch.bfloat16 for v in loaded.values())
    assert loaded["emb.weight"].data_ptr() == loaded["out.weight"].data_ptr()  # .pt keeps them tied
    assert json.load(open(pt + ".json"))["step"] == 5


def test_bad_requests_are_one_clear_error(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run, _ = make_run(tmp_path)
    with pytest.raises(ConfigError, match=r"name the file .safetensors or .pt"):
        export_checkpoint(run, f"{tmp_path}/m.bin")
    with pytest.raises(ConfigError, match="--dtype 'int8'"):
        export_checkpoint(run, f"{tmp_path}/m.pt", dtype="int8")
    assert main(["export", run, "--out", f"{tmp_path}/m.safetensors", "--step", "7"]) == 2
    assert "no checkpoint at step 7" in capsys.readouterr().err
    assert (
        main(["export", f"{tmp_path}/runs", "lm", "--out", f"{tmp_path}/b.safetensors", "--step", "best"])
        == 0
    )
    said = capsys.readouterr().out
    assert (
        said.startswith(f"wrote {tmp_path}/b.safetensors (") and "from step 10 of" in said
    )  # 1/10 is lowest
