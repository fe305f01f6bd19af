"""``cluster.rank.evaluate.evaluate`` on a GPU: the values stay on the device until one read at the end, and
the result matches the CPU's (same weights, same batches) within float32 rounding; under bf16 autocast within
bf16's. Skipped where there is no CUDA device."""

from __future__ import annotations

import copy

import pytest
import torch

from cluster.rank.evaluate import evaluate
from cluster.spec.load import load_config
from jobs.tasks.charlm import CharLMTask

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]


def test_a_gpu_evaluation_matches_the_cpu_s() -> None:
    task = CharLMTask(context=64, d_model=64, n_layers=2, n_heads=4, max_chars=200_000, eval_chars=32_768)
    torch.manual_seed(0)
    cpu_model = task.build_model()
    gpu_model = copy.deepcopy(cpu_model).cuda()
    ds = task.build_eval_dataset()
    cfg = load_config(None, ["evaluation.batch_size=64"])
    on_cpu = evaluate(task, cpu_model, ds, cfg, 1, 0, 1, torch.device("cpu"))
    dev = torch.device("cuda", 0)
    on_gpu = evaluate(task, gpu_model, ds, cfg, 1, 0, 1, dev)
    assert on_gpu.samples == on_cpu.samples == len(ds)
    assert on_gpu.loss == pytest.approx(on_cpu.loss, rel=1e-4)
    assert on_gpu.metrics["acc"] == pytest.approx(on_cpu.metrics["acc"], abs=1e-3)
    assert gpu_model.training

    def bf16() -> torch.autocast:
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)

    in_bf16 = evaluate(task, gpu_model, ds, cfg, 1, 0, 1, dev, autocast=bf16)
    assert in_bf16.loss == pytest.approx(on_cpu.loss, rel=2e-2)
