"""Read runs back from storage: what ``python -m cluster list|show|plot|watch`` print. No Ray, no workers.

- :mod:`cluster.inspect.runs`: finding runs and reading one (events, status, checkpoints, metrics): the
  public read model.
- :mod:`cluster.inspect.records`: ``show``'s report: failures with their recoveries, drain notices, slow
  ranks, each assembled from the event log.
- :mod:`cluster.inspect.render`: those as text (``list``, ``show``) and ``watch``'s loop; events read as
  :mod:`cluster.core.events` renders them.

The names below are the package's interface (``cluster.run_metrics`` and ``python -m cluster`` use it).
"""

from __future__ import annotations

from cluster.core.events import WATCHED, human_bytes
from cluster.inspect.records import (
    FailureRecord,
    PreemptionRecord,
    RunReport,
    SlowRankRecord,
    failure_records,
    flatten,
    preemption_records,
    report,
    slow_rank_records,
)
from cluster.inspect.render import (
    event_line,
    format_evaluations,
    format_list,
    format_show,
    position,
    table,
    watch,
)
from cluster.inspect.runs import (
    FAILED,
    FINISHED,
    INTERRUPTED,
    RUNNING,
    STOPPED,
    UNFINISHED,
    CheckpointRow,
    InspectError,
    RunSummary,
    checkpoint_rows,
    count_attempts,
    eval_rows,
    final_path,
    list_runs,
    live_status,
    open_run,
    read_events,
    read_run_json,
    resume_advice,
    run_metrics,
    run_names,
    run_status,
    summarize,
)

__all__ = [
    "FAILED",
    "FINISHED",
    "INTERRUPTED",
    "RUNNING",
    "STOPPED",
    "UNFINISHED",
    "WATCHED",
    "CheckpointRow",
    "FailureRecord",
    "InspectError",
    "PreemptionRecord",
    "RunReport",
    "RunSummary",
    "SlowRankRecord",
    "checkpoint_rows",
    "count_attempts",
    "eval_rows",
    "event_line",
    "failure_records",
    "final_path",
    "flatten",
    "format_evaluations",
    "format_list",
    "format_show",
    "human_bytes",
    "list_runs",
    "live_status",
    "open_run",
    "position",
    "preemption_records",
    "read_events",
    "read_run_json",
    "report",
    "resume_advice",
    "run_metrics",
    "run_names",
    "run_status",
    "slow_rank_records",
    "summarize",
    "table",
    "watch",
]
