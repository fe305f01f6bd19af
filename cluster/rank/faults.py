"""Faults injected on purpose into one rank, to rehearse recovery (``failures.inject`` and
``CLUSTER_INJECT_FAULT``; the kinds are documented on ``cluster.spec.config.FaultSpec``).

The training loop reaches them through a few hooks, each a no-op without faults: :meth:`Faults.before_step`
and :meth:`Faults.after_step` bracket a step, :meth:`Faults.loss` poisons a diverging rank's loss,
:meth:`Faults.in_eval` marks an evaluation's progress and :meth:`Faults.store` hands the checkpoint writer
a store that dies mid-commit. ``step`` is always the 1-based global step the fault names: the step about to
run (or running) for the step hooks, the step just evaluated for ``in_eval``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cluster.rank.replica import flip_bit
from cluster.run.checkpoint import CheckpointStore, step_dir
from cluster.run.folder import RunFolder
from cluster.run.storage import Storage
from cluster.spec.config import FaultSpec, JobConfig
from cluster.spec.load import parse_fault_env

SLOW_FAULT_S = 0.05
"""The injected ``slow`` fault's sleep at the start of each step."""


class Faults:
    """The faults of rank ``rank`` in attempt ``attempt`` (a fault for attempt -1 fires in every one)."""

    def __init__(self, cfg: JobConfig, rank: int, attempt: int) -> None:
        faults = list(cfg.failures.inject)
        env = os.environ.get("CLUSTER_INJECT_FAULT")
        if env:
            faults.append(parse_fault_env(env, cfg.scaling.num_workers))
        self.rank = rank
        self.specs: list[FaultSpec] = [f for f in faults if f.rank == rank and f.attempt in (-1, attempt)]

    def _from(self, kind: str, step: int) -> bool:
        """Whether a fault of ``kind`` is on in step ``step`` (it starts at its step)."""
        return bool(self.specs) and any(f.kind == kind and f.step <= step for f in self.specs)

    def _at(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and f.step == step for f in self.specs)

    def before_step(self, step: int, model: nn.Module) -> None:
        """At the start of step ``step`` (its time counted): crash, hang or raise before it, flip a bit of
        the first parameter (``flip_bit``), sleep in it (``slow``), or arm a crash in its backward
        (``crash_in_backward``: the first parameter's gradient comes last in backward, when the other ranks
        are in the all-reduce)."""
        if not self.specs:
            return
        for fault in self.specs:
            if fault.step != step:
                continue
            if fault.kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "hang":
                while True:
                    time.sleep(3600)
            elif fault.kind == "raise":
                raise RuntimeError(f"injected fault on rank {self.rank} at step {step}")
            elif fault.kind == "flip_bit":  # a silent error: nothing raises, the replicas differ
                flip_bit(next(model.parameters()))
        if self._from("slow", step):
            time.sleep(SLOW_FAULT_S)
        if self._at("crash_in_backward", step):
            first = next(model.parameters())
            first.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss in step ``step``: NaN from a ``nan`` fault's step on."""
        return loss * float("nan") if self._from("nan", step) else loss

    def after_step(self, step: int) -> None:
        """Right after step ``step``'s optimizer update, before the next collective."""
        if self._at("crash_after_step", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def in_eval(self, step: int) -> Callable[[], None]:
        """The evaluation after step ``step``'s progress mark: it dies at the first one under a
        ``crash_in_eval`` fault of that step."""
        if not self._at("crash_in_eval", step):
            return _nothing
        return lambda: os.kill(os.getpid(), signal.SIGKILL)

    def store(self, folder: RunFolder) -> CheckpointStore:
        """The checkpoint store to write through: the run folder's, or under a ``crash_in_checkpoint`` fault
        one of its own that dies mid-commit at the fault's steps (a subclass of the store, so it cannot be
        the folder's; the rank writes and resumes through it alone)."""
        steps = {f.step for f in self.specs if f.kind == "crash_in_checkpoint"}
        return CrashingStore(folder.storage, steps) if steps else folder.checkpoints


def _nothing() -> None:
    pass


class CrashingStore(CheckpointStore):
    """Fault injection: die after writing a checkpoint's files, before its manifest (a torn write)."""

    def __init__(self, storage: Storage, steps: set[int]) -> None:
        super().__init__(storage)
        self.steps = steps

    def commit(self, step: int, files: dict[str, bytes], meta: dict[str, Any]) -> Any:
        if step in self.steps:
            for name, data in files.items():
                self.storage.write_bytes(f"{step_dir(step)}/{name}", data)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().commit(step, files, meta)
