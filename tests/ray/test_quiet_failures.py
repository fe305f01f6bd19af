"""A user's set-up mistake, run as the user runs it (``python -m jobs.train``, an embedded Ray): stderr holds
its one clear line and nothing else: no traceback, no Ray "Unhandled error" report of a rank's call the driver
had already handled, and no claim of checkpoints a run that never wrote one does not have."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.support.procs import MARK, kill_marked, new_mark

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.timeout(300)


def run_train(tmp: pathlib.Path, config: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    """``python -m jobs.train`` with its own Ray temp dir (short: Ray's socket paths must fit 107 bytes);
    every process it starts is killed afterwards."""
    ray_tmp = tempfile.mkdtemp(prefix="rq", dir="/tmp")
    mark = new_mark()
    env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "RAY_AUTH_MODE": "disabled",
        "RAY_TMPDIR": ray_tmp,
        MARK: mark,
    }
    env.pop("RAY_ADDRESS", None)
    sets = [arg for o in (f"storage={tmp}/runs", *overrides) for arg in ("--set", o)]
    try:
        return subprocess.run(
            [sys.executable, "-m", "jobs.train", "--config", config, *sets],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        kill_marked(mark)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def assert_one_clean_line(out: subprocess.CompletedProcess[str], code: int, *fragments: str) -> str:
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert "Unhandled error" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_a_task_that_raises_in_set_up_on_every_rank_prints_one_line(tmp_path: pathlib.Path) -> None:
    out = run_train(
        tmp_path,
        "jobs/configs/tiny_cpu.yaml",
        "name=raises",
        "task=tests.support.tasks:RaisesIn",
        "task_args.method=build_model",
        "training.global_batch_size=8",
        "training.epochs=1",
        "training.max_steps_per_epoch=2",
        "failures.hot_spare=false",
        "failures.backoff_s=0",
    )
    line = assert_one_clean_line(
        out, 1, "training failed: ValueError at tests/support/tasks.py:", "raised in set-up on every rank"
    )
    assert "intact" not in line and "from step 0" in line, line  # it never wrote a checkpoint


def test_a_dataset_path_with_no_data_prints_one_line(tmp_path: pathlib.Path) -> None:
    """Every rank raises the same ConfigError in ``build_train_dataset``: the driver reports the first; the
    others' results must not come back later as Ray's "Unhandled error" tracebacks."""
    out = run_train(
        tmp_path,
        "jobs/configs/tabular_cpu.yaml",
        f"task_args.dataset={tmp_path}/no-such-data",
        "failures.hot_spare=false",
    )
    assert_one_clean_line(out, 2, "config error: dataset", "has no Parquet files")


def test_the_answers_of_the_other_ranks_are_read_so_ray_reports_no_unhandled_error(ray_local: None) -> None:
    """``get_all`` (every call of the driver to all ranks) ends at the first rank's error; the other ranks'
    answers, errors too, are read once they settle. Unread, Ray prints each as an "Unhandled error"
    traceback once its reference is freed: in a user's own script (``cluster.train``), where no
    ``RAY_IGNORE_UNHANDLED_ERRORS`` is set, after the one clear failure line."""
    import gc
    import logging
    import time

    import ray

    from cluster.worker_group.calls import get_all

    @ray.remote(num_cpus=0)
    def fail(delay: float) -> None:
        time.sleep(delay)
        raise ValueError(f"failed after {delay}s")

    reports: list[str] = []

    class Reports(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reports.append(record.getMessage())

    handler = Reports()
    ray_log = logging.getLogger("ray._private.worker")  # where Ray's unhandled-error reports go
    ray_log.addHandler(handler)
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="failed after 0s"):
            get_all([fail.remote(0), fail.remote(1.0)], 30)
        time.sleep(2.0)  # the second error has arrived
        gc.collect()  # every reference the failed call left is freed
        time.sleep(1.0)
    finally:
        ray_log.removeHandler(handler)
    assert not [r for r in reports if "Unhandled error" in r], reports
