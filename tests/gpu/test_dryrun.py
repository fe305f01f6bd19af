"""The dry run of a GPU job on a machine with a GPU: it trains on the device and reports the CUDA
allocator's peak (what a rank's batch needs). Skipped where there is no CUDA device."""

from __future__ import annotations

import pytest
import torch

from cluster import dry_run, load_config

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]


def test_a_gpu_job_is_tried_on_the_gpu(tmp_path: object) -> None:
    cfg = load_config(
        "jobs/configs/gpt_gpu.yaml",
        [f"storage={tmp_path}/runs", "task_args.max_chars=200000", "task_args.n_layers=2"],
    )
    r = dry_run(cfg)
    assert r.device == "cuda:0" and not r.notes
    assert r.per_rank_batch == 64 and r.loss > 0 and r.step_s > 0
    assert r.peak_memory_gib > 0.01  # the allocator's peak over the two steps, not the host's
