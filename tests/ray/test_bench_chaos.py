"""The chaos benchmark's smoke mode (``python -m benchmarks.bench_chaos --smoke``), so that it cannot rot:
2 ranks, a rank SIGKILLed and a rank SIGSTOPped, the product's arm, short (the suite's time: the peers'
arms and the fault-free run are the benchmark's own, ``--smoke`` alone runs them); the figures it prints
must be sane."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

import pytest

pytestmark = [pytest.mark.timeout(400)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kill_leftovers(root: str) -> None:
    """SIGKILL every process whose command line names ``root`` (this test's Ray nodes and ranks), by PID."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if root.encode() in fh.read():
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def test_the_smoke_mode_runs_and_its_figures_are_sane(tmp_path: Any) -> None:
    root = tempfile.mkdtemp(prefix="cht-", dir="/tmp")  # short: Ray's socket paths live under it
    cmd = [sys.executable, "-m", "benchmarks.bench_chaos", "--smoke", "--out-dir", str(tmp_path)]
    cmd += ["--tmp-root", root, "--arms", "product", "--no-baseline", "--epochs", "4", "--every", "8"]
    cmd += ["--hang-timeout", "6", "--timeout", "300"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": REPO}
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=360)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_leftovers(root)
    assert proc.returncode == 0, out[-5000:]
    (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    arms = json.loads(line.removeprefix("RESULT "))
    assert set(arms) == {"product"}, out[-3000:]
    for arm, r in arms.items():
        assert r["status"] == "finished", (arm, r)
        assert 0 < r["ettr_harness"] <= 1, (arm, r)
        fired = {f["kind"] for f in r["faults"] if f.get("fired_at")}
        assert fired == {"kill", "hang"}, (arm, r["faults"])
    product = arms["product"]
    assert 0 < product["ettr_ledger"] <= 1, product  # the product's own account (cluster.run_goodput)
    assert abs(product["ledger_sum_vs_wall_s"]) <= max(0.5, 0.01 * product["wall_s"]), product
    kills = [f for f in product["faults"] if f["kind"] == "kill"]
    assert kills and all(f["steps_recomputed"] == 0 for f in kills), kills
    for ext in ("json", "md", "png"):
        assert os.path.getsize(tmp_path / f"chaos_smoke.{ext}") > 0
