"""THE table of mistakes a user makes, with what each must give: the exit status and a fragment of the one
line printed on stderr (the key, the option or the user's ``file:line``, and the fix).

``tests/unit/test_mistakes.py`` runs every up-front row in this process (``run``: ``python -m jobs.train``'s
and ``python -m cluster``'s ``main``, stderr captured; a row that raises out of ``main`` is a traceback) and
checks: the exit status, exactly one line naming what it should, nothing written to storage.
``tests/ray/test_setup_errors.py`` checks the set-up rows (a Task raising; they need Ray). The table in
docs/troubleshooting.md is generated from these rows and their messages
(``python -m cluster docs-mistakes --write docs/troubleshooting.md``), so it cannot drift.

Arguments may hold ``{tmp}`` (a fresh folder; storage is ``{tmp}/runs``) and ``{closed}`` (a local port
nothing listens on); rows run with ``RAY_ADDRESS`` at that closed port, so that a row that is no longer
refused up front fails on that instead of starting Ray.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import tempfile
import traceback
from dataclasses import dataclass, field

from tests.support.tasks import SETUP_METHODS

CONFIG = "jobs/configs/tiny_cpu.yaml"


@dataclass(frozen=True)
class Mistake:
    kind: str
    """``config key``, ``config file``, ``command line``, ``environment`` or ``set-up`` (a Task raising,
    checked on Ray)."""
    what: str
    """The mistake as the user writes it (the docs' first column)."""
    argv: tuple[str, ...]
    """``train ...`` (``python -m jobs.train``) or ``cluster ...`` (``python -m cluster``)."""
    expect: str
    """A fragment the one line on stderr must hold."""
    code: int = 2
    files: dict[str, str] = field(default_factory=dict)
    """Files written into ``{tmp}`` first: name -> text."""
    env: dict[str, str] = field(default_factory=dict)


def key(setting: str, expect: str, env: dict[str, str] | None = None) -> Mistake:
    """A config value given with ``--set`` on the tiny CPU job."""
    return Mistake(
        "config key", f"`{setting}`", ("train", "--config", CONFIG, "--set", setting), expect, env=env or {}
    )


def train(what: str, expect: str, *args: str, files: dict[str, str] | None = None) -> Mistake:
    kind = "config file" if files else "command line"
    return Mistake(kind, what, ("train", *args, "--set", "storage={tmp}/runs"), expect, files=files or {})


def tool(what: str, expect: str, *args: str) -> Mistake:
    return Mistake("command line", what, ("cluster", *args), expect)


_NOT_FINITE = "is not a finite number"

MISTAKES: list[Mistake] = [
    # --- values that cannot work
    key("failures.hang_timeout_s=.nan", f"failures.hang_timeout_s=nan {_NOT_FINITE}"),
    key("failures.hang_timeout_floor_s=.nan", f"failures.hang_timeout_floor_s=nan {_NOT_FINITE}"),
    key("scaling.resource_wait_s=.nan", f"scaling.resource_wait_s=nan {_NOT_FINITE}"),
    key("training.grad_clip=.nan", f"training.grad_clip=nan {_NOT_FINITE}"),
    key("training.grad_clip=.inf", f"training.grad_clip=inf {_NOT_FINITE}"),
    key("failures.backoff_s=.nan", f"failures.backoff_s=nan {_NOT_FINITE}"),
    key("failures.process_group_timeout_s=.inf", f"failures.process_group_timeout_s=inf {_NOT_FINITE}"),
    key("failures.preemption_margin_s=.nan", f"failures.preemption_margin_s=nan {_NOT_FINITE}"),
    key("training.time_limit_s=.inf", f"training.time_limit_s=inf {_NOT_FINITE}"),
    key("tracking.flush_timeout_s=.nan", f"tracking.flush_timeout_s=nan {_NOT_FINITE}"),
    key("metrics.flush_s=.inf", f"metrics.flush_s=inf {_NOT_FINITE}"),
    key("scaling.cpus_per_worker=.nan", f"scaling.cpus_per_worker=nan {_NOT_FINITE}"),
    key(
        "scaling.resources_per_worker={trainer: .nan}",
        f"scaling.resources_per_worker.trainer=nan {_NOT_FINITE}",
    ),
    key("training.seed=-1", "training.seed=-1 is outside 0..2**63-1"),
    key("training.seed=18446744073709551615", "training.seed=18446744073709551615 is outside 0..2**63-1"),
    key("failures.hang_timeout_s=1", "failures.hang_timeout_s=1 is shorter than the driver's heartbeat"),
    key("failures.hang_timeout_s=300", "failures.hang_timeout_s=300 must be shorter than"),
    key(  # on the embedded Ray (no RAY_ADDRESS): more CPUs than this machine has
        "scaling.cpus_per_worker=4096",
        "scaling.num_workers=2 x scaling.cpus_per_worker=4096 = 8192 CPUs",
        env={"RAY_ADDRESS": ""},
    ),
    key(  # on the embedded Ray: an interface this machine does not have (on a cluster: rank 0's node says)
        "scaling.socket_ifname=nosuch0",
        "scaling.socket_ifname='nosuch0' is not a network interface of this machine",
        env={"RAY_ADDRESS": ""},
    ),
    # --- keys, types and choices
    Mistake(  # (not in backticks: the docs' check of the keys they name would refuse it)
        "config key",
        "a misspelt key, training.epoch=3",
        ("train", "--config", CONFIG, "--set", "training.epoch=3"),
        "unknown key 'training.epoch'; did you mean 'training.epochs'?",
    ),
    key("training.epochs=0", "training.epochs=0 must be at least 1"),
    key("training.epochs=two", "training.epochs must be an integer, got str 'two'"),
    key("scaling.num_workers=0", "scaling.num_workers=0 must be at least 1"),
    key("training.global_batch_size=63", "training.global_batch_size=63 is not divisible"),
    key("scaling.placement_strategy=SPREADS", "scaling.placement_strategy='SPREADS' is not allowed"),
    key("name=a/b", "name='a/b' is not a valid run name"),
    key("task=nonsense", "task='nonsense' must be an import path"),
    key("task=jobs.tasks.charlm:Nope", "task='jobs.tasks.charlm:Nope'"),
    key("storage=memory://x", "storage.url='memory://x': memory:// lives inside one process"),
    key("failures.max_failures=-2", "failures.max_failures=-2 must be -1 (unlimited) or at least 0"),
    key("checkpoint.keep_last=0", "checkpoint.keep_last=0 must be at least 1"),
    key("evaluation.patience=3", "evaluation.patience=3 stops the run when checkpoint.best_metric"),
    key("tracking.notify_url=ftp://x", "tracking.notify_url='ftp://...' must be an http(s) URL"),
    key("training.sync_batchnorm=true", "training.sync_batchnorm=true needs scaling.use_gpu=true"),
    key("failures.inject=[{rank: 5}]", "failures.inject[0].rank=5 is not a rank of this job"),
    # --- the command line
    train("`--config-json '[1]'`", "--config-json holds list, not a job spec", "--config-json", "[1]"),
    train("`--config-json '{bad'`", "the config is not JSON", "--config-json", "{bad"),
    train("`--config` a folder", "--config '{tmp}' is a folder", "--config", "{tmp}"),
    train("`--config` a file that is not there", "does not exist", "--config", "{tmp}/missing.yaml"),
    train(
        "`--set epochs`", "override 'epochs' must look like key=value", "--config", CONFIG, "--set", "epochs"
    ),
    train(
        "`--set training.epochs=[x`",
        "override 'training.epochs=[x': the value is not valid YAML",
        "--config",
        CONFIG,
        "--set",
        "training.epochs=[x",
    ),
    train(
        "`--set training.epochs.x=1`",
        "override 'training.epochs.x=1': 'epochs' is not a section",
        "--config",
        CONFIG,
        "--set",
        "training.epochs.x=1",
    ),
    tool(
        "`eval --batch-size 0`",
        "--batch-size 0 must be at least 1",
        "eval",
        "{tmp}/runs/r",
        "--batch-size",
        "0",
    ),
    tool(
        "`eval --max-batches 0`",
        "--max-batches 0 must be at least 1",
        "eval",
        "{tmp}/runs/r",
        "--max-batches",
        "0",
    ),
    tool(
        "`eval --step latest`",
        "--step 'latest' must be a step number or best",
        "eval",
        "{tmp}/runs/r",
        "--step",
        "latest",
    ),
    tool(
        "`eval --task-arg k=[x`",
        "--task-arg 'k=[x': the value is not valid YAML",
        "eval",
        "{tmp}/runs/r",
        "--task-arg",
        "k=[x",
    ),
    tool("`-o k=[x`", "storage option 'k=[x': the value is not valid YAML", "list", "{tmp}", "-o", "k=[x"),
    tool(
        "`-o endpoint_url`",
        "storage option 'endpoint_url' must look like key=value",
        "list",
        "{tmp}",
        "-o",
        "endpoint_url",
    ),
    tool("`show` a run that is not there", "no run named 'nothing'", "show", "{tmp}/runs/nothing"),
    tool("`profile --steps 0`", "--steps 0 must be 1 to", "profile", "{tmp}/runs/r", "--steps", "0"),
    Mistake(
        "environment",
        "`RAY_ADDRESS` names no running cluster",
        ("train", "--config", CONFIG, "--set", "storage={tmp}/runs"),
        "RAY_ADDRESS='127.0.0.1:{closed}': nothing answers at 127.0.0.1:{closed}",
        env={"RAY_ADDRESS": "127.0.0.1:{closed}"},
    ),
    # --- config files
    train(
        "a YAML file that does not parse",
        "is not valid YAML",
        "--config",
        "{tmp}/c.yaml",
        files={"c.yaml": "training: [\n"},
    ),
    train(
        "a YAML file holding a list",
        "must hold a mapping of sections, not list",
        "--config",
        "{tmp}/c.yaml",
        files={"c.yaml": "- 1\n"},
    ),
    train(
        "a YAML file with `.nan`",
        f"failures.hang_timeout_s=nan {_NOT_FINITE}",
        "--config",
        "{tmp}/c.yaml",
        files={"c.yaml": "failures:\n  hang_timeout_s: .nan\n"},
    ),
    train(
        "`--config-file` holding a list",
        "holds list, not a job spec",
        "--config-file",
        "{tmp}/c.json",
        files={"c.json": "[1]"},
    ),
    train(
        "`--config-file` that is not JSON",
        "the config is not JSON",
        "--config-file",
        "{tmp}/c.json",
        files={"c.json": "{"},
    ),
    train(
        "`--config-file` missing from the working directory",
        "is not in the job's working directory",
        "--config-file",
        "{tmp}/gone.json",
        files={"other.json": "{}"},
    ),
]
"""Refused before anything starts: exit status 2, one line, nothing written."""

SETUP_MISTAKES: list[Mistake] = [
    *(
        Mistake(
            "set-up",
            f"the Task raises in `{m}` on every rank",
            (),
            "training failed: ValueError at FILE:LINE: MESSAGE, raised in set-up on every rank: ... "
            "retrying cannot help",
            code=1,
        )
        for m in SETUP_METHODS
    ),
    Mistake(
        "set-up",
        "the Task raises in set-up on one rank only",
        (),
        "failure: user_error on rank R ... ValueError in set-up at FILE:LINE on rank R: MESSAGE (retried; "
        "the same error twice: training failed: the same ValueError happened twice ...)",
        code=1,
    ),
    Mistake(
        "set-up",
        "a checkpoint that does not fit the model (`task_args` changed its shape, same run name)",
        (),
        "config error: RUN/checkpoints/step_N/model.pt does not fit this job's model (...): "
        "task_args.KEY=... "
        "(the run's: ...) changed since the run started. Keep the run's task_args, or choose a new run name "
        "(training.init_from can start it from these weights)",
        code=2,
    ),
]
"""Found when the workers set up (they need Ray; ``tests/ray/test_setup_errors.py``): the run stops at once,
with one failure event (exit status 1), or as a config error (2) for a checkpoint that does not fit."""


@dataclass
class Outcome:
    code: int
    lines: list[str]
    """stderr's non-empty lines."""
    traceback: str | None
    """The traceback of an exception that escaped ``main``, or None."""
    wrote: bool
    """Whether ``{tmp}/runs`` exists afterwards."""


_HELD: list[socket.socket] = []


def closed_port() -> int:
    """A local port that refuses connections for as long as this process lives: bound, never listening, so
    no other process (a Ray started by a test beside this one) can take it and answer there."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return int(s.getsockname()[1])


def fill(text: str, tmp: str, port: int) -> str:
    return text.replace("{tmp}", tmp).replace("{closed}", str(port))


def run(m: Mistake, tmp: str, port: int) -> Outcome:
    """Run one up-front row in this process: its files written into ``tmp``, its command's ``main`` called
    with stdout and stderr captured, ``RAY_ADDRESS`` at the closed ``port`` unless the row sets it."""
    from cluster.__main__ import main as cluster_main
    from jobs.train import main as train_main

    for name, text in m.files.items():
        with open(os.path.join(tmp, name), "w") as fh:
            fh.write(text)
    env = {"RAY_ADDRESS": f"127.0.0.1:{port}", **{k: fill(v, tmp, port) for k, v in m.env.items()}}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    err, out = io.StringIO(), io.StringIO()
    main = train_main if m.argv[0] == "train" else cluster_main
    tb = None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main([fill(a, tmp, port) for a in m.argv[1:]])
    except SystemExit as exc:
        code = int(exc.code or 0)
    except Exception:
        code, tb = -1, traceback.format_exc()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    return Outcome(code, lines, tb, os.path.exists(os.path.join(tmp, "runs")))


def doc_rows() -> list[tuple[str, str, int, str]]:
    """(kind, mistake, exit status, message) of every row, in the table's order: the up-front rows' messages
    as they are printed now (what depends on the machine shown as ``<tmp>``, ``<port>``, ``<cwd>``,
    ``<cores>``), the set-up rows' as their shape (they need Ray)."""
    rows = []
    port = closed_port()
    for m in MISTAKES:
        with tempfile.TemporaryDirectory(prefix="mistake") as tmp:
            got = run(m, tmp, port)
            text = " / ".join(got.lines) if got.traceback is None else "a traceback"
            for actual, shown in (
                (tmp, "<tmp>"),
                (str(port), "<port>"),
                (os.getcwd(), "<cwd>"),
                (f"this machine has {os.cpu_count()} ", "this machine has <cores> "),
            ):
                text = text.replace(actual, shown)
        rows.append((m.kind, m.what, got.code, text))
    rows += [(m.kind, m.what, m.code, m.expect) for m in SETUP_MISTAKES]
    return rows
