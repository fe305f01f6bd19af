"""The configuration reference (docs/config.md) is generated from the config's field docs and cannot drift;
the README's and docs/'s links, config keys, commands and metrics table stay true to the code."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from cluster.run.logs import SCHEMA
from cluster.spec import reference as docs
from cluster.spec.config import JobConfig
from cluster.spec.reference import field_docs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "README.md")
CONFIG_DOC = os.path.join(REPO, "docs", "config.md")

pytestmark = pytest.mark.timeout(60)


def _config_doc() -> str:
    with open(CONFIG_DOC) as fh:
        return fh.read()


def test_config_doc_is_what_field_docs_generates() -> None:
    block = docs.extract(_config_doc())
    assert block is not None, f"docs/config.md lacks the {docs.START} ... {docs.END} block"
    assert block == docs.config_reference(), (
        "docs/config.md is stale: run `python -m cluster docs-config --write docs/config.md`"
    )


def test_reference_has_one_documented_row_per_config_key() -> None:
    rows = [line for line in docs.config_reference().splitlines() if line.startswith("| `")]
    keys = [key for key, *_ in field_docs()]
    assert [r.split("`")[1] for r in rows] == keys
    assert {"scaling.socket_ifname", "failures.max_failures", "failures.inject", "storage.url"} <= set(keys)

    # Every leaf of JobConfig is there, and every row has a meaning.
    def leaves(cls: type, prefix: str = "") -> list[str]:
        out = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            if dataclasses.is_dataclass(default):
                out += leaves(type(default), f"{prefix}{f.name}.")
            else:
                out.append(prefix + f.name)
        return out

    assert sorted(leaves(JobConfig)) == sorted(keys)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 4 and cells[3], row
    # Types and defaults are written as a user types them in YAML.
    assert "| `scaling.min_workers` | `int \\| None` | `null` |" in docs.config_reference()
    assert "| `checkpoint.async_save` | `bool` | `true` |" in docs.config_reference()


def test_stale_reference_is_detected_and_rewritten() -> None:
    stale = _config_doc().replace(
        "| `training.epochs` | `int` | `1` |", "| `training.epochs` | `int` | `7` |"
    )
    assert stale != _config_doc()
    assert docs.extract(stale) != docs.config_reference()
    fixed = docs.replace(stale)
    assert fixed == _config_doc()
    with pytest.raises(ValueError, match="config-reference:start"):
        docs.replace("# a README without the markers\n")


@pytest.mark.multiprocess  # starts a process
def test_docs_config_command_prints_and_writes_the_block(tmp_path: pathlib.Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cluster", "docs-config"], cwd=REPO, capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == docs.config_reference()
    copy = tmp_path / "config.md"
    copy.write_text(_config_doc().replace("Number of DDP workers", "Number of workers, stale"))
    out = subprocess.run(
        [sys.executable, "-m", "cluster", "docs-config", "--write", str(copy)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 0, out.stderr
    assert copy.read_text() == _config_doc()


# --- README.md and docs/*.md: links, names and schema they quote ----------------------------------------

DOCS = os.path.join(REPO, "docs")
_FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)
_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s*\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", flags=re.M)
_CONFIG_KEY = re.compile(r"(?<![\w./-])((?:storage|scaling|training|checkpoint|failures)\.[a-z_]+)")
_PYTHON_M = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")


def _pages() -> list[str]:
    """README.md and every docs page."""
    return [README, *sorted(str(p) for p in pathlib.Path(DOCS).glob("*.md"))]


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def broken_links(text: str, base_dir: str) -> list[str]:
    """The relative link targets of markdown ``text`` (inline and reference links, outside code) that name no
    existing file or folder when resolved from ``base_dir``. URLs and same-page anchors are not checked."""
    prose = _CODE.sub("", _FENCE.sub("", text))
    targets = _LINK.findall(prose) + _REF_LINK.findall(prose)
    broken = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s)://, mailto:, ...; an anchor on the same page
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not os.path.exists(os.path.normpath(os.path.join(base_dir, path))):
            broken.append(target)
    return broken


def test_link_checker_finds_broken_links(tmp_path: pathlib.Path) -> None:
    (tmp_path / "there.md").write_text("x")
    text = (
        "[ok](there.md) [anchor](there.md#a) [web](https://example.com/x.md) [self](#top)\n"
        "[gone](missing.md) [up](../nowhere/README.md#x)\n[ref]: gone-too.md\n"
        "`[in code](ignored.md)`\n```\n[in a block](ignored-too.md)\n```\n"
    )
    assert broken_links(text, str(tmp_path)) == ["missing.md", "../nowhere/README.md#x", "gone-too.md"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: os.path.relpath(p, REPO))
def test_relative_links_point_at_existing_files(page: str) -> None:
    broken = broken_links(_read(page), os.path.dirname(page))
    assert broken == [], f"{os.path.relpath(page, REPO)} links to files that do not exist"


def test_readme_links_every_docs_page() -> None:
    readme = _read(README)
    pages = sorted(p.name for p in pathlib.Path(DOCS).glob("*.md"))
    assert pages, "docs/ has no pages"
    assert [p for p in pages if f"](docs/{p})" not in readme] == []


@pytest.mark.parametrize("page", _pages(), ids=lambda p: os.path.relpath(p, REPO))
def test_config_keys_and_modules_named_in_docs_exist(page: str) -> None:
    text = _read(page)
    keys = {key for key, *_ in field_docs()}
    named = {m for span in _CODE.findall(text) for m in _CONFIG_KEY.findall(span)}
    assert named - keys == set(), f"{os.path.relpath(page, REPO)} names config keys that do not exist"
    modules = set(_PYTHON_M.findall(text))
    missing = {m for m in modules if importlib.util.find_spec(m) is None}
    assert missing == set(), f"{os.path.relpath(page, REPO)} runs `python -m` on modules that do not exist"


_DOTTED = re.compile(r"(?<![\w.])cluster\.[A-Za-z_][\w.]*\w")


def _resolves(name: str) -> bool:
    """Whether ``cluster.a.b.c`` names a module, or an attribute of the longest module it starts with."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", _pages(), ids=lambda p: os.path.relpath(p, REPO))
def test_module_paths_named_in_docs_exist(page: str) -> None:
    named = {m for span in _CODE.findall(_read(page)) for m in _DOTTED.findall(span)}
    missing = sorted(m for m in named if not _resolves(m))
    assert missing == [], f"{os.path.relpath(page, REPO)} names modules or names that do not exist (moved?)"


def test_readme_test_command_is_what_ci_runs() -> None:
    with open(os.path.join(REPO, ".ci", "run")) as fh:
        lines = fh.read().splitlines()
    command = [line for line in lines if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert len(command) == 1, command
    assert f"```bash\n{command[0]}\n```" in _read(README)


def test_docs_metrics_table_matches_schema() -> None:
    text = _read(os.path.join(DOCS, "runs.md"))
    start = text.index("| kind | string |")
    block = text[start : text.index("\n\n", start)]
    rows = re.findall(r"^\| (\w+) \| (\w+) \|", block, flags=re.M)
    assert [(n, str(SCHEMA.field(n).type)) for n, _ in rows] == [(f.name, str(f.type)) for f in SCHEMA]
    assert "`m_<key>`" in text  # the extra metrics' columns are documented next to the fixed ones


# --- docs/events.md: generated from cluster.core.events
# -------------------------------------------------------

EVENTS_DOC = os.path.join(DOCS, "events.md")


def test_events_doc_is_what_the_catalogue_generates() -> None:
    block = docs.extract(_read(EVENTS_DOC), "events")
    assert block is not None, f"docs/events.md lacks the {docs.EVENTS_START} ... {docs.EVENTS_END} block"
    assert block == docs.events_reference(), (
        "docs/events.md is stale: run `python -m cluster docs-events --write docs/events.md`"
    )


@pytest.mark.multiprocess  # starts a process
def test_events_reference_has_one_row_per_kind_and_is_rewritten_when_stale(tmp_path: pathlib.Path) -> None:
    from cluster.core.events import KINDS

    rows = [line for line in docs.events_reference().splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == list(KINDS)
    assert all(len(r.strip("|").split(" | ")) == 4 for r in rows)
    stale = _read(EVENTS_DOC).replace("| `failure` |", "| `failure_renamed` |")
    assert docs.extract(stale, "events") != docs.events_reference()
    copy = tmp_path / "events.md"
    copy.write_text(stale)
    out = subprocess.run(
        [sys.executable, "-m", "cluster", "docs-events", "--write", str(copy)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 0, out.stderr
    assert copy.read_text() == _read(EVENTS_DOC)
    with pytest.raises(ValueError, match="events-reference:start"):
        docs.replace("# a page without the markers\n", "events")


@pytest.mark.multiprocess  # starts a process
def test_a_docs_rewrite_that_fails_mid_write_leaves_the_old_file_whole(tmp_path: pathlib.Path) -> None:
    """``docs-events --write`` under a file-size limit smaller than the page: the write fails, and the page
    is the old one, byte for byte, with no temporary file beside it (it was truncated in place before)."""
    stale = _read(EVENTS_DOC).replace("| `failure` |", "| `failure_renamed` |")
    copy = tmp_path / "events.md"
    copy.write_text(stale)
    limit_kib = len(stale.encode()) // 1024 // 2  # half the page
    command = f"ulimit -f {limit_kib}; exec {sys.executable} -m cluster docs-events --write {copy}"
    out = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=50)
    assert out.returncode != 0
    assert copy.read_text() == stale
    assert os.listdir(tmp_path) == ["events.md"]


def test_the_table_of_mistakes_in_troubleshooting_is_what_the_tests_table_prints() -> None:
    """docs/troubleshooting.md's table of mistakes is generated from tests/support/mistakes.py, each up-front
    row run for the message it prints now (tests/unit/test_mistakes.py checks each)."""
    with open(os.path.join(REPO, "docs", "troubleshooting.md")) as fh:
        block = docs.extract(fh.read(), "mistakes")
    assert block is not None, f"docs/troubleshooting.md lacks the {docs.MISTAKES_START} block"
    assert block == docs.mistakes_reference(), (
        "docs/troubleshooting.md is stale: "
        "run `python -m cluster docs-mistakes --write docs/troubleshooting.md`"
    )
