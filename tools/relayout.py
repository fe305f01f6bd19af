"""Move the flat ``cluster/`` package into its layers (docs/layout.md): ``git mv`` each module to its folder
and rewrite every mention of its old name, in code and in text.

    python tools/relayout.py            # from the repository root, on a clean checkout
    python tools/relayout.py --dry-run  # print what would move and which files would change

What it rewrites, in ``cluster/``, ``tests/``, ``jobs/``, ``benchmarks/``, ``docs/``, ``README.md``,
``tests/README.md`` and ``pyproject.toml``:

- dotted names: ``cluster.worker`` -> ``cluster.rank.worker`` wherever they stand (imports, ``mock.patch``
  and ``monkeypatch`` targets, logger names, docstrings, the lazy names of ``cluster/__init__.py``);
- ``from cluster import worker_recovery as recovery`` -> ``from cluster.rank import rejoin as recovery``
  (and the same from ``cluster.worker_group``);
- paths: ``cluster/worker.py`` -> ``cluster/rank/worker.py``, also inside longer paths and stack lines
  (``/app/cluster/worker.py``, ``(cluster/faults.py:12)``: a stack shows this package's files from
  ``cluster/`` on).

Only the modules whose old file is still there are moved and rewritten, so a second run changes nothing,
and the script can be run again on a newer ``main``. Everything it does is mechanical; the moves that end
the import circles are separate, hand-made commits after it (git log).
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import re
import subprocess
import sys
import textwrap
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# old module (dotted, below ``cluster.``) -> new module. Packages that stay where they are (``inspect``,
# ``worker_group``) keep their other modules.
MOVES: dict[str, str] = {
    # 1 core: the standard library only
    "errors": "core.errors",
    "redact": "core.redact",
    "stacks": "core.stacks",
    "events": "core.events",
    # 2 spec: the job's description
    "config": "spec.config",
    "validate": "spec.validate",
    "schedule": "spec.schedule",
    "task": "spec.task",
    "docs": "spec.reference",
    # 3 run: one run's folder in storage
    "storage": "run.storage",
    "metrics": "run.logs",
    "checkpoint": "run.checkpoint",
    "safe_state": "run.state_bytes",
    "lease": "run.lease",
    "goodput": "run.goodput",
    "quarantine": "run.quarantine",
    # 4 seam (driver <-> ranks), data, inspect
    "group": "seam.protocol",
    "preemption": "seam.preemption",
    "data": "data.pipeline",
    "parquet": "data.parquet",
    "plot": "inspect.plot",
    # 5 rank: one rank's training, no Ray
    "worker": "rank.worker",
    "session": "rank.session",
    "step": "rank.step",
    "train_state": "rank.train_state",
    "snapshots": "rank.rollback_points",
    "worker_recovery": "rank.rejoin",
    "worker_eval": "rank.evals",
    "evaluate": "rank.evaluate",
    "ddp": "rank.ddp",
    "dist": "rank.dist",
    "process": "rank.process",
    "pace": "rank.pace",
    "profiling": "rank.profiling",
    "faults": "rank.faults",
    "replica": "rank.replica",
    "peer": "rank.peer_transfer",
    # 5 driver: the run's state machine, no Ray
    "driver": "driver.driver",
    "states": "driver.states",
    "policy": "driver.policy",
    "moves": "driver.moves",
    "record": "driver.record",
    "control": "driver.control",
    "hang": "driver.hang",
    "recovery": "driver.recovery_plan",
    "tracking": "driver.tracking",
    "sinks": "driver.sinks",
    # 6 worker_group: the ranks on Ray
    "worker_group.group": "worker_group.ray_group",
    # 7 api: the entry points
    "api": "api.train",
    "submit": "api.submit",
    "load": "api.load",
    "export": "api.export",
    "rewind": "api.rewind",
    "dryrun": "api.dryrun",
    "local_ray": "api.local_ray",
}

PACKAGES: dict[str, str] = {
    "core": "Layer 1: what every layer uses (errors, redaction, stacks, the event kinds, URL checks); "
    "imports no other layer.",
    "spec": "Layer 2: the job's description (config dataclasses, their validation, schedules, the Task "
    "interface, the config reference); imports core.",
    "run": "Layer 3: one run's folder in storage (storage, metrics and events files, checkpoints, the "
    "lease, goodput, quarantine); imports core and spec.",
    "seam": "Layer 4: the seam between the driver and the ranks (the ``WorkerGroup`` protocol and the types "
    "it carries); imports core, spec and run.",
    "data": "Layer 4: the input pipeline (the resumable sampler, batches, Parquet); imports core, spec "
    "and run.",
    "rank": "Layer 5: one rank's training (the worker, its loop, recovery and evaluation); no Ray, and "
    "nothing of the driver.",
    "driver": "Layer 5: the run's state machine and its record; no Ray but through the worker group it is "
    "given, and nothing of the ranks.",
    "api": "Layer 7: the entry points (``train``, ``submit``, loading and exporting checkpoints, rewind, "
    "dry runs, the embedded Ray).",
}

# Names that are also public names of ``cluster`` (``cluster.submit(...)`` in prose is the function): their
# dotted form is rewritten only where it names the module (an import, a quoted string, an attribute).
PUBLIC_TOO = {"submit"}

SCOPE = ["cluster", "tests", "jobs", "benchmarks", "docs", "tools", "README.md", "pyproject.toml"]
TEXT_EXT = (".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".txt", ".cfg", ".ini")
SKIP = {
    "tools/relayout.py",  # this table
    "benchmarks/LOG.md",  # a log of past experiments: the code as it was then
    "benchmarks/RESULTS.md",
    "benchmarks/diag/start.py",  # reads cluster/local_ray.py as it was at an old git revision
}


def old_path(old: str) -> str:
    return os.path.join("cluster", *old.split(".")) + ".py"


def new_path(new: str) -> str:
    return os.path.join("cluster", *new.split(".")) + ".py"


def pending(root: str) -> dict[str, str]:
    """The moves whose old file is still there."""
    return {o: n for o, n in MOVES.items() if os.path.isfile(os.path.join(root, old_path(o)))}


def files(root: str) -> list[str]:
    out = []
    for top in SCOPE:
        path = os.path.join(root, top)
        if os.path.isfile(path):
            out.append(top)
            continue
        for r, dirs, fs in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", ".venv", "results"))
            for f in sorted(fs):
                rel = os.path.relpath(os.path.join(r, f), root)
                if f.endswith(TEXT_EXT) and rel not in SKIP:
                    out.append(rel)
    return out


def dotted_pattern(todo: dict[str, str]) -> re.Pattern[str]:
    names = sorted(todo, key=len, reverse=True)  # worker_group.group before group, worker_eval before worker
    alts = "|".join(re.escape(n) for n in names)
    return re.compile(rf"(?<![\w.])cluster\.({alts})(?!\w)")


def path_pattern(todo: dict[str, str]) -> re.Pattern[str]:
    names = sorted((n.replace(".", "/") for n in todo), key=len, reverse=True)
    alts = "|".join(re.escape(n) for n in names)
    return re.compile(rf"(?<![\w.-])cluster/({alts})\.py(?!\w)")


def rewrite_text(text: str, todo: dict[str, str]) -> str:
    def dotted(m: re.Match[str]) -> str:
        old = m.group(1)
        if old in PUBLIC_TOO:
            after = text[m.end() : m.end() + 8]
            before = text[max(0, m.start() - 7) : m.start()]
            module_like = after.startswith((".", " import", '"', "'")) or before.endswith(
                ("import ", "from ")
            )
            if not module_like:
                return m.group(0)
        return "cluster." + todo[old]

    text = dotted_pattern(todo).sub(dotted, text)
    text = path_pattern(todo).sub(lambda m: new_path(todo[m.group(1).replace("/", ".")]), text)

    # os.path.join(root, "cluster", "worker.py")
    def joined(m: re.Match[str]) -> str:
        if m.group(1) not in todo:
            return m.group(0)
        *folders, leaf = ["cluster", *todo[m.group(1)].split(".")]
        return ", ".join(f'"{p}"' for p in [*folders, leaf + ".py"])

    return re.sub(r'"cluster", "(\w+)\.py"', joined, text)


def rewrite_from_imports(text: str, todo: dict[str, str]) -> str:
    """``from cluster import a, b as c`` where ``a`` is a moved module -> one import per new package."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
            continue
        if node.module != "cluster" and not node.module.startswith("cluster."):
            continue
        base = node.module[len("cluster.") :] if node.module != "cluster" else ""
        moved = [
            a
            for a in node.names
            # ``from cluster import submit`` is the public function, not the module
            if (f"{base}.{a.name}" if base else a.name) in todo and (base or a.name not in PUBLIC_TOO)
        ]
        if not moved:
            continue
        kept = [a for a in node.names if a not in moved]
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        out = []
        if kept:
            names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in kept)
            out.append(f"{indent}from {node.module} import {names}\n")
        for a in moved:
            new = todo[f"{base}.{a.name}" if base else a.name]
            package, _, leaf = ("cluster." + new).rpartition(".")
            alias = a.asname or a.name
            out.append(
                f"{indent}from {package} import {leaf}" + (f" as {alias}" if alias != leaf else "") + "\n"
            )
        edits.append((node.lineno, node.end_lineno or node.lineno, out))
    for start, end, out in sorted(edits, reverse=True):
        lines[start - 1 : end] = out
    return "".join(lines)


LIMIT = 110  # pyproject's ruff line-length


def _prose_lines(text: str) -> dict[int, tuple[str, int, int]]:
    """Line index -> ("comment", 0, 0) for a line that is a comment alone, or ("doc", first, last) for a
    line inside a triple-quoted string spanning lines first..last (0-based)."""
    out: dict[int, tuple[str, int, int]] = {}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return out
    lines = text.splitlines()
    for tok in tokens:
        (r0, c0), (r1, _) = tok.start, tok.end
        if tok.type == tokenize.COMMENT and not lines[r0 - 1][:c0].strip():
            out[r0 - 1] = ("comment", 0, 0)
        elif tok.type == tokenize.COMMENT and len(lines[r0 - 1][:c0].rstrip()) <= LIMIT:
            out[r0 - 1] = ("trailing", c0, 0)
        elif tok.type == tokenize.STRING and re.match(r"^[rRbBuUfF]*(\"\"\"|\'\'\')", tok.string):
            if r1 == r0 and lines[r0 - 1][:c0].strip():
                continue  # a short string inside code
            for r in range(r0, r1 + 1):
                out[r - 1] = ("doc", r0 - 1, r1 - 1)
    return out


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def reflow(text: str, dirty: set[int]) -> str:
    """Rewrap the comment and docstring lines in ``dirty`` (indices) that the new names made longer than
    ``LIMIT``: the words past it go to the start of the next line of the same paragraph, or a new line.
    Code lines are left for ruff to name."""
    lines = text.split("\n")
    while True:
        prose = _prose_lines("\n".join(lines))
        todo = sorted(i for i in dirty if i < len(lines) and len(lines[i]) > LIMIT and i in prose)
        if not todo:
            return "\n".join(lines)
        i = todo[0]
        line = lines[i]
        kind, first, _ = prose[i]
        if kind == "trailing":  # code, then a comment: the comment goes on a line of its own above
            lines[i : i + 1] = [_indent(line) + line[first:], line[:first].rstrip()]
            dirty = {d + 1 if d > i else d for d in dirty} | {i}
            continue
        dashes = re.match(r"^(.*\S)( ?-{4,})$", line)
        if kind == "comment" and dashes and len(dashes.group(1)) + 5 <= LIMIT:
            lines[i] = dashes.group(1) + " " + "-" * (LIMIT - len(dashes.group(1)) - 1)
            dirty.discard(i)
            continue
        cut = line.rfind(" ", len(_indent(line)) + 1, LIMIT + 1)
        if cut < 0:
            dirty.discard(i)
            continue
        head, words = line[:cut].rstrip(), line[cut + 1 :]
        lines[i] = head
        prefix = "# " if kind == "comment" else ""
        indent = _indent(line)
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        same = (
            i + 1 in prose
            and prose[i + 1][0] == kind
            and (kind == "comment" or prose[i + 1][1] == first)
            and nxt.strip()
            and nxt.strip() not in ('"""', "'''")
            and not re.match(r"^\s*(#\s*)?([-*] |\d+\. |:|>>>)", nxt)
            and len(_indent(nxt)) >= len(_indent(line))
            and (kind != "comment" or nxt.lstrip().startswith("# "))
        )
        if same:
            body = nxt.lstrip()[len(prefix) :] if kind == "comment" else nxt.lstrip()
            lines[i + 1] = _indent(nxt) + prefix + words + " " + body
            dirty.add(i + 1)
        else:
            lines.insert(i + 1, indent + prefix + words)
            dirty = {d + 1 if d > i else d for d in dirty} | {i + 1}
        dirty.discard(i)


def package_init(name: str) -> str:
    doc = textwrap.fill('"""' + PACKAGES[name], LIMIT)
    return doc + '\n\nThe layers and what each folder holds: docs/layout.md."""\n'


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    os.chdir(ROOT)
    todo = pending(ROOT)
    if not todo:
        print("nothing to move: every module is in its layer already")
        return 0
    changed = []
    for rel in files(ROOT):
        with open(rel, encoding="utf-8") as fh:
            text = fh.read()
        new = rewrite_text(text, todo)
        if rel.endswith(".py"):
            before, after = text.split("\n"), new.split("\n")  # the same lines: names change within them
            made_long = {i for i, (a, b) in enumerate(zip(before, after)) if len(b) > LIMIT >= len(a)}
            new = rewrite_from_imports(reflow(new, made_long), todo)
        if new != text:
            changed.append(rel)
            if not args.dry_run:
                with open(rel, "w", encoding="utf-8") as fh:
                    fh.write(new)
    for old, new in sorted(todo.items()):
        print(f"git mv {old_path(old)} {new_path(new)}")
    print(f"{len(changed)} files rewritten")
    if args.dry_run:
        print("\n".join(changed))
        return 0
    with open(".gitignore", encoding="utf-8") as fh:
        ignored = fh.read()
    if "data/" in ignored.splitlines() and "!cluster/data/" not in ignored:  # the data/ ignored is a dataset
        with open(".gitignore", "a", encoding="utf-8") as fh:
            fh.write("!cluster/data/\n")
    for name in PACKAGES:
        init = os.path.join("cluster", name, "__init__.py")
        if not os.path.exists(init):
            os.makedirs(os.path.dirname(init), exist_ok=True)
            with open(init, "w", encoding="utf-8") as fh:
                fh.write(package_init(name))
            subprocess.run(["git", "add", init], check=True)
    for old, new in sorted(todo.items()):
        subprocess.run(["git", "mv", old_path(old), new_path(new)], check=True)
    moved_to = {old_path(o): new_path(n) for o, n in todo.items()}
    py = [moved_to.get(p, p) for p in changed if p.endswith(".py")]
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    if py and os.path.exists(ruff):
        subprocess.run([ruff, "check", "--quiet", "--select", "I", "--fix", *py], check=False)
        subprocess.run([ruff, "format", "--quiet", *py], check=False)
    subprocess.run(["git", "add", "-u"], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
