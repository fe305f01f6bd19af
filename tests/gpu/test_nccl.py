"""The NCCL path on one GPU (world size 1), with and without Ray. Skipped where there is no CUDA device."""

from __future__ import annotations

import io

import pytest
import torch

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]


def test_nccl_worker_without_ray(tmp_path: object) -> None:
    from tests.multiprocess.mp_helpers import run_workers, tiny_config

    cfg = tiny_config(
        f"{tmp_path}/s",
        [
            "scaling.use_gpu=true",
            "workers=1",
            "training.max_steps_per_epoch=5",
            "training.amp=bf16",
            "training.grad_clip=1.0",
        ],
    )
    out = tmp_path / "o"  # type: ignore[operator]
    out.mkdir()
    (res,) = run_workers(1, cfg, f"{tmp_path}/s/run", [(0, 0)], str(out))
    assert res["resume"].global_step == 0
    assert res["epochs"][0][1] == 5
    assert all(torch.isfinite(v).all() for v in res["params"].values())
    # step rows: the gradient norm before clipping, and the CUDA allocator's peak since the previous row
    # (reset at each row: the model, its gradients and AdamW's state, a few MiB, not the process's RSS)
    rows = res["rows"]
    assert len(rows) == 5 and all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in rows)
    assert all(0 < r["peak_mem_gib"] < 1 for r in rows)


def test_nccl_job_on_ray(tmp_path: object, tiny_overrides: list[str]) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (the GPU check machines have none)")
    from cluster import load_config, train

    cfg = load_config(
        "jobs/configs/tiny_cpu.yaml",
        [
            *tiny_overrides,
            "name=gpu",
            "scaling.use_gpu=true",
            "workers=1",
            "training.amp=bf16",
            "training.epochs=2",
        ],
    )
    out = io.StringIO()
    result = train(cfg, out=out)
    assert result.status == "finished"
    assert "(nccl)" in out.getvalue()
    from cluster.inspect import read_events
    from cluster.run.storage import Storage

    started = [e for e in read_events(Storage(result.run_url)) if e["event"] == "group_started"]
    assert started[0]["backend"] == "nccl"
