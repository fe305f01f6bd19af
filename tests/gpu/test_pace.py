"""``StepPace`` on a GPU times the device's work, not the host's launches: the host queues a step's kernels
in far less time than the device takes to run them, and nothing waits for the device. Skipped where there
is no CUDA device."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from cluster.rank.pace import StepPace

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]

N, MATMULS, STEPS = 4096, 20, 6


def test_step_pace_times_the_device_not_the_host() -> None:
    dev = torch.device("cuda", 0)
    model = nn.Linear(N, N).to(dev)
    x = torch.randn(N, N, device=dev) / N**0.5
    pace = StepPace()
    pace.attach(model, dev)

    def step() -> None:
        t0 = time.perf_counter()
        pace.begin()
        y = x
        for _ in range(MATMULS):  # device work the host only queues
            y = y @ x
        model(y).sum().backward()
        pace.end(time.perf_counter() - t0)

    step()  # warm-up: cuBLAS handles, the hooks learned
    torch.cuda.synchronize()
    pace.take()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    device_s = (time.perf_counter() - t0) / STEPS
    step()  # resolves the events completed by now (on the training thread, as in the worker)
    p = pace.take()
    assert p is not None and p.steps >= STEPS, p
    assert p.compute_s > 0.5 * device_s, (p, device_s)  # the device's time per step
    assert p.step_s < 0.5 * p.compute_s, p  # the host's step: launches only
