"""``cluster.train(cfg, task=Cls)``: a Task class defined in the running script (``__main__``, as in a
notebook) reaches the workers by value, although no worker could import it; run.json records its path, and
``load_model`` in the same script builds it again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(240)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import sys

    import torch

    from cluster import Task, TensorBatchDataset, load_config, load_model, train
    from cluster.core.errors import ConfigError


    class Inline(Task):  # in __main__: a worker's __main__ is Ray's own, so only its value can get there
        def build_model(self):
            return torch.nn.Linear(4, 2)

        def build_train_dataset(self):
            x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
            return TensorBatchDataset(x, (x[:, 0] > 0).long())

        def compute_loss(self, model, batch):
            x, y = batch
            return torch.nn.functional.cross_entropy(model(x), y), {}


    if __name__ == "__main__":
        over = [f"storage={sys.argv[1]}", "name=inline", "training.global_batch_size=32", "epochs=2"]
        cfg = load_config("jobs/configs/tiny_cpu.yaml", over)
        try:
            train(cfg, task=int)
        except ConfigError as exc:
            print("REFUSED", exc)
        result = train(cfg, task=Inline)
        print("RESULT", result.status, result.global_step)
        print("LOADED", type(load_model(result.run_url)).__name__)
    """
)


def test_a_task_class_defined_in_the_script_trains_on_the_workers(tmp_path: object) -> None:
    script = f"{tmp_path}/inline.py"
    with open(script, "w") as fh:
        fh.write(SCRIPT)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, script, f"{tmp_path}/runs"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "REFUSED task=<class 'int'> is not a subclass of cluster.Task" in out
    assert "RESULT finished 16" in out, out[-4000:]  # 2 epochs of 256 / 32
    assert "LOADED Linear" in out
    import json

    with open(f"{tmp_path}/runs/inline/run.json") as fh:
        assert json.load(fh)["config"]["task"] == "__main__:Inline"
