"""The code fingerprint that refuses mixed code covers every cluster module the worker side imports."""

from __future__ import annotations

import ast
import os

import pytest

pytestmark = pytest.mark.timeout(30)

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "cluster")


def _entry(module: str) -> str:
    """The ``_TRAINING_MODULES`` entry of a top-level cluster module: ``x.py``, or ``x/`` for a package."""
    return module + "/" if os.path.isdir(os.path.join(PKG, module)) else module + ".py"


def _files(name: str) -> list[str]:
    if not name.endswith("/"):
        return [os.path.join(PKG, name)]
    return [
        os.path.join(root, f)
        for root, _, fs in os.walk(os.path.join(PKG, name))
        for f in fs
        if f.endswith(".py")
    ]


def _imports(name: str) -> set[str]:
    """cluster modules ``name`` imports (``from cluster.x import ...``, ``from cluster import x``)."""
    out = set()
    for path in _files(name):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("cluster."):
                    out.add(_entry(node.module.split(".")[1]))
                elif node.module == "cluster":
                    out.update(
                        _entry(a.name)
                        for a in node.names
                        if os.path.exists(os.path.join(PKG, _entry(a.name)))
                    )
    return out


def test_every_module_the_worker_side_imports_is_fingerprinted() -> None:
    from cluster.worker_group import _TRAINING_MODULES

    seen, todo = set(), [_entry("worker_group"), _entry("worker")]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_imports(name))
    missing = seen - set(_TRAINING_MODULES)
    assert not missing, f"worker-side modules missing from _TRAINING_MODULES: {sorted(missing)}"
    assert "peer.py" in seen  # the scan itself works
