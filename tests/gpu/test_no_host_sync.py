"""A stretch of the worker's training steps on a GPU never waits for the device: the loss and the extra
metrics stay on the device between log steps, under ``torch.cuda.set_sync_debug_mode("error")``, which makes
any host-device synchronisation raise. Skipped where there is no CUDA device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from jobs.tasks.charlm import CharLMTask

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]

CHECK_FROM, CHECK_UNTIL, STEPS = 3, 9, 10


class SyncCheckedCharLM(CharLMTask):
    """CharLM whose steps ``CHECK_FROM`` .. ``CHECK_UNTIL - 1`` run with sync debugging set to error: from
    inside the first of them to the start of ``CHECK_UNTIL``, so the worker's own code between steps (loss
    and metric sums, heartbeat bookkeeping, sampler, batch transfer) is checked too. Steps 1-2 are left out:
    DDP and the optimizer set themselves up there. Returns a tensor metric, which must stay on the device."""

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        cur = self.current
        assert cur is not None
        if cur.global_step == CHECK_FROM:
            torch.cuda.set_sync_debug_mode("error")
        elif cur.global_step == CHECK_UNTIL:
            torch.cuda.set_sync_debug_mode("default")
        x, y = batch
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        acc = (logits.detach().argmax(-1) == y).float().mean()
        return loss, {"acc": acc}


def test_steps_between_log_steps_never_sync_with_the_device(tmp_path: object) -> None:
    from tests.multiprocess.mp_helpers import run_workers, tiny_config

    cfg = tiny_config(
        f"{tmp_path}/s",
        [
            f"task={__name__}:SyncCheckedCharLM",
            "scaling.use_gpu=true",
            "workers=1",
            f"training.max_steps_per_epoch={STEPS}",
            f"training.log_every_steps={STEPS}",  # the only log step is after the checked stretch
            "training.grad_accum_steps=2",
            "training.amp=bf16",
            "training.grad_clip=1.0",
            "checkpoint.every_epochs=0",
        ],
    )
    out = tmp_path / "o"  # type: ignore[operator]
    out.mkdir()
    # A synchronisation inside the stretch raises in the worker, which fails the rank (RuntimeError here).
    (res,) = run_workers(1, cfg, f"{tmp_path}/s/run", [(0, 0)], str(out))
    assert res["epochs"][0][1] == STEPS
    assert torch.isfinite(torch.tensor(res["epochs"][0][2]))
