"""Errors during set-up on a real local Ray: a Task that raises in ``__init__`` or a ``build_*`` method, a
checkpoint that does not fit the model. The same error on every rank stops the run at once, whatever
``failures.max_failures`` says (-1 too), with the exception's type, message and ``file:line`` in the
error, the failure event, the console and ``show``; an error of one rank is retried as any failure is."""

from __future__ import annotations

import io

import pytest

from cluster import load_config, train
from cluster.core.errors import ConfigError, TrainingFailedError
from cluster.inspect import format_show, report
from cluster.run.storage import Storage
from cluster.spec.config import JobConfig
from tests.support.faults import events
from tests.support.tasks import SETUP_METHODS

pytestmark = pytest.mark.timeout(600)


def raise_line() -> str:
    """``file:line`` of the statement ``RaisesIn`` raises from, as the error names it."""
    with open("tests/support/tasks.py") as fh:
        (line,) = [i for i, text in enumerate(fh, 1) if "# RaisesIn: this line" in text]
    return f"tests/support/tasks.py:{line}"


def job(root: str, name: str, *extra: str) -> JobConfig:
    return load_config(
        overrides=[
            f"storage={root}",
            f"name={name}",
            "task=tests.support.tasks:RaisesIn",
            "training.global_batch_size=8",
            "training.epochs=1",
            "training.max_steps_per_epoch=2",
            "failures.hot_spare=false",
            "failures.backoff_s=0",
            *extra,
        ]
    )


def failed(cfg: JobConfig) -> tuple[str, str]:
    """Run ``cfg``, which must fail; (the error's first line, the console)."""
    out = io.StringIO()
    with pytest.raises(TrainingFailedError) as info:
        train(cfg, out=out)
    return str(info.value).splitlines()[0], out.getvalue()


@pytest.mark.parametrize("method", SETUP_METHODS)
def test_an_error_every_rank_raises_in_set_up_stops_the_run_at_once(
    ray_local: None, tmp_path: object, method: str
) -> None:
    cfg = job(
        str(tmp_path), f"raises-{method.strip('_')}", f"task_args.method={method}", "failures.max_failures=-1"
    )
    first, console = failed(cfg)
    where = raise_line()
    assert f"ValueError at {where}: task_args.method={method}: raised on purpose" in first, first
    assert "raised in set-up on every rank" in first
    run = f"{tmp_path}/{cfg.name}"
    (failure,) = events(run, "failure")  # one failure, no retry, though max_failures is -1
    assert failure["kind"] == "user_error"
    assert where in failure["message"].splitlines()[0] and "on every rank" in failure["message"]
    (decision,) = events(run, "decision")
    assert decision["restart"] is False and where in decision["reason"]
    assert len(events(run, "group_started")) == 0
    assert where in console  # the failure's line and the decision's
    assert where in format_show(report(Storage(run)))  # python -m cluster show


def test_an_error_of_one_rank_in_set_up_is_retried(ray_local: None, tmp_path: object) -> None:
    """Only rank 1 raises: not every rank's error, so it is retried; the same error again at the same
    step is a bug and stops the run."""
    cfg = job(str(tmp_path), "one-rank", "task_args.method=build_model", "task_args.ranks=[1]")
    first, _ = failed(cfg)
    assert "happened twice" in first, first
    failures = events(f"{tmp_path}/one-rank", "failure")
    assert len(failures) == 2
    assert all(f["kind"] == "user_error" and f["rank"] == 1 for f in failures)
    assert f"ValueError in set-up at {raise_line()} on rank 1" in failures[0]["message"].splitlines()[0]


def test_a_checkpoint_that_does_not_fit_the_model_stops_the_run_at_once(
    ray_local: None, tmp_path: object
) -> None:
    """task_args changed the model's shape on a run with a checkpoint: a config error (every rank finds it
    when it loads the checkpoint), no retry, though max_failures is -1."""
    root = str(tmp_path)
    done = train(job(root, "widths", "task_args.hidden=8"), out=io.StringIO())
    assert done.status == "finished"
    cfg = job(root, "widths", "task_args.hidden=16", "training.epochs=2", "failures.max_failures=-1")
    with pytest.raises(ConfigError, match="does not fit this job's model") as info:
        train(cfg, out=io.StringIO())
    assert "task_args.hidden=16 (the run's: 8)" in str(info.value)
    assert events(f"{root}/widths", "failure") == []
    assert len(events(f"{root}/widths", "group_started")) == 1  # the first submission's
