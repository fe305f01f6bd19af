"""What a rank does on a GPU after its NCCL group failed, in the same process: it aborts and destroys the
group, sets up a new one and goes on, from its checkpoint (warm restart) or from the state it kept in GPU
memory (the peer path: release, a plan from its own report, a broadcast over NCCL, a digest check). Both
end bitwise equal to a run without the failure. One GPU: world size 1 (a survivor is its own source).
Skipped where there is no CUDA device."""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cluster.core.errors import WorkerError
from cluster.rank.worker import Worker
from cluster.seam.peers import plan_recovery
from cluster.spec.config import JobConfig
from tests.multiprocess.mp_helpers import run_workers, tiny_config

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]

EPOCHS, STEPS, FAULT_STEP = 2, 6, 4


def _config(storage: str) -> JobConfig:
    return tiny_config(
        storage,
        [
            "scaling.use_gpu=true",
            "workers=1",
            "training.deterministic=true",
            "training.amp=bf16",
            "training.seed=3",
            f"training.epochs={EPOCHS}",
            f"training.max_steps_per_epoch={STEPS}",
            "checkpoint.every_steps=2",
        ],
    )


def _entry(mode: str, cfg: JobConfig, run_url: str, out: str) -> None:
    try:
        os.environ["CLUSTER_INJECT_FAULT"] = f"0:{FAULT_STEP}:raise:0"  # first attempt only
        worker = Worker(cfg, 0, 1, run_url, 0)
        worker.setup("127.0.0.1", worker.bind_store())
        failed = None
        try:
            worker.run_epoch(0, 0)
        except WorkerError as exc:
            failed = exc.message
        assert failed is not None and "injected fault" in failed, failed
        result: dict[str, Any] = {"group_left": not dist.is_initialized()}
        plan = None
        if mode == "peers":
            state = worker.release(0, 1, 1)
            assert state is not None
            plan = plan_recovery({0: state})
            assert not isinstance(plan, str), plan
        else:
            worker.reset(0, 1, 1)
        session = worker.setup("127.0.0.1", worker.bind_store(), plan)
        resume = session.info.resume
        result["resume"] = (resume.source, resume.global_step, session.info.backend)
        result["reads"] = session.info.storage_reads
        epoch, start = resume.epoch, resume.step_in_epoch
        while epoch < EPOCHS:
            worker.run_epoch(epoch, start)
            epoch, start = epoch + 1, 0
        worker.finish()
        result["params"] = {k: v.detach().cpu().clone() for k, v in session.raw_model.state_dict().items()}
        torch.save(result, f"{out}/result.pt")
        worker.shutdown()
    except BaseException:
        with open(f"{out}/error.txt", "w") as fh:
            fh.write(traceback.format_exc())
        raise


def _run(mode: str, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / mode
    out.mkdir()
    storage = f"{tmp_path}/{mode}-s"
    proc = mp.get_context("spawn").Process(
        target=_entry, args=(mode, _config(storage), f"{storage}/run", str(out))
    )
    proc.start()
    proc.join(240)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        raise TimeoutError(f"{mode}: the worker did not finish within 240 s")
    if proc.exitcode != 0:
        err = out / "error.txt"
        raise RuntimeError(f"{mode}: worker failed:\n{err.read_text() if err.exists() else proc.exitcode}")
    result: dict[str, Any] = torch.load(out / "result.pt", weights_only=False)
    return result


def _uninterrupted(tmp_path: Path) -> dict[str, torch.Tensor]:
    out = tmp_path / "whole"
    out.mkdir()
    storage = f"{tmp_path}/whole-s"
    (res,) = run_workers(1, _config(storage), f"{storage}/run", [(0, 0), (1, 0)], str(out))
    return {k: v.cpu() for k, v in res["params"].items()}


@pytest.mark.parametrize("mode", ["checkpoint", "peers"])
def test_after_a_raised_error_the_same_process_sets_up_nccl_again_and_ends_exact(
    mode: str, tmp_path: Path
) -> None:
    got = _run(mode, tmp_path)
    assert got["group_left"], "the failed NCCL group was not destroyed"
    source, step, backend = got["resume"]
    assert backend == "nccl"
    if mode == "peers":
        assert (source, step) == ("peers", FAULT_STEP - 1)
        assert got["reads"] == 0  # the state came from memory, not storage
    else:
        assert (source, step) == ("checkpoint", 2)
    whole = _uninterrupted(tmp_path)
    for name, value in whole.items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=0, msg=name)
