"""The package's shape (docs/layout.md): no import circle between its modules, counting the imports inside
functions and under ``TYPE_CHECKING`` (the layers themselves are ``lint-imports``' contract in
pyproject.toml), and no class or function past the size where it should be split by concern."""

from __future__ import annotations

import ast
import os

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "cluster")

MAX_CLASS_LINES = 600
MAX_FUNCTION_LINES = 100


def _modules() -> dict[str, str]:
    """Dotted name -> path of every module of the package (a package by its ``__init__.py``)."""
    out = {}
    for root, dirs, files in os.walk(PKG):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                name = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _imported(module: str, source: str, is_package: bool, modules: dict[str, str]) -> set[str]:
    """The package's modules ``module`` imports anywhere in ``source``: at the top, in functions, under
    ``TYPE_CHECKING``. ``from a import b`` counts as importing ``a.b`` when that is a module, else ``a``."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                if not is_package:
                    parts = parts[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        out |= {m for m in map(known, names) if m is not None and m != module}
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        m: _imported(m, open(p, encoding="utf-8").read(), p.endswith("__init__.py"), modules)
        for m, p in modules.items()
    }


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = _graph()
    assert graph.get("cluster.driver.driver")  # the scan itself works
    assert _circles(graph) == []


def test_the_circle_check_sees_function_level_type_checking_and_relative_imports() -> None:
    modules = {"p": "p/__init__.py", "p.a": "p/a.py", "p.b": "p/b.py", "p.c": "p/c.py"}
    source = {
        "p": "",
        "p.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import X\n",
        "p.b": "def f():\n    from p import a\n",
        "p.c": "from . import a\nfrom .b import f\n",
    }
    graph = {m: _imported(m, source[m], m == "p", modules) for m in modules}
    assert graph["p.c"] == {"p.a", "p.b"}
    assert _circles(graph) == [["p.a", "p.b"]]


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """(class -> lines, function -> lines) of every class and function of the package, by dotted name."""
    classes: dict[str, int] = {}
    functions: dict[str, int] = {}
    for module, path in _modules().items():
        tree = ast.parse(open(path, encoding="utf-8").read())

        def walk(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}.{child.name}"
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    (classes if isinstance(child, ast.ClassDef) else functions)[name] = lines
                    walk(child, name)

        walk(tree, module)
    return classes, functions


def test_no_function_is_over_100_lines() -> None:
    _, functions = _sizes()
    long = {name: n for name, n in functions.items() if n > MAX_FUNCTION_LINES}
    assert long == {}, f"split these by concern: {long}"


def test_no_class_is_over_600_lines() -> None:
    classes, _ = _sizes()
    large = {name: n for name, n in classes.items() if n > MAX_CLASS_LINES}
    assert large == {}


def test_the_public_driver_keeps_ray_s_worker_group_as_its_default(tmp_path: object) -> None:
    """``cluster.Driver(cfg)`` works as before the layers: the driver package knows no Ray, so the public
    name (``cluster.api.driver``) supplies Ray's worker group when no factory is given."""
    import cluster
    from cluster.api.train import ray_group_factory
    from cluster.driver.driver import Driver as CoreDriver
    from tests.support.fakes import ScriptedGroup

    cfg = cluster.load_config("jobs/configs/tiny_cpu.yaml", [f"storage={tmp_path}/runs"])
    driver = cluster.Driver(cfg)
    assert isinstance(driver, CoreDriver) and driver.group_factory is ray_group_factory
    assert cluster.Driver(cfg, ScriptedGroup).group_factory is ScriptedGroup
