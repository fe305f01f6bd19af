"""Profiling a few steps of a running job on request (``python -m cluster profile RUN``).

The driver hands the request to the ranks it names (an actor call served by the worker's second thread);
each such rank's training thread starts ``torch.profiler`` at its next step, records that many steps (CPU,
and CUDA kernels on a GPU), and writes two files to ``<run>/profiles/<id>/``:

- ``rank<R>.pt.trace.json.gz``: the trace, for https://ui.perfetto.dev, ``chrome://tracing`` or
  TensorBoard's PyTorch profiler plugin;
- ``rank<R>.txt``: the operators that took the most time, as ``torch.profiler``'s table.

Nothing is profiled otherwise: outside a request this costs one attribute read per step. The export and
upload run in a thread of their own once the steps are recorded, off the training path.
Both files are written atomically (``Storage.write_all_atomic``): a reader sees each whole or not at
all.
"""

from __future__ import annotations

import gzip
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import torch

from cluster.run.storage import Storage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileRequest:
    id: str
    steps: int
    folder: str
    """Relative to the run: ``profiles/<when>-<id>``."""


def trace_name(rank: int) -> str:
    return f"rank{rank}.pt.trace.json.gz"


def table_name(rank: int) -> str:
    return f"rank{rank}.txt"


class StepProfiler:
    """One rank's: ``request`` (any thread), then ``before_step`` / ``after_step`` around each training step
    (the training thread), ``close`` when the rank finishes (writes what a cut-short request recorded)."""

    def __init__(self, storage: Storage, rank: int) -> None:
        self.storage = storage
        self.rank = rank
        self._pending: ProfileRequest | None = None
        self._active: tuple[ProfileRequest, Any, int] | None = None  # (request, profiler, steps recorded)
        self._uploads: list[threading.Thread] = []

    def request(self, req: ProfileRequest) -> None:
        self._pending = req

    def before_step(self, device: torch.device) -> None:
        if self._pending is None or self._active is not None:
            return
        req, self._pending = self._pending, None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # One step of warm-up (the profiler's own start-up stays out of the figures), then the steps asked
        # for, each marked in the trace ("ProfilerStep#N").
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=req.steps, repeat=1)
        prof = torch.profiler.profile(activities=activities, schedule=schedule, record_shapes=True)
        prof.__enter__()
        self._active = (req, prof, 0)

    def after_step(self, step: int) -> None:
        if self._active is None:
            return
        req, prof, done = self._active
        prof.step()
        done += 1
        self._active = (req, prof, done)
        if done > req.steps:  # the warm-up step, then the recorded ones
            self._finish(step)

    def close(self, step: int) -> None:
        if self._active is not None:
            self._finish(step)
        for t in self._uploads:
            t.join(60)

    def _finish(self, step: int) -> None:
        assert self._active is not None
        req, prof, done = self._active
        self._active = None
        prof.__exit__(None, None, None)
        done = max(0, done - 1)  # recorded: all but the warm-up step
        t = threading.Thread(
            target=self._write, args=(req, prof, done, step), name="profile-upload", daemon=True
        )
        t.start()
        self._uploads = [u for u in self._uploads if u.is_alive()] + [t]

    def _write(self, req: ProfileRequest, prof: Any, done: int, step: int) -> None:
        try:
            sort = (
                "self_cuda_time_total" if any(e.device_type.name == "CUDA" for e in prof.events()) else None
            )
            table = prof.key_averages().table(sort_by=sort or "self_cpu_time_total", row_limit=30)
            head = (
                f"rank {self.rank}: {done} step(s) recorded, up to global step {step}, after one warm-up step"
            )
            head += "\n\n"
            with tempfile.TemporaryDirectory(prefix="cluster-profile-") as tmp:
                path = os.path.join(tmp, "trace.json")
                prof.export_chrome_trace(path)
                with open(path, "rb") as fh:
                    trace = gzip.compress(fh.read(), compresslevel=6)
            self.storage.write_all_atomic(  # each whole or not at all, never a torn file
                {
                    f"{req.folder}/{trace_name(self.rank)}": trace,
                    f"{req.folder}/{table_name(self.rank)}": (head + table).encode(),
                }
            )
        except Exception as exc:  # a profile that cannot be written must not fail the training
            logger.warning(
                "rank %d: writing the profile %s failed: %s: %s", self.rank, req.id, type(exc).__name__, exc
            )
