"""Reading runs back from storage: finding them, their events, status, checkpoints and metrics.

Everything here reads the public contract of a run folder (``run.json``, ``events/``, ``metrics/``,
``checkpoints/``) through :class:`~cluster.run.storage.Storage`, so it works on any fsspec URL, while the run
is going or long after. A run is any folder directly under the storage URL that holds a ``run.json``.
"""

from __future__ import annotations

import bisect
import json
import logging
from dataclasses import dataclass
from typing import Any

from cluster.core.errors import CheckpointError, ClusterError, StorageError
from cluster.core.urls import join, normalize_url
from cluster.run.checkpoint import CheckpointInfo, CheckpointStore, best_of, score_of
from cluster.run.lease import current as current_lease
from cluster.run.lease import gone_here
from cluster.run.logs import COMMIT_ROWS, concat_metrics, read_event_log, read_metric_parts
from cluster.run.requests import DRIVER_GONE_S, driver_seen
from cluster.run.storage import Storage

logger = logging.getLogger(__name__)

FINISHED, FAILED, UNFINISHED = "finished", "failed", "running/interrupted"
RUNNING, INTERRUPTED = "running", "interrupted"
"""Unfinished, told apart by the driver's ``driver.json`` (``cluster.driver.control.DriverBeat``): written
within ``DRIVER_GONE_S``, or not; and ``interrupted`` at once when the run's lease names a driver on this
machine whose process is gone. Runs from before both stay ``running/interrupted``."""
STOPPED = "stopped"
"""Stopped on request (Ctrl-C, ``ray job stop``, ``python -m cluster stop``) with a checkpoint: resumable."""


class InspectError(ClusterError):
    """A URL holds no runs, or no run of the given name. The message lists what is there."""


@dataclass(frozen=True)
class RunSummary:
    """One line of ``list``: the run's state as its events and checkpoints record it."""

    name: str
    url: str
    status: str
    epochs_done: int
    epochs_total: int | None
    global_step: int
    latest_checkpoint: int | None
    """Highest verified checkpoint step (or highest committed one when not verifying)."""
    last_loss: float | None
    attempts: int
    """Worker groups started or tried, over every submission of the run."""
    failures: int
    submissions: int


@dataclass(frozen=True)
class CheckpointRow:
    step: int
    epoch: int | None
    """The manifest's epoch: the (0-based) epoch a resume from it starts in."""
    step_in_epoch: int | None
    bytes: int
    files: int
    verified: bool | None
    """True/False once checked; None when not checked (only the latest is checked unless ``--verify``)."""
    problem: str | None = None
    score: str | None = None
    """``metric=value`` of the evaluation it was scored by (``checkpoint.best_metric``), if any."""
    best: bool = False
    """The best-scored checkpoint: kept whatever ``keep_last`` says, loaded by ``step="best"``."""


# ---------------------------------------------------------------------- finding runs
def run_names(root: Storage) -> list[str]:
    """Names of the runs directly under ``root``: folders that hold a ``run.json``."""
    return [name for name in root.listdir() if root.exists(f"{name}/run.json")]


def _open(url: str, options: dict[str, Any] | None) -> Storage:
    """Storage at ``url``: the one place the read paths of ``inspect`` open it from a URL (a storage root
    or one run's folder)."""
    return Storage(url, options)


def _checkpoints(storage: Storage) -> CheckpointStore:
    """The checkpoints of the run in ``storage``: the one place ``inspect`` makes a checkpoint store. Its
    readers are handed a run's storage (the CLI's, a test's), not a run folder, and only list and verify:
    no fence, no ``last_*`` report and no retention, so a store of their own reads what a shared one would."""
    return CheckpointStore(storage)


def open_run(url: str, name: str | None = None, options: dict[str, Any] | None = None) -> Storage:
    """The storage of one run, from ``URL NAME`` or ``URL/NAME``; InspectError naming the runs there if
    none."""
    if name is not None:
        root_url, run = normalize_url(url), name
    else:
        direct = _open(url, options)
        if direct.exists("run.json"):
            return direct
        names = run_names(direct)
        if names:
            raise InspectError(
                f"{direct.root} is a storage URL with {len(names)} run(s) ({', '.join(names)}), not a run; "
                f"name one: show {direct.root} NAME"
            )
        root_url, _, run = direct.root.rpartition("/")
        if not root_url or root_url.endswith(":/") or not run:
            raise InspectError(f"no run at {direct.root} (no run.json there)")
    root = _open(root_url, options)
    storage = _open(join(root.root, run), options)
    if storage.exists("run.json"):
        return storage
    names = run_names(root)
    if not names:
        raise InspectError(f"no run named {run!r}: no runs at all under {root.root}")
    raise InspectError(f"no run named {run!r} under {root.root}; runs there: {', '.join(names)}")


# ---------------------------------------------------------------------- reading one run
def read_events(storage: Storage) -> list[dict[str, Any]]:
    """The run's events as dicts, oldest first (segments ``events/*.jsonl`` after a legacy ``events.jsonl``);
    a torn line (a writer died mid-write) is ignored."""
    return read_event_log(storage)


def final_path(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metric rows of the path the run took, in step order: a row is left out when the run later went
    back past its step (a group started from an earlier step: a recovery that replayed it, a NaN rollback
    that abandoned it; or a ``rewound`` run), so that each step's row of each kind appears once, as the
    weights that were kept saw it.

    "Later" is read without clocks where the rows say where they were written (``_seq``: how many events the
    log held then, see ``cluster.run.logs.write_metrics``): a rank's clock behind the driver's drops nothing.
    Rows of earlier versions, without it, are placed by their time.

    Rows marked ``_copy`` (the ones rank 0 wrote beside its commits, ``cluster.run.logs.COMMIT_ROWS``) fill
    only the steps no other row of their kind covers: a driver killed before it wrote them."""
    if rows and all(isinstance(r.get("_seq"), int) for r in rows):
        return _fill_from_copies(_final_by_seq(rows, events))
    return _fill_from_copies(_final_by_time(rows, events))


def _fill_from_copies(kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (kind, step) once: the driver's row where it wrote one, else the first copy."""
    have = {(r["kind"], r["global_step"]) for r in kept if not r.get("_copy")}
    out = []
    for r in kept:
        key = (r["kind"], r["global_step"])
        if r.get("_copy"):
            if key in have:
                continue
            have.add(key)
        out.append(r)
    return out


def _final_by_time(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`final_path` by the rows' times (rows of versions that did not write ``_seq``)."""
    backs = sorted(
        (float(e["time"]), int(e["resume_step"] if e.get("event") == "group_started" else e["to_step"]))
        for e in events
        if (e.get("event") == "group_started" and isinstance(e.get("resume_step"), int))
        or (e.get("event") == "rewound" and isinstance(e.get("to_step"), int))
    )
    # the lowest step the run went back to after each time: one pass from the newest
    later_min: list[float] = [float("inf")] * (len(backs) + 1)
    for i in range(len(backs) - 1, -1, -1):
        later_min[i] = min(later_min[i + 1], backs[i][1])
    times = [t for t, _ in backs]
    kept = [r for r in rows if r["global_step"] <= later_min[bisect.bisect_right(times, float(r["time"]))]]
    return sorted(kept, key=lambda r: (r["global_step"], r["time"]))


def _back_step(e: dict[str, Any]) -> int | None:
    """The step a ``group_started`` or ``rewound`` event went back to, or None."""
    if e.get("event") == "group_started" and isinstance(e.get("resume_step"), int):
        return int(e["resume_step"])
    if e.get("event") == "rewound" and isinstance(e.get("to_step"), int):
        return int(e["to_step"])
    return None


def _final_by_seq(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`final_path` by the event count each row's file was written at."""
    later_min = [float("inf")] * (len(events) + 1)  # the lowest step gone back to at event index >= i
    for i in range(len(events) - 1, -1, -1):
        back = _back_step(events[i])
        later_min[i] = min(later_min[i + 1], back if back is not None else float("inf"))
    kept = [r for r in rows if r["global_step"] <= later_min[min(int(r["_seq"]), len(events))]]
    return sorted(kept, key=lambda r: (r["global_step"], r["time"]))


def run_metrics(run_url: str, storage_options: dict[str, Any] | None = None, final: bool = True) -> Any:
    """The run's metrics as a ``pyarrow.Table`` (columns: docs/runs.md): with ``final``, only the rows of
    the path the run took (:func:`final_path`: no replayed, rolled-back or rewound rows), in step order;
    else every row written."""
    storage = _open(run_url, storage_options)
    parts = read_metric_parts(storage)
    table = concat_metrics([t for _, t in parts])
    if not final:
        return table
    import pyarrow as pa

    copies = read_metric_parts(storage, COMMIT_ROWS)
    rows = [{**r, "_seq": seq} for seq, part in parts for r in part.to_pylist()]
    rows += [{**r, "_seq": seq, "_copy": True} for seq, part in copies for r in part.to_pylist()]
    if copies:
        table = concat_metrics([table, *(t for _, t in copies)])  # the schema of both
    kept = [
        {k: v for k, v in r.items() if k not in ("_seq", "_copy")}
        for r in final_path(rows, read_events(storage))
    ]
    return pa.Table.from_pylist(kept, schema=table.schema)


def read_run_json(storage: Storage) -> dict[str, Any]:
    try:
        data = json.loads(storage.read_bytes("run.json"))
    except (ValueError, UnicodeDecodeError):
        raise InspectError(f"{storage.url('run.json')} is not valid JSON") from None
    return data if isinstance(data, dict) else {}


def run_status(events: list[dict[str, Any]]) -> str:
    """finished / failed / stopped from the terminal event after the last ``run_start``; otherwise the run is
    still going or its driver died (storage cannot tell those apart)."""
    starts = [i for i, e in enumerate(events) if e.get("event") == "run_start"]
    tail = events[starts[-1] :] if starts else events
    for e in reversed(tail):
        kind = e.get("event")
        if kind in ("finished", "already_complete"):
            return FINISHED
        if kind in ("run_failed", "failed"):
            return FAILED
        if kind == "stopped":
            return STOPPED
    return UNFINISHED


def live_status(storage: Storage, events: list[dict[str, Any]]) -> str:
    """``run_status``, with an unfinished run told ``running`` or ``interrupted`` by its driver's beat, and at
    once ``interrupted`` when the driver holding the run's lease ran on this machine and its process is gone
    (``cluster.run.lease.gone_here``: a SIGKILLed driver's driver.json still looks fresh for a while)."""
    status = run_status(events)
    if status != UNFINISHED:
        return status
    seen = driver_seen(storage)
    if seen is not None and (seen.get("ended") or seen["age_s"] >= DRIVER_GONE_S):
        return INTERRUPTED
    if driver_gone_here(storage):
        return INTERRUPTED
    return UNFINISHED if seen is None else RUNNING


def driver_gone_here(storage: Storage) -> bool:
    """Whether the job holding the run's lease (its driver) ran on this machine and its process is gone;
    False when that is not certain (another machine, a lease that cannot be read)."""
    try:
        holder = current_lease(storage)
    except StorageError as exc:
        logger.warning(
            "could not read the lease of %s, status judged by driver.json alone: %s", storage.root, exc
        )
        return False
    return holder is not None and not holder.released and gone_here(holder)


def count_attempts(events: list[dict[str, Any]]) -> int:
    """Worker groups started or tried: per submission (``run_start``), the highest ``attempt`` seen + 1."""
    total, highest = 0, -1
    for e in events:
        if e.get("event") == "run_start":
            total += highest + 1
            highest = -1
        if isinstance(e.get("attempt"), int):
            highest = max(highest, e["attempt"])
    return total + highest + 1


def _checkpoint_problem(store: CheckpointStore, info: CheckpointInfo) -> str | None:
    try:
        store.read_verified(info)
    except (CheckpointError, StorageError) as exc:
        return str(exc)
    return None


def checkpoint_rows(storage: Storage, verify: str = "latest") -> list[CheckpointRow]:
    """Committed checkpoints ascending, plus step folders without a manifest (torn writes).

    ``verify``: ``"all"`` checks every checkpoint's checksums, ``"latest"`` checks from the newest down
    until one verifies (the one a resume would load), ``"none"`` reads manifests only.
    """
    store = _checkpoints(storage)
    infos = store.list()
    committed = {i.step for i in infos}
    best = best_of(infos)
    verdict: dict[int, str | None] = {}
    for info in reversed(infos):
        if verify == "none":
            break
        verdict[info.step] = _checkpoint_problem(store, info)
        if verify == "latest" and verdict[info.step] is None:
            break
    rows = [
        CheckpointRow(
            step=i.step,
            epoch=i.manifest.get("epoch"),
            step_in_epoch=i.manifest.get("step_in_epoch"),
            bytes=i.total_bytes,
            files=len(i.manifest["files"]),
            verified=(verdict[i.step] is None) if i.step in verdict else None,
            problem=verdict.get(i.step),
            score=_score_text(i),
            best=best is not None and best.step == i.step,
        )
        for i in infos
    ]
    for step in store.steps_on_storage():
        if step not in committed:
            rows.append(
                CheckpointRow(step, None, None, 0, 0, False, "no manifest: torn or in progress, never loaded")
            )
    return sorted(rows, key=lambda r: r.step)


def resume_advice(run: Storage | CheckpointStore) -> str:
    """What rerunning the same job does, from what storage holds now (one sentence, for a failed run's
    message): resume from the newest checkpoint that verifies, naming its step, or start from step 0 when
    none does. ``run``: the run's storage, or its checkpoint store (a driver's, from its run folder)."""
    store = run if isinstance(run, CheckpointStore) else _checkpoints(run)
    where = store.storage.url("checkpoints")
    try:
        infos = store.list()
        newest = next((i.step for i in reversed(infos) if store.verifies(i) is None), None)
    except StorageError as exc:
        return (
            f"The checkpoints in {where} could not be read now ({exc}); once storage answers, rerunning the "
            "same job resumes from the newest that verifies."
        )
    if newest is not None:
        return f"Checkpoints are intact in {where}; rerun the same job to resume from step {newest}."
    if infos:
        return (
            f"None of the {len(infos)} checkpoint(s) in {where} verifies: rerunning the same job starts from "
            "step 0."
        )
    return "The run wrote no checkpoint: rerunning the same job starts from step 0."


def _score_text(info: CheckpointInfo) -> str | None:
    sc = score_of(info)
    return None if sc is None else f"{sc[0]}={sc[2]:.4g}"


def _latest(rows: list[CheckpointRow], verify: str) -> int | None:
    ok = [r.step for r in rows if r.verified or (verify == "none" and r.problem is None)]
    return max(ok) if ok else None


def summarize(
    name: str,
    storage: Storage,
    events: list[dict[str, Any]],
    rows: list[CheckpointRow],
    verify: str,
    config: dict[str, Any],
) -> RunSummary:
    epochs_done, step, loss = 0, 0, None
    for e in events:
        kind = e.get("event")
        if kind == "epoch_end":
            epochs_done = max(epochs_done, int(e.get("epoch", -1)) + 1)
        if kind in ("epoch_end", "finished", "already_complete") and isinstance(e.get("global_step"), int):
            step = max(step, e["global_step"])
        if kind == "checkpoint" and isinstance(e.get("step"), int):
            step = max(step, e["step"])
        if kind in ("epoch_end", "finished") and isinstance(e.get("loss"), (int, float)):
            loss = float(e["loss"])
    latest = _latest(rows, verify)
    starts = [e for e in events if e.get("event") == "run_start" and isinstance(e.get("config"), dict)]
    current = starts[-1]["config"] if starts else config
    total = current.get("training", {}).get("epochs")
    return RunSummary(
        name=name,
        url=storage.root,
        status=live_status(storage, events),
        epochs_done=epochs_done,
        epochs_total=total if isinstance(total, int) else None,
        global_step=max(step, latest or 0),
        latest_checkpoint=latest,
        last_loss=loss,
        attempts=count_attempts(events),
        failures=sum(e.get("event") == "failure" for e in events),
        submissions=sum(e.get("event") == "run_start" for e in events),
    )


def list_runs(url: str, options: dict[str, Any] | None = None, verify: bool = True) -> list[RunSummary]:
    root = _open(url, options)
    names = run_names(root)
    if not names:
        raise InspectError(f"no runs under {root.root} (no folder there holds a run.json)")
    mode = "latest" if verify else "none"
    out = []
    for name in names:
        storage = _open(join(root.root, name), options)
        rows = checkpoint_rows(storage, mode)
        out.append(
            summarize(
                name, storage, read_events(storage), rows, mode, read_run_json(storage).get("config", {})
            )
        )
    return out


def eval_rows(metric_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ``eval`` row per evaluated step (the first, should a step appear twice), in step order."""
    seen: dict[int, dict[str, Any]] = {}
    for row in metric_rows:
        if row.get("kind") == "eval":
            seen.setdefault(int(row["global_step"]), row)
    return [seen[k] for k in sorted(seen)]
