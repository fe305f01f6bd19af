"""The code fingerprint that refuses mixed code covers every cluster module the worker side imports: the
rank-side folders (``TRAINING_FOLDERS``, docs/layout.md), whatever files they hold."""

from __future__ import annotations

import ast
import os
import shutil
from pathlib import Path

import pytest

from cluster.worker_group import TRAINING_FOLDERS, code_fingerprint
from cluster.worker_group.actor import _sources, sources_digest

pytestmark = pytest.mark.timeout(30)

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "cluster")


def _module_file(module: str) -> str | None:
    """``cluster/x/y.py`` (or ``.../__init__.py``) of a dotted cluster module, relative to ``cluster/``."""
    rel = os.path.join(*module.split(".")[1:]) if "." in module else ""
    for path in (rel + ".py", os.path.join(rel, "__init__.py")):
        if os.path.isfile(os.path.join(PKG, path)):
            return path
    return None


def _imports(path: str) -> set[str]:
    """The cluster modules ``path`` imports anywhere (``from cluster.x import ...``, ``from cluster.x import
    module``, ``import cluster.x``), as files relative to ``cluster/``."""
    out = set()
    for node in ast.walk(ast.parse(open(os.path.join(PKG, path), encoding="utf-8").read())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cluster."):
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("cluster.")]
        out |= {f for f in map(_module_file, names) if f is not None}
    return out


def test_every_module_the_worker_side_imports_is_fingerprinted() -> None:
    covered = set(_sources(PKG))
    seen, todo = set(), ["worker_group/actor.py", "worker_group/ray_group.py", "rank/worker.py"]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(_imports(path))
    missing = seen - covered
    assert not missing, f"worker-side modules outside TRAINING_FOLDERS {TRAINING_FOLDERS}: {sorted(missing)}"
    assert "seam/peers.py" in seen and "run/checkpoint.py" in seen  # the scan itself works


def test_a_new_module_in_a_rank_side_folder_changes_the_fingerprint(tmp_path: Path) -> None:
    for folder in TRAINING_FOLDERS:
        assert any(p.startswith(folder + os.sep) for p in _sources(PKG)), folder
    copy = str(tmp_path / "cluster")
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert sources_digest(copy) == code_fingerprint()[1]
    for folder in TRAINING_FOLDERS:
        probe = os.path.join(copy, folder, "_fingerprint_probe.py")
        with open(probe, "w", encoding="utf-8") as fh:
            fh.write("# a module no hand list names\n")
        assert sources_digest(copy) != code_fingerprint()[1], folder
        os.remove(probe)
    with open(os.path.join(copy, "driver", "_fingerprint_probe.py"), "w", encoding="utf-8") as fh:
        fh.write("# the driver's code does not train\n")
    assert sources_digest(copy) == code_fingerprint()[1]


def test_the_driver_and_the_operator_tools_are_not_fingerprinted() -> None:
    sources = _sources(PKG)
    assert not [p for p in sources if p.split(os.sep)[0] in ("driver", "api", "inspect")]
    assert "__main__.py" not in sources
