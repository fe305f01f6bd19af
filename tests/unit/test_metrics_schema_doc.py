"""The README's metrics table lists exactly the columns the Parquet files have."""

from __future__ import annotations

import os
import re

import pytest

from cluster.metrics import SCHEMA

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_readme_metrics_table_matches_schema() -> None:
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    start = readme.index("| kind | string |")
    block = readme[start : readme.index("\n\n", start)]
    rows = re.findall(r"^\| (\w+) \| (\w+) \|", block, flags=re.M)
    assert [(n, str(SCHEMA.field(n).type)) for n, _ in rows] == [(f.name, str(f.type)) for f in SCHEMA]
    assert [t for _, t in rows] == [str(f.type) for f in SCHEMA]
