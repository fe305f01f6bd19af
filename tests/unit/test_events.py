"""The event log as numbered append-only segments: O(1) bytes per append, one stream for every reader."""

from __future__ import annotations

import glob
import json
import pathlib
import subprocess

import pyarrow as pa
import pyarrow.json as pj
import pytest

from cluster.inspect import read_events
from cluster.run.logs import EventLog, read_event_log
from cluster.run.storage import Storage

pytestmark = pytest.mark.timeout(60)


class CountingStorage(Storage):
    """Storage that records the size of every write (the cost an object store charges)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.writes: list[int] = []

    def write_atomic(self, rel: str, data: bytes) -> None:
        self.writes.append(len(data))
        super().write_atomic(rel, data)


@pytest.mark.multiprocess  # starts a process
def test_append_costs_o1_bytes_and_every_reader_sees_one_stream(tmp_path: pathlib.Path) -> None:
    storage = CountingStorage(str(tmp_path / "run"))
    log = EventLog(storage, segment_events=50)
    for i in range(2000):
        log.append("epoch_end", epoch=i, loss=1.0 / (i + 1))
    # bytes per append bounded by one segment, whatever the length of the run: O(n) in total, not O(n^2)
    line = max(len(json.dumps(r)) + 1 for r in log.records())
    assert max(storage.writes) <= 50 * line
    assert sum(storage.writes) <= 2000 * 25.5 * line  # 25.5 lines rewritten per append on average
    files = sorted(glob.glob(str(tmp_path / "run" / "events" / "*.jsonl")))
    assert len(files) == 40 and pathlib.Path(files[0]).name == "000001.jsonl"

    records = log.records()
    assert [r["epoch"] for r in records] == list(range(2000))
    assert read_event_log(Storage(str(tmp_path / "run"))) == records == read_events(storage)
    # cat
    cat = subprocess.run(
        f"cat {tmp_path}/run/events/*.jsonl", shell=True, capture_output=True, text=True, check=True
    )
    assert [json.loads(line) for line in cat.stdout.splitlines()] == records
    # pyarrow, one table
    table = pa.concat_tables([pj.read_json(f) for f in files])
    assert table.column("epoch").to_pylist() == list(range(2000))


def test_a_new_writer_starts_a_new_segment_and_old_runs_still_read(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    legacy = [{"time": 1.0, "event": "run_start"}, {"time": 2.0, "event": "finished"}]
    (root / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in legacy))
    storage = Storage(str(root))
    first = EventLog(storage)
    assert first.records() == legacy
    first.append("run_start", attempt=0)
    first.append("finished")
    before = (root / "events" / "000001.jsonl").read_bytes()
    second = EventLog(storage)  # a resubmission
    assert [r["event"] for r in second.records()] == ["run_start", "finished"] * 2
    second.append("run_start", attempt=1)
    assert second.segment == "events/000002.jsonl"
    assert (root / "events" / "000001.jsonl").read_bytes() == before  # closed segments are never rewritten
    assert (root / "events.jsonl").read_text().count("\n") == 2  # the legacy file is only read
    assert [r["event"] for r in read_event_log(storage)] == ["run_start", "finished"] * 2 + ["run_start"]


def test_segments_close_by_age_and_a_torn_line_is_skipped(tmp_path: pathlib.Path) -> None:
    storage = Storage(str(tmp_path / "run"))
    log = EventLog(storage, segment_s=0.0)
    for i in range(3):
        log.append("tick", i=i)
    assert storage.listdir("events") == ["000001.jsonl", "000002.jsonl", "000003.jsonl"]
    with open(tmp_path / "run" / "events" / "000003.jsonl", "a") as fh:
        fh.write('{"event": "torn", "ti')  # a writer that died mid-line on a non-atomic store
    assert [r["i"] for r in read_event_log(storage)] == [0, 1, 2]


# --- the catalogue (cluster.core.events): every kind written is declared, with every field it carries
# ----------

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "cluster"


def written_kinds() -> dict[str, set[str]]:
    """Each event kind the package writes, with the keyword fields it passes: calls like
    ``<...events>.append("kind", ...)``, ``EventLog(...).append("kind", ...)``,
    ``<record>.event("kind", ...)`` and a tracking sink's ``note("kind", ...)`` (``**`` expansions are not
    seen)."""
    import ast

    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
                continue
            first, owner = node.args[0], ast.unparse(node.func.value)
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            attr = node.func.attr
            if (attr == "append" and ("events" in owner or "EventLog" in owner)) or attr in ("event", "note"):
                found.setdefault(first.value, set()).update(k.arg for k in node.keywords if k.arg)
    return found


def test_every_event_the_package_writes_is_declared_with_its_fields() -> None:
    from cluster.core.events import KINDS, line

    written = written_kinds()
    assert {"run_start", "failure", "recovered", "checkpoint", "finished", "rewound"} <= set(written)
    assert set(written) - set(KINDS) == set(), "declare these kinds in cluster/core/events.py"
    for kind, fields in written.items():
        assert fields - set(KINDS[kind].fields) == set(), (
            f"{kind}: declare these fields in cluster/core/events.py"
        )
    # the kinds written under a computed name (a move's record) are declared too
    assert {"preemption_move", "slow_rank_moved"} <= set(KINDS)
    for kind in KINDS.values():  # every kind reads as one line, even with none of its fields
        assert kind.when and kind.fields and "\n" not in line(kind.name, {"event": kind.name})


def test_an_unknown_kind_reads_as_its_fields() -> None:
    from cluster.core.events import detail, line

    record = {"time": 1.0, "event": "from_the_future", "a": 1, "b": None, "config": {"x": 1}}
    assert line("from_the_future", record) == "from_the_future a=1"
    assert detail(record) == "**from_the_future** a=1"
