"""The worker's model wrap: ``DistributedDataParallel`` with the options this product trains with, the
optimizer (sharded with ``training.zero``), and nothing printed that a user cannot act on.

``find_unused_parameters`` is passed on purpose (``training.fixed_buckets``: it keeps DDP's first bucket
layout all run, so a resume is bitwise exact). DDP then notes, once per process on every rank, that it found
no unused parameters. That note comes from C++ (``TORCH_WARN_ONCE`` in ``Reducer::prepare_for_backward``,
called from DDP's forward through a pybind binding that installs no Python warning handler), so it is
written straight to file descriptor 2 and no ``warnings`` filter reaches it. :class:`_QuietNote` takes fd 2
for exactly that call (from the end of the wrapped module's forward to the end of DDP's) and writes back
every line but the note.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import tempfile
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cluster.spec.config import JobConfig
from cluster.spec.task import Task

logger = logging.getLogger(__name__)

UNUSED_NOTE = b"find_unused_parameters=True was specified in DDP constructor"
"""The start of DDP's note that no parameter went unused (``Reducer::search_unused_parameters``)."""

_note_seen = False  # the note is a TORCH_WARN_ONCE: once it was held back, this process never prints it


def wrap(raw_model: nn.Module, device: torch.device, cfg: JobConfig, sync: bool = True) -> DDP:
    """Wrap for training. ``gradient_as_bucket_view``: after backward the gradients are views into DDP's
    buckets, not a second copy (same values). Buffers (BatchNorm's running statistics) are broadcast
    from rank 0 before each forward only where there are any (``forward_sync_buffers``, torch 2.13's
    name for ``broadcast_buffers``; at init they are synced). ``sync=False`` skips DDP's check and
    broadcast at init (``init_sync``), for ranks that already hold the same state. With
    training.compile the wrapper's forward is compiled in place, so the model stays a DDP and
    ``raw_model`` the plain module a checkpoint holds."""
    model = DDP(
        raw_model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=cfg.training.fixed_buckets,  # see TrainingConfig.fixed_buckets
        gradient_as_bucket_view=True,
        **_buffer_sync(any(True for _ in raw_model.buffers())),
        **_init_sync(sync),
    )
    if cfg.training.compile:
        model.compile()  # (hooks would be traced into the compiled forward: the note stays)
    elif cfg.training.fixed_buckets and not _note_seen:
        _QuietNote(model, raw_model)
    return model


class _QuietNote:
    """Holds DDP's unused-parameters note back: fd 2 goes to a file from the end of the wrapped module's
    forward to the end of DDP's forward (DDP's own bookkeeping, no collective), then every line but the
    note is written back. Only DDP's forwards count (an evaluation calls the module itself). Removes its
    hooks once it held the note back."""

    def __init__(self, model: DDP, raw_model: nn.Module) -> None:
        self._armed = False
        self._saved: int | None = None
        self._file: Any = None
        self._hooks = [
            model.register_forward_pre_hook(self._arm),
            raw_model.register_forward_hook(self._take),
            model.register_forward_hook(self._give_back, always_call=True),
        ]

    def _arm(self, module: nn.Module, args: Any) -> None:
        self._armed = True

    def _take(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._armed or self._saved is not None:
            return
        if self._file is None:
            self._file = tempfile.TemporaryFile()  # noqa: SIM115  (kept open across forwards, closed below)
        sys.stderr.flush()
        self._file.seek(0)
        self._file.truncate()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)

    def _give_back(self, module: nn.Module, args: Any, output: Any) -> None:
        global _note_seen
        self._armed = False
        if self._saved is None:
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._saved = None
        self._file.seek(0)
        lines = self._file.read().splitlines(keepends=True)
        kept = b"".join(line for line in lines if UNUSED_NOTE not in line)
        held_back = len(kept) < sum(len(line) for line in lines)
        while kept:
            kept = kept[os.write(2, kept) :]
        if held_back:
            _note_seen = True
            for hook in self._hooks:
                hook.remove()
            self._file.close()


def build_optimizer(task: Task, raw_model: nn.Module, zero: bool) -> torch.optim.Optimizer:
    """The task's optimizer; with ``zero`` (training.zero) a ``ZeroRedundancyOptimizer`` of the same class,
    param groups and settings, each rank holding the state of its share of the parameters only."""
    optimizer = task.build_optimizer(raw_model)
    if not zero:
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    # ``defaults`` may hold settings the class sets itself (AdamW: decoupled_weight_decay)
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(g) for g in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **defaults)


def is_zero(optimizer: torch.optim.Optimizer) -> bool:
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # no import (0.4 s)
    return zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer)


def unsendable(optimizer: torch.optim.Optimizer) -> str:
    """Why one rank's optimizer state is not the whole state (so peers cannot send it); "" when it is."""
    if is_zero(optimizer):
        return "ZeroRedundancyOptimizer shards the optimizer state across ranks"
    return ""


def _buffer_sync(sync: bool) -> dict[str, Any]:
    """DDP's switch for broadcasting buffers before each forward: ``forward_sync_buffers`` since torch 2.13,
    ``broadcast_buffers`` (deprecated there) before it, where a GPU machine's torch may still be."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": sync}
    return {"broadcast_buffers": sync}


def _init_sync(sync: bool) -> dict[str, Any]:
    """DDP's ``init_sync`` where the installed torch has it (older ones always sync at init)."""
    if not sync and "init_sync" in inspect.signature(DDP.__init__).parameters:
        return {"init_sync": False}
    return {}
