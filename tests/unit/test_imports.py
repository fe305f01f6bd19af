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
