"""A CLI command that read a run's metrics leaves no native thread behind: Arrow's thread pools, started by
``pq.read_table``, could still be running at interpreter exit and abort ``python -m cluster show`` after it
printed ("terminate called without an active exception", SIGABRT; seen once in the suite, 2026-12-07)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

RUN = Path(__file__).parents[1] / "fixtures" / "runs_before_layers" / "before-layers"

PROBE = """
import contextlib, io, json, os, sys
from cluster.__main__ import main
from cluster.run.history import read_past_groups
from cluster.run.logs import read_event_log
from cluster.run.storage import Storage

def threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))

before = threads()
out = io.StringIO()
with contextlib.redirect_stdout(out):
    codes = [main(["show", sys.argv[1]]), main(["plot", sys.argv[1], "--out", sys.argv[2]])]
storage = Storage(sys.argv[1])
groups = read_past_groups(storage, lambda: read_event_log(storage))
rows = sum(len(g.rows) for g in groups)
got = {"before": before, "after": threads(), "codes": codes, "rows": rows, "shown": out.getvalue()}
print(json.dumps(got))
"""


def test_show_plot_and_the_hang_history_start_no_thread_that_outlives_them(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(RUN), str(tmp_path / "loss.png")],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["codes"] == [0, 0]
    assert "samples/s" in got["shown"] and (tmp_path / "loss.png").stat().st_size > 0  # metrics were read
    assert got["rows"] > 0
    assert got["after"] == got["before"], "reading the metrics left threads running"
