"""A lean install: a job needs only the package; test, lint and tracking tools are extras."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import tomllib

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]  # starts processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEV_ONLY = ("pytest", "ruff", "mypy", "moto", "s3fs", "matplotlib", "mlflow", "tensorboard")


def test_the_run_command_installs_no_extra_and_base_deps_hold_no_dev_tool() -> None:
    readme = open(os.path.join(REPO, "README.md")).read()
    run = next(line for line in readme.splitlines() if "-m jobs.train" in line and "pip install" in line)
    assert re.search(r"pip install -e \.( |$)", run), run  # the package alone, no [dev]
    project = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]
    base = " ".join(project["dependencies"]).lower()
    assert not [tool for tool in DEV_ONLY if tool in base]
    extras = project["optional-dependencies"]
    assert {"s3", "gcs", "azure", "mlflow", "tensorboard", "plot", "dev"} <= set(extras)


def test_a_job_imports_no_dev_only_module() -> None:
    """Everything the job command, the driver and a worker import, in a fresh interpreter: none of the
    dev-only packages may be among them (else the lean install would fail at run time)."""
    code = (
        "import sys, jobs.train, cluster.driver.driver, cluster.rank.worker, cluster.worker_group, "
        "jobs.tasks.charlm, cluster.api.load, cluster.inspect; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({DEV_ONLY!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=100, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
