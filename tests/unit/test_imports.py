"""What a worker process imports: the package, not the driver. A worker's process imports
``cluster.worker_group`` (its actor class lives there); the driver's imports (pyarrow for the metrics files,
tracking) would cost every rank CPU at start, on every rank's path to the first step."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]  # starts processes


def test_a_worker_imports_neither_the_driver_nor_pyarrow_and_the_api_still_resolves() -> None:
    code = (
        "import sys, cluster.worker_group\n"
        "heavy = sorted(m for m in ('cluster.driver', 'cluster.api', 'cluster.run.logs', 'pyarrow')"
        " if m in sys.modules)\n"
        "print(','.join(heavy))\n"
        "from cluster import Driver, train, load_model\n"
        "print(train.__module__, 'cluster.api.train' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    heavy, api = out.stdout.splitlines()
    assert heavy == "", f"a worker imported {heavy}"
    assert api == "cluster.api.train True"  # the public names load on first use


def test_a_rank_s_heavy_imports_run_without_the_garbage_collector_and_leave_it_on() -> None:
    """torch's import (in ``import cluster``) and torch._dynamo's (which DDP's constructor needs, imported
    ahead by the actor) are a rank's start: the collector ran ~650 times through them, 7-10 % of their
    CPU (benchmarks/LOG.md, 2026-12-08). Paused, it runs a few times at most (before the pause, or an
    explicit ``gc.collect`` of a library): 375 times in ``import cluster`` without it; on after, as before."""
    code = (
        "import gc, sys\n"
        "runs = []\n"
        "gc.callbacks.append(lambda phase, info: runs.append(1) if phase == 'start' else None)\n"
        "import cluster\n"
        "in_cluster = len(runs)\n"
        "assert 'torch' in sys.modules and gc.isenabled()\n"
        "from cluster.worker_group.actor import _import_dynamo\n"
        "del runs[:]\n"
        "_import_dynamo()\n"
        "assert 'torch._dynamo' in sys.modules and gc.isenabled()\n"
        "print(in_cluster, len(runs))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-3000:]
    in_cluster, in_dynamo = map(int, out.stdout.split())
    assert in_cluster < 20 and in_dynamo < 20, (in_cluster, in_dynamo)


def test_gc_paused_turns_the_collector_off_inside_and_leaves_it_as_it_was() -> None:
    import gc

    from cluster.core.imports import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("an import that fails")
    assert gc.isenabled()
    gc.disable()  # a process that turned it off keeps it off
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
