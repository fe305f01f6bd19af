"""``cluster.rank.profiling.StepProfiler``: a request records the next steps with torch.profiler and writes a
trace and a table to storage; without a request nothing is recorded."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from cluster.rank.profiling import ProfileRequest, StepProfiler, table_name, trace_name
from cluster.run.storage import Storage

pytestmark = pytest.mark.timeout(60)


def _steps(prof: StepProfiler, model: torch.nn.Module, first: int, n: int) -> None:
    for step in range(first, first + n):
        prof.before_step(torch.device("cpu"))
        model(torch.randn(16, 8)).sum().backward()
        prof.after_step(step)


def test_a_request_records_the_next_steps_into_a_trace_and_a_table(tmp_path: object) -> None:
    storage = Storage(str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    prof = StepProfiler(storage, rank=3)
    _steps(prof, model, 1, 2)  # no request: nothing recorded, nothing written
    assert storage.listdir("profiles") == []
    prof.request(ProfileRequest("abc", 2, "profiles/x-abc"))
    _steps(prof, model, 3, 4)  # step 3 warms the profiler up; it records steps 4 and 5 only
    prof.close(6)
    assert set(storage.listdir("profiles/x-abc")) == {trace_name(3), table_name(3)}
    trace = json.loads(gzip.decompress(storage.read_bytes(f"profiles/x-abc/{trace_name(3)}")))
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert sum(n.startswith("ProfilerStep#") for n in names) == 2  # two steps, each its own span
    assert any("addmm" in n for n in names)  # the Linear layers' matmuls
    table = storage.read_bytes(f"profiles/x-abc/{table_name(3)}").decode()
    assert table.startswith("rank 3: 2 step(s) recorded, up to global step 5, after one warm-up step")
    assert "Self CPU" in table and "aten::" in table


def test_a_profile_cut_short_by_the_end_is_written_with_what_it_has(tmp_path: object) -> None:
    storage = Storage(str(tmp_path))
    prof = StepProfiler(storage, rank=0)
    prof.request(ProfileRequest("cut", 50, "profiles/cut"))
    _steps(prof, torch.nn.Linear(8, 1), 1, 3)
    prof.close(3)  # the rank finished (Worker.finish) before 50 steps
    table = storage.read_bytes(f"profiles/cut/{table_name(0)}").decode()
    assert table.startswith("rank 0: 2 step(s) recorded, up to global step 3")
