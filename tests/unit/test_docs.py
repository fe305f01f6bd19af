"""The README's configuration reference is generated from the config's field docs and cannot drift."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

from cluster import docs
from cluster.config import JobConfig, field_docs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "README.md")

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _readme() -> str:
    with open(README) as fh:
        return fh.read()


def test_readme_reference_is_what_field_docs_generates() -> None:
    block = docs.extract(_readme())
    assert block is not None, f"README.md lacks the {docs.START} ... {docs.END} block"
    assert block == docs.config_reference(), (
        "README.md's configuration reference is stale: run `python -m cluster docs-config --write README.md`"
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
    stale = _readme().replace("| `training.epochs` | `int` | `1` |", "| `training.epochs` | `int` | `7` |")
    assert stale != _readme()
    assert docs.extract(stale) != docs.config_reference()
    fixed = docs.replace(stale)
    assert fixed == _readme()
    with pytest.raises(ValueError, match="config-reference:start"):
        docs.replace("# a README without the markers\n")


def test_docs_config_command_prints_and_writes_the_block(tmp_path: pathlib.Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cluster", "docs-config"], cwd=REPO, capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == docs.config_reference()
    copy = tmp_path / "README.md"
    copy.write_text(_readme().replace("Number of DDP workers", "Number of workers, stale"))
    out = subprocess.run(
        [sys.executable, "-m", "cluster", "docs-config", "--write", str(copy)],
        cwd=REPO, capture_output=True, text=True, timeout=50,
    )
    assert out.returncode == 0, out.stderr
    assert copy.read_text() == _readme()
