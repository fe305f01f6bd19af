"""training.deterministic reaches a Ray worker's environment before torch initialises CUDA (``worker_env``
runs first in the actor), and a value the job sets itself is kept."""

from __future__ import annotations

import os

import pytest

from cluster.rank.process import worker_env
from cluster.spec.load import load_config

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["training.deterministic=true"], ":4096:8"),
        (["training.deterministic=true", "scaling.env={CUBLAS_WORKSPACE_CONFIG: ':16:8'}"], ":16:8"),
        (["training.deterministic=false"], None),
    ],
)
def test_deterministic_sets_the_cublas_workspace(
    monkeypatch: pytest.MonkeyPatch, overrides: list[str], expected: str | None
) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # worker_env sets it too: restore it afterwards
    with worker_env(load_config("jobs/configs/tiny_cpu.yaml", overrides)):
        assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == expected
