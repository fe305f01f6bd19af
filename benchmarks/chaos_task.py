"""The char-LM task of ``bench_chaos``, the same in every arm: ``CharLMTask`` plus what the harness needs to
see and to strike, all through files in ``task_args["chaos_dir"]`` (a local folder):

- ``rank<R>.pid``: written by each rank at its first step (``<pid> <ray node id or ->``), so the harness
  finds the process to SIGKILL, SIGSTOP or slow, and the node to drain;
- ``steps.log``: rank 0 appends ``<time> <pid> <fingerprint> <loss>`` per step (one buffered line), the
  fingerprint a CRC of the batch's tokens: the same global step trains the same batch in every attempt and
  every arm, so a repeated fingerprint is a recomputed step, whatever the arm's own step counter says;
- ``nan``: when the harness creates it (content: a rank), that rank claims it (an atomic rename to
  ``nan.fired``) and its loss in that one step is NaN: a diverged step, as a bad batch gives.

Kept light (no Ray import at module level): the product's workers import it by path.
"""

from __future__ import annotations

import os
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from jobs.tasks.charlm import CharLMTask


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "-"
    except ImportError:  # a rank without Ray: "-" says so
        return "-"


def fingerprint(batch: Any) -> int:
    """The batch's identity: a CRC of its input tokens."""
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    return zlib.crc32(x.contiguous().numpy().tobytes())


class ChaosCharLM(CharLMTask):
    """task_args as CharLMTask, plus ``chaos_dir``."""

    def __init__(self, **args: Any) -> None:
        chaos_dir = str(args.pop("chaos_dir", ""))
        super().__init__(**args)
        self.chaos_dir = chaos_dir
        self._log: Any = None
        self._announced = False

    def _announce(self, rank: int) -> None:
        self._announced = True
        path = os.path.join(self.chaos_dir, f"rank{rank}.pid")
        with open(path + ".tmp", "w") as fh:
            fh.write(f"{os.getpid()} {_node_id()}\n")
        os.replace(path + ".tmp", path)
        if rank == 0:
            self._log = open(os.path.join(self.chaos_dir, "steps.log"), "a", buffering=1)

    def _nan_now(self, rank: int) -> bool:
        trigger = os.path.join(self.chaos_dir, "nan")
        if not os.path.exists(trigger):
            return False
        try:
            with open(trigger) as fh:
                wanted = int(fh.read().strip() or 0)
            if wanted != rank:
                return False
            os.rename(trigger, trigger + ".fired")  # one rank, one step: the claim is atomic
        except (OSError, ValueError):
            return False
        return True

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        if not self.chaos_dir:
            return super().compute_loss(model, batch)
        rank = _rank()
        if not self._announced:
            self._announce(rank)
        loss, extra = super().compute_loss(model, batch)
        if self._nan_now(rank):
            loss = loss * float("nan")
        if self._log is not None:
            self._log.write(
                f"{time.time():.6f} {os.getpid()} {fingerprint(batch)} {float(loss.detach()):.5f}\n"
            )
        return loss, extra
