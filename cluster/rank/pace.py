"""Each rank's pace: how long its own part of a step takes, before it waits for the other ranks.

In data-parallel training every rank waits for the slowest one at each step's gradient all-reduce, so the
step's wall time is the same on every rank and cannot say which rank holds the others up. What differs is
the time from the step's start to the rank's last gradient: its input fetch, forward and backward, up to
the point where it can only wait for its peers. A rank on a slow GPU, a throttled or busy host, or behind
a slow input pipeline takes longer there. ``StepPace`` measures it on every step (host time on CPU, CUDA
events on a GPU: nothing waits for the device); the heartbeat hands the window's medians to the driver,
which compares the ranks (``cluster.driver.policy.SlowRankWatch``).

One collective can come before the last gradient: DDP's broadcast of rank 0's buffers at the start of each
forward (models with buffers, ``forward_sync_buffers``). There every rank waits for the slowest to reach its
forward, so that wait (from DDP's forward to the wrapped module's) is left out. Collectives inside the
model itself (SyncBatchNorm) are not seen: with them, a rank slow before such a layer can hide."""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections import deque
from typing import Any

import torch
from torch import nn

from cluster.seam.protocol import Pace

KEEP_HOOKS = 2
"""After the first step, only the parameters whose gradients arrived last keep a hook: the measure needs
the last one, and a hook on every parameter would cost a Python call each per step."""
MAX_PENDING = 64
"""CUDA: steps whose events are not complete yet; older ones are dropped (a device far behind the host)."""


class StepPace:
    """Times each step's own part on one rank. ``begin`` and ``end`` bracket a step on the training
    thread; ``take`` (any thread) returns what was measured since the previous ``take``."""

    def __init__(self) -> None:
        self._params: list[nn.Parameter] = []
        self._handles: list[Any] = []
        self._cuda = False
        self._learning = False
        self._order: list[int] = []  # the first step's: parameter indices in the order gradients arrived
        self._forward_hooks: list[Any] = []
        self._start: Any = None
        self._done: Any = None
        self._entered: Any = None  # the wrapper's forward began (its buffer broadcast comes next)
        self._waits: list[tuple[Any, Any]] = []  # this step's (wrapper's forward, module's forward)
        self._pending: deque[tuple[Any, Any, list[tuple[Any, Any]], float, float]] = deque()
        self._input_s = 0.0  # this step's wait for its batches
        self._samples: list[tuple[float, float, float]] = []
        self._lock = threading.Lock()

    def attach(self, model: nn.Module, device: torch.device, syncing: nn.Module | None = None) -> None:
        """Watch ``model``'s gradients from the next step on (a new session; a survivor's kept model is
        attached again, its old hooks removed). ``syncing``: the DDP wrapping ``model`` when it broadcasts
        buffers at each forward; the wait from its forward to ``model``'s is then left out."""
        self._remove(forward=True)
        if syncing is not None:
            self._forward_hooks = [
                syncing.register_forward_pre_hook(self._enter),
                model.register_forward_pre_hook(self._synced),
            ]
        self._cuda = device.type == "cuda"
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._pending.clear()
        with self._lock:
            self._samples = []  # the previous group's steps
        self._hook(range(len(self._params)))
        self._learning = True

    def _hook(self, indices: Any) -> None:
        self._remove(forward=False)
        self._order = []
        self._handles = [
            self._params[i].register_post_accumulate_grad_hook(functools.partial(self._arrived, i))
            for i in indices
        ]

    def _remove(self, forward: bool) -> None:
        for h in self._handles + (self._forward_hooks if forward else []):
            h.remove()
        self._handles = []
        if forward:
            self._forward_hooks = []

    def _arrived(self, index: int, _param: Any) -> None:
        # Runs in autograd's backward (on CUDA in its device thread, on the backward's stream).
        if self._learning:
            self._order.append(index)
        self._done = self._now()

    def _enter(self, _module: Any, _args: Any) -> None:
        self._entered = self._now()

    def _synced(self, _module: Any, _args: Any) -> None:
        if self._entered is not None:
            self._waits.append((self._entered, self._now()))
            self._entered = None

    def _now(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self) -> None:
        self._done = self._entered = None
        self._waits = []
        self._input_s = 0.0
        self._start = self._now() if self._params else None

    @property
    def input_s(self) -> float:
        """The last step's wait for its batches (host time), until the next step begins."""
        return self._input_s

    def fetched(self, seconds: float) -> None:
        """The step waited ``seconds`` for a batch (host time; called per micro-batch)."""
        self._input_s += seconds

    def end(self, step_s: float) -> None:
        start, done, waits = self._start, self._done, self._waits
        self._start = self._done = self._entered = None
        self._waits = []
        if start is None:
            return
        if self._learning:
            if self._order:  # keep the hooks whose gradients came last
                last = list(dict.fromkeys(reversed(self._order)))[:KEEP_HOOKS]
                self._hook(last)
                self._learning = False
        elif done is None:  # none of the kept hooks fired (a parameter unused this step): learn again
            self._hook(range(len(self._params)))
            self._learning = True
        if done is None:
            return
        if not self._cuda:
            self._add(done - start - sum(b - a for a, b in waits), step_s, self._input_s)
            return
        self._pending.append((start, done, waits, step_s, self._input_s))
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()
        while self._pending and self._pending[0][1].query():
            s, d, w, wall, fetch = self._pending.popleft()
            ms = s.elapsed_time(d) - sum(a.elapsed_time(b) for a, b in w)
            self._add(ms / 1000.0, wall, fetch)

    def _add(self, compute_s: float, step_s: float, input_s: float) -> None:
        with self._lock:
            self._samples.append((compute_s, step_s, input_s))

    def take(self) -> Pace | None:
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            return None
        return Pace(
            compute_s=statistics.median(c for c, _, _ in samples),
            step_s=statistics.median(w for _, w, _ in samples),
            steps=len(samples),
            input_s=statistics.median(i for _, _, i in samples),
        )

    def close(self) -> None:
        self._remove(forward=True)
        self._params = []
        self._pending.clear()
