"""The code fingerprint that refuses mixed code covers every cluster module the worker side imports."""

from __future__ import annotations

import ast
import os

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "cluster")


def _imports(name: str) -> set[str]:
    """cluster modules ``name`` imports (``from cluster.x import ...``, ``from cluster import x``)."""
    tree = ast.parse(open(os.path.join(PKG, name)).read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("cluster."):
                out.add(node.module.split(".")[1] + ".py")
            elif node.module == "cluster":
                out.update(
                    a.name + ".py" for a in node.names if os.path.exists(os.path.join(PKG, a.name + ".py"))
                )
    return out


def test_every_module_the_worker_side_imports_is_fingerprinted() -> None:
    from cluster.worker_group import _TRAINING_MODULES

    seen, todo = set(), ["worker_group.py", "worker.py"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_imports(name))
    missing = seen - set(_TRAINING_MODULES)
    assert not missing, f"worker-side modules missing from _TRAINING_MODULES: {sorted(missing)}"
    assert "peer.py" in seen  # the scan itself works
