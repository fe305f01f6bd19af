"""A run's record in storage: ``run.json``, ``events/*.jsonl``, Parquet metrics; the driver's progress line.

Metrics schema (``metrics/steps-*.parquet``, one file per epoch and attempt; read the folder with
``pyarrow.parquet.read_table(URL + "/metrics")``):

| column | type | meaning |
|---|---|---|
| kind | string | ``step`` (every ``training.log_every_steps``), ``epoch`` (one per epoch), ``eval`` |
| time | double | unix time the row was taken |
| global_step | int64 | optimizer steps done so far |
| epoch | int64 | epoch the row belongs to |
| step_in_epoch | int64 | steps done within that epoch |
| loss | double | step: rank 0's loss on its shard; epoch: mean over all ranks and steps; eval: eval set's |
| lr | double | learning rate of the first parameter group |
| grad_norm | double | step: global gradient L2 norm, before ``training.grad_clip``; else null |
| peak_mem_gib | double | step: rank 0's peak memory (GPU: allocator's since the last row; CPU: RSS) |
| step_time_s | double | step: seconds of that step; epoch: mean seconds per step; eval: seconds it took |
| input_wait_s | double | step: seconds rank 0 waited for its batches in that step (input pipeline) |
| samples_per_s | double | global samples per second (eval: eval samples per second) |
| checkpoint_stall_s | double | seconds training was blocked by a checkpoint at that step (0 if none) |
| world_size | int64 | workers in the group |
| attempt | int64 | 0 for the first start, +1 per recovery or resize |
| eval_samples | int64 | eval: samples evaluated; else null |
| m_<name> | double | a ``Task.compute_loss`` extra metric: step: rank 0's value; epoch: its mean; eval: the
  ``Task.compute_eval`` metric's mean over the eval set; else null |
"""

from __future__ import annotations

import array
import itertools
import json
import logging
import re
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.parquet as pq

from cluster.run.storage import Storage

logger = logging.getLogger(__name__)

SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("time", pa.float64()),
        ("global_step", pa.int64()),
        ("epoch", pa.int64()),
        ("step_in_epoch", pa.int64()),
        ("loss", pa.float64()),
        ("lr", pa.float64()),
        ("grad_norm", pa.float64()),
        ("peak_mem_gib", pa.float64()),
        ("step_time_s", pa.float64()),
        ("input_wait_s", pa.float64()),
        ("samples_per_s", pa.float64()),
        ("checkpoint_stall_s", pa.float64()),
        ("world_size", pa.int64()),
        ("attempt", pa.int64()),
        ("eval_samples", pa.int64()),
    ]
)


EXTRA_PREFIX = "m_"
"""Columns for the extra metrics of ``Task.compute_loss``: ``m_<name>``."""


def schema_for(rows: list[dict[str, Any]]) -> pa.Schema:
    """SCHEMA plus one float64 column per extra metric found in ``rows`` (sorted by name)."""
    extra = sorted({k for row in rows for k in row if k.startswith(EXTRA_PREFIX)})
    return pa.schema([*SCHEMA, *((name, pa.float64()) for name in extra)])


EVENTS_DIR = "events"
LEGACY_EVENTS = "events.jsonl"
"""The single event file of runs written before segments; still read (first), never written."""
SEGMENT_EVENTS = 256
"""Events per segment: an append rewrites at most this many lines, whatever the run's length."""
SEGMENT_S = 600.0
"""A segment older than this is closed at the next append, so a long quiet run's open segment stays small."""


def segment_names(storage: Storage) -> list[str]:
    """``events/NNNNNN.jsonl`` names in order (zero-padded: lexical order is numeric order)."""
    return [n for n in storage.listdir(EVENTS_DIR) if n.endswith(".jsonl") and n[: -len(".jsonl")].isdigit()]


def read_event_log(storage: Storage) -> list[dict[str, Any]]:
    """Every event of a run, oldest first: the legacy ``events.jsonl`` if any, then each segment. A torn
    line (a writer died mid-write of a non-atomic store) is skipped."""
    texts = []
    try:
        texts.append(storage.read_bytes(LEGACY_EVENTS).decode())
    except FileNotFoundError:
        pass
    for name in segment_names(storage):
        try:
            texts.append(storage.read_bytes(f"{EVENTS_DIR}/{name}").decode())
        except FileNotFoundError:  # removed between the listing and the read
            continue
    out = []
    for line in itertools.chain.from_iterable(t.splitlines() for t in texts):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


class EventLog:
    """A run's events, one JSON object a line, in numbered segments ``events/000001.jsonl``, ...

    Object stores cannot append, so the open segment is rewritten whole on each append; a segment is
    closed after ``segment_events`` events or ``segment_s`` seconds and never written again, so an append
    costs O(1) bytes however long the run. Each driver (a new submission) starts a new segment. Read them
    as one stream with ``cat events/*.jsonl``, ``read_event_log`` or ``python -m cluster show``.
    """

    def __init__(
        self, storage: Storage, segment_events: int = SEGMENT_EVENTS, segment_s: float = SEGMENT_S
    ) -> None:
        self.storage = storage
        self.segment_events = segment_events
        self.segment_s = segment_s
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        """Called with every record after it is stored (the driver's tracking)."""
        self.fence: Callable[[], None] | None = None
        """Called before each write: raises when this writer may no longer write (``cluster.run.lease``)."""
        self._records = read_event_log(storage)
        names = segment_names(storage)
        self._seq = int(names[-1][: -len(".jsonl")]) if names else 0
        self._lines: list[str] = []
        self._opened_at = 0.0

    @property
    def segment(self) -> str:
        """The segment being written (relative to the run)."""
        return f"{EVENTS_DIR}/{self._seq:06d}.jsonl"

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, **fields}
        now = time.monotonic()
        if (
            not self._lines
            or len(self._lines) >= self.segment_events
            or now - self._opened_at > self.segment_s
        ):
            self._seq += 1
            self._lines = []
            self._opened_at = now
        self._lines.append(json.dumps(record, default=str))
        if self.fence is not None:
            self.fence()
        self.storage.write_atomic(self.segment, ("\n".join(self._lines) + "\n").encode())
        self._records.append(json.loads(self._lines[-1]))
        for listener in self.listeners:
            listener(record)
        return record

    @property
    def count(self) -> int:
        """Events stored so far (every submission's): a metrics file's ``seq``."""
        return len(self._records)

    def records(self) -> list[dict[str, Any]]:
        """Every event of the run so far, earlier submissions included, as stored (JSON round trip)."""
        return list(self._records)


def write_metrics(
    storage: Storage,
    rows: list[dict[str, Any]],
    epoch: int,
    attempt: int,
    seq: int | None = None,
    folder: str = "metrics",
    tag: str = "",
) -> str | None:
    """Write rows as one Parquet file under ``metrics/`` (atomically: a reader never sees half of it); return
    its relative path. ``seq``: how many events the run's log held when the rows were written, so that a
    reader orders rows and events without comparing clocks (:func:`cluster.inspect.runs.final_path`)."""
    if not rows:
        return None
    schema = schema_for(rows)
    table = pa.Table.from_arrays(
        [_column([row.get(f.name) for row in rows], f.type) for f in schema], schema=schema
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    at = f"-s{seq:09d}" if seq is not None else ""
    rel = f"{folder}/steps-e{epoch:05d}-a{attempt:03d}{at}-{tag}{int(time.time() * 1000)}.parquet"
    storage.write_atomic(rel, sink.getvalue().to_pybytes())
    return rel


COMMIT_ROWS = "metrics_at_commit"
"""Where rank 0 writes the step rows up to each checkpoint it commits, beside the commit (one Parquet file
per commit): the copy a run's final path falls back on for steps whose rows the driver never wrote (it was
killed between its last flush and the commit). Not under ``metrics/``: a reader of that folder sees each row
once."""


def write_commit_rows(
    storage: Storage, rows: list[dict[str, Any]], step: int, epoch: int, attempt: int, seq: int
) -> str | None:
    """Rank 0's step rows up to the checkpoint at ``step``, under :data:`COMMIT_ROWS` (``seq``: the event
    count when the driver started the group, see :func:`write_metrics`)."""
    return write_metrics(
        storage,
        [{"kind": "step", **r} for r in rows],
        epoch,
        attempt,
        seq,
        folder=COMMIT_ROWS,
        tag=f"c{step}",
    )


def _column(values: list[Any], typ: pa.DataType) -> pa.Array:
    """One column built from its buffers. ``pa.array`` and ``Table.from_pylist`` import pandas on first use
    (to ask whether the values are a pandas object), a noticeable burst of CPU in the driver at the first
    epoch's end, taken from the workers while they train the next epoch."""
    n = len(values)
    valid = [v is not None for v in values]
    bitmap = (
        None
        if all(valid)
        else pa.py_buffer(sum(1 << i for i, ok in enumerate(valid) if ok).to_bytes((n + 7) // 8, "little"))
    )
    if pa.types.is_string(typ):
        data = [b"" if v is None else str(v).encode() for v in values]
        offsets = array.array("i", itertools.accumulate((len(b) for b in data), initial=0))
        return pa.Array.from_buffers(typ, n, [bitmap, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))])
    code = {pa.float64(): "d", pa.int64(): "q"}[typ]  # the only other types SCHEMA uses
    return pa.Array.from_buffers(typ, n, [bitmap, pa.py_buffer(array.array(code, (v or 0 for v in values)))])


def read_parquet_bytes(data: bytes, columns: list[str] | None = None) -> pa.Table:
    """One Parquet file's bytes as a table, decoded on this thread. ``pq.read_table`` starts Arrow's thread
    pools, whose threads can still be alive at interpreter exit and abort a CLI command that already printed
    its output ("terminate called without an active exception", apache/arrow#34314). A missing column
    raises ``KeyError``, as ``read_table`` refuses such a file."""
    table = pq.ParquetFile(pa.BufferReader(data)).read(columns=columns, use_threads=False)
    missing = [c for c in columns or () if c not in table.column_names]
    if missing:
        raise KeyError(f"no column {missing[0]!r}")
    return table


def read_metric_parts(storage: Storage, folder: str = "metrics") -> list[tuple[int | None, pa.Table]]:
    """Each metrics file as ``(seq, table)`` (``seq``: see :func:`write_metrics`; None for files written by
    earlier versions). A torn or unreadable file is left out with a warning: the rest of the run reads."""
    parts: list[tuple[int | None, pa.Table]] = []
    for name in sorted(f for f in storage.listdir(folder) if f.endswith(".parquet")):
        try:
            table = read_parquet_bytes(storage.read_bytes(f"{folder}/{name}"))
        except (pa.ArrowException, OSError) as exc:
            logger.warning(
                "skipping %s: it does not read as Parquet (%s)", storage.url(f"{folder}/{name}"), exc
            )
            continue
        match = _SEQ_RE.search(name)
        parts.append((int(match.group(1)) if match else None, table))
    return parts


_SEQ_RE = re.compile(r"-s(\d{9})-")  # the tag after it may be c<step>


def read_metrics(storage: Storage) -> pa.Table:
    return concat_metrics([t for _, t in read_metric_parts(storage)])


def concat_metrics(tables: list[pa.Table]) -> pa.Table:
    """Metrics files as one table in time order. Files of different epochs or tasks may carry different
    extra-metric columns: missing ones are null."""
    if not tables:
        return SCHEMA.empty_table()
    return pa.concat_tables(tables, promote_options="default").sort_by("time")


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:d}:{s:02d}"


class ProgressDisplay:
    """The driver's display: a live bar on a terminal, plain lines in job logs."""

    def __init__(self, total_steps: int, out: TextIO | None = None) -> None:
        self.total_steps = total_steps
        self.out = out or sys.stdout
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self._t0 = time.monotonic()
        self._last_step = 0
        self._last_time = time.monotonic()
        self._rate = 0.0

    def live(
        self, step: int, samples_per_step: int, evaluating: int | None = None, eval_batches: int = 0
    ) -> None:
        """Refresh the live bar (terminal only) from a heartbeat's step count; ``evaluating``: eval batches
        done since the step last moved (an evaluation is running), of ``eval_batches`` when known."""
        now = time.monotonic()
        if step > self._last_step and now > self._last_time:
            rate = (step - self._last_step) / (now - self._last_time)
            self._rate = rate if not self._rate else 0.7 * self._rate + 0.3 * rate
            self._last_step, self._last_time = step, now
        if not self.tty:
            return
        frac = min(1.0, step / max(1, self.total_steps))
        bar = "#" * int(frac * 30)
        eta = (self.total_steps - step) / self._rate if self._rate else 0.0
        doing = (
            f"evaluating: {min(evaluating, eval_batches)}/{eval_batches} batches   "
            if evaluating and eval_batches
            else f"evaluating: {evaluating} eval batches done   "
            if evaluating
            else f"{self._rate * samples_per_step:,.0f} samples/s ETA {fmt_duration(eta)}   "
        )
        self.out.write(f"\r[{bar:<30}] step {step}/{self.total_steps} {doing}")
        self.out.flush()

    def epoch_line(
        self, epoch: int, epochs: int, step: int, loss: float, samples_per_s: float, eta_s: float
    ) -> None:
        if self.tty:
            self.out.write("\r" + " " * 100 + "\r")
        self.out.write(
            f"epoch {epoch + 1}/{epochs}  step {step}/{self.total_steps}  loss {loss:.4f}  "
            f"{samples_per_s:,.0f} samples/s  ETA {fmt_duration(eta_s)}\n"
        )
        self.out.flush()

    def line(self, text: str) -> None:
        if self.tty:
            self.out.write("\r" + " " * 100 + "\r")
        self.out.write(text + "\n")
        self.out.flush()
