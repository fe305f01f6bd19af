"""The fault used by ``bench_ddp --fault`` (the same for all three arms, so the kill point is identical),
and the known slowdown ``bench_interleaved`` uses to check its own resolution.

``KillableCharLM`` is ``CharLMTask`` whose ``compute_loss`` SIGKILLs rank ``kill_rank`` right before the
forward pass of global step ``kill_step`` (like ``CLUSTER_INJECT_FAULT=1:STEP:crash``), after writing the
wall-clock time of the kill to ``kill_file``. The file doubles as the "already fired" marker, so the fault
fires on the first attempt only. Kept light (no Ray import): the product's workers import it by path.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from jobs.tasks.charlm import CharLMTask


class KillableCharLM(CharLMTask):
    """task_args as CharLMTask, plus ``kill_step`` (global step, 1-based), ``kill_rank`` and ``kill_file``."""

    def __init__(self, **args: Any) -> None:
        super().__init__(**args)
        self._calls = 0

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        self._calls += 1  # one call per optimizer step (no gradient accumulation in the benchmark)
        kill_step = int(self.args.get("kill_step", 0))
        kill_file = str(self.args.get("kill_file", ""))
        if kill_step and self._calls == kill_step and kill_file and not os.path.exists(kill_file):
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            if rank == int(self.args.get("kill_rank", 1)):
                with open(kill_file + ".tmp", "w") as fh:
                    fh.write(f"{time.time():.6f} {os.getpid()} {kill_step}\n")
                os.replace(kill_file + ".tmp", kill_file)
                os.kill(os.getpid(), signal.SIGKILL)
        return super().compute_loss(model, batch)


class SlowCharLM(CharLMTask):
    """CharLMTask whose every step is ``step_delay_ms`` longer (a sleep before the forward pass, on every
    rank): a slowdown of known size, to check that a benchmark resolves an effect that small."""

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        time.sleep(float(self.args.get("step_delay_ms", 0.0)) / 1000.0)
        return super().compute_loss(model, batch)
