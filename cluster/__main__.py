"""Inspect runs in storage (a folder or an fsspec URL: s3://, gs://, abfs://). Needs no Ray.

    python -m cluster list ./runs                          # one line per run
    python -m cluster show ./runs/tiny-cpu                 # status, goodput, failures, checkpoints, metrics
    python -m cluster show s3://bucket/runs gpt-gpu --verify   # also checksum every checkpoint
    python -m cluster plot ./runs/tiny-cpu --out tiny.png  # loss and samples/s vs global step
    python -m cluster eval ./runs/tiny-cpu --step best     # a checkpoint on the run's eval set, here
    python -m cluster export ./runs/tiny-cpu --out m.safetensors --step best  # weights for serving
    python -m cluster rewind ./runs/tiny-cpu --to 400 --yes  # delete the checkpoints after step 400
    python -m cluster unquarantine ./runs/tiny-cpu 3f2a9c   # ranks may go to that node again
    python -m cluster stop ./runs/tiny-cpu --wait 300      # a running job stops with a checkpoint
    python -m cluster stacks ./runs/tiny-cpu               # where every rank of a running job is now
    python -m cluster profile ./runs/tiny-cpu --steps 5    # torch.profiler traces of a running job's steps
    python -m cluster watch ./runs/tiny-cpu                # follow a run's events until it ends
    python -m cluster docs-config --write docs/config.md   # regenerate the config reference
    python -m cluster docs-events --write docs/events.md   # regenerate the events reference
    python -m cluster docs-mistakes --write docs/troubleshooting.md  # regenerate the table of mistakes

Storage credentials come from the usual environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS) or from
``-o key=value`` fsspec storage options (``-o endpoint_url=http://127.0.0.1:9000``).

Exit status: 0 on success, 2 for a URL without runs, an unknown run name, a bad argument, a checkpoint
that cannot be loaded or a run with no job to stop, 1 when storage cannot be read or a stop waited out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Literal, TypeVar

import yaml

from cluster import inspect
from cluster.core.errors import CheckpointError, ConfigError, StorageError
from cluster.core.urls import url_problem
from cluster.inspect import plot
from cluster.run.storage import Storage
from cluster.spec import reference as docs

T = TypeVar("T")


def _options(pairs: list[str], what: str = "storage option") -> dict[str, Any]:
    """``key=value`` pairs (``-o``, ``--task-arg``), each value read as YAML; InspectError (exit 2) names a
    malformed one."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise inspect.InspectError(f"{what} {pair!r} must look like key=value")
        try:
            out[key] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise inspect.InspectError(
                f"{what} {pair!r}: the value is not valid YAML ({problem}); quote it, e.g. {key}='\"{raw}\"'"
            ) from None
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument(
            "-o",
            "--option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="fsspec storage option (repeatable), e.g. endpoint_url=http://127.0.0.1:9000",
        )
        return cmd

    _add_reading(add)
    _add_checkpoint_commands(add)
    _add_requests(add)
    for which, page, doc in (
        ("config", "the configuration reference", "config.md"),
        ("events", "the events reference", "events.md"),
        ("mistakes", "the table of mistakes and what each prints", "troubleshooting.md"),
    ):
        dc = sub.add_parser(f"docs-{which}", help=f"print {page} (docs/{doc}, generated)")
        dc.add_argument("--write", metavar="FILE", help="replace the reference block in this file instead")
    return p


def _add_reading(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """``list``, ``show``, ``plot``: what a run holds."""
    ls = add("list", "the runs under a storage URL, one line each")
    ls.add_argument("url", help="storage URL that holds runs, e.g. ./runs or s3://bucket/runs")
    ls.add_argument(
        "--no-verify",
        action="store_true",
        help="show the newest committed checkpoint without reading it to check its checksums",
    )
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")

    show = add("show", "one run: status, goodput, failures and recoveries, checkpoints, metrics, settings")
    show.add_argument("url", help="URL/NAME of a run, or the storage URL when NAME is given")
    show.add_argument("name", nargs="?", help="run name under URL")
    show.add_argument(
        "--verify",
        action="store_true",
        help="checksum every checkpoint (default: only the latest, the one a resume loads)",
    )
    show.add_argument("--json", action="store_true", help="print JSON instead of text")
    show.add_argument(
        "--config",
        action="store_true",
        help="list every setting (default: those that differ from the defaults)",
    )

    pl = add("plot", "loss and throughput (samples/s) vs global step, as a PNG")
    pl.add_argument("url", help="URL/NAME of a run, or the storage URL when NAME is given")
    pl.add_argument("name", nargs="?", help="run name under URL")
    pl.add_argument("--out", required=True, help="PNG file to write, e.g. loss.png")


def _add_checkpoint_commands(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """``eval``, ``export``, ``rewind``: a checkpoint used, or gone back to."""
    ev = add("eval", "evaluate a checkpoint on its run's eval set, in this process (the run's Task; no Ray)")
    ev.add_argument("url", help="URL/NAME of a run, or the storage URL when NAME is given")
    ev.add_argument("name", nargs="?", help="run name under URL")
    ev.add_argument(
        "--step", default=None, help="a checkpoint's step, or best (default: the latest verified)"
    )
    ev.add_argument(
        "--task-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one of the run's task_args (repeatable), e.g. to evaluate another split",
    )
    ev.add_argument("--batch-size", type=int, default=None, help="samples per batch (default: the run's)")
    ev.add_argument("--max-batches", type=int, default=None, help="evaluate only the first N batches")
    ev.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: cpu)")
    ev.add_argument("--json", action="store_true", help="print JSON instead of text")

    ex = add(
        "export",
        "write a checkpoint's weights to one file for serving: .safetensors (pip install 'cluster[export]') "
        "or .pt, with a JSON sidecar naming the run, step, task and checksum",
    )
    ex.add_argument("url", help="URL/NAME of a run, or the storage URL when NAME is given")
    ex.add_argument("name", nargs="?", help="run name under URL")
    ex.add_argument("--out", required=True, help="the file (or fsspec URL): model.safetensors or model.pt")
    ex.add_argument(
        "--step", default=None, help="a checkpoint's step, or best (default: the latest verified)"
    )
    ex.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="cast floating-point weights to this")

    rw = add(
        "rewind",
        "take a run that no job trains back to an older checkpoint: the newer ones are deleted, so the next "
        "submission resumes there (with training.skip_steps, to skip a loss spike's batches)",
    )
    rw.add_argument("url", help="URL/NAME of a run, or the storage URL when NAME is given")
    rw.add_argument("name", nargs="?", help="run name under URL")
    rw.add_argument("--to", type=int, required=True, metavar="STEP", help="the checkpoint step to go back to")
    rw.add_argument("--yes", action="store_true", help="delete the newer checkpoints (without: list them)")

    uq = add(
        "unquarantine",
        "release a node the run quarantined after repeated incidents (failures.quarantine_after): the next "
        "submission may place ranks there again",
    )
    uq.add_argument("url", help="URL/NAME of a run")
    uq.add_argument("node", help="the node: its Ray node id, a prefix of it, or its host (as show lists it)")


def _add_requests(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """``stop``, ``stacks``, ``profile``: requests to a running job; ``watch`` follows one."""
    st = add(
        "stop",
        "ask the job training a run to stop at its next step with a checkpoint there (resubmit to resume)",
    )
    st.add_argument("url", help="URL/NAME of a run, or the storage URL when NAME is given")
    st.add_argument("name", nargs="?", help="run name under URL")
    st.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for the job to stop and say where (default: ask and return)",
    )
    st.add_argument("--reason", default=None, help="recorded in the run's stopped event (default: user@host)")

    sk = add("stacks", "where every rank of a running job is: its threads' Python stacks, grouped")
    sk.add_argument("url", help="URL/NAME of a run, or the storage URL when NAME is given")
    sk.add_argument("name", nargs="?", help="run name under URL")
    sk.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for the job (default 60)",
    )
    sk.add_argument("--summary", action="store_true", help="print only where each group of ranks is")

    pr = add("profile", "record a running job's next steps with torch.profiler: a trace and a table per rank")
    pr.add_argument("url", help="URL/NAME of a run, or the storage URL when NAME is given")
    pr.add_argument("name", nargs="?", help="run name under URL")
    pr.add_argument("--steps", type=int, default=5, help="training steps to record (default 5, at most 100)")
    pr.add_argument("--ranks", default=None, help="ranks to profile, e.g. 0,3 (default: every rank)")
    pr.add_argument(
        "--wait",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long to wait for the files (default 300)",
    )

    wa = add("watch", "follow a run's events as they land (from storage), until it ends")
    wa.add_argument("url", help="URL/NAME of a run, or the storage URL when NAME is given")
    wa.add_argument("name", nargs="?", help="run name under URL")
    wa.add_argument("--interval", type=float, default=5.0, metavar="SECONDS", help="how often to look (5)")
    wa.add_argument("--all", action="store_true", help="every event, not only the notable ones")
    wa.add_argument("--backlog", type=int, default=10, help="earlier events to print first (default 10)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command in ("docs-config", "docs-events", "docs-mistakes"):
            return _docs(args.command.removeprefix("docs-"), args.write)
        options = _options(args.option)
        problem = url_problem(args.url, "URL")
        if problem is not None:
            return _error(f"error: {problem}", 2)
        return _COMMANDS[args.command](args, options)
    except StorageError as exc:
        return _error(f"storage error: {exc}", 1)
    except CheckpointError as exc:
        return _error(f"error: {exc}", 2)
    except (inspect.InspectError, ValueError, OSError) as exc:  # OSError: e.g. --out in a missing folder
        return _error(f"error: {exc}", 2)


def _list(args: argparse.Namespace, options: dict[str, Any]) -> int:
    runs = inspect.list_runs(args.url, options, verify=not args.no_verify)
    print(json.dumps([asdict(r) for r in runs], indent=1) if args.json else inspect.format_list(runs))
    return 0


def _show(args: argparse.Namespace, options: dict[str, Any]) -> int:
    report = inspect.report(inspect.open_run(args.url, args.name, options), verify_all=args.verify)
    text = inspect.format_show(report, all_config=args.config)
    print(json.dumps(asdict(report), indent=1, default=str) if args.json else text)
    return 0


def _plot(args: argparse.Namespace, options: dict[str, Any]) -> int:
    storage = inspect.open_run(args.url, args.name, options)
    width, height = plot.plot_png(storage, args.out)
    print(f"wrote {args.out} ({width}x{height})")
    return 0


def _watch(args: argparse.Namespace, options: dict[str, Any]) -> int:
    storage = inspect.open_run(args.url, args.name, options)
    try:
        status = inspect.watch(storage, sys.stdout, args.interval, args.all, max(0, args.backlog))
    except KeyboardInterrupt:
        return 130
    return 0 if status in (inspect.FINISHED, inspect.STOPPED) else 1


def _docs(which: str, write: str | None) -> int:
    """Print a generated reference block, or replace it in the file ``write``."""
    if write is None:
        sys.stdout.write(docs.generate(which))
        return 0
    with open(write) as fh:
        text = docs.replace(fh.read(), which)  # before the file is opened for writing: a failure leaves it
    folder, name = os.path.split(os.path.abspath(write))
    # a temporary name, then a rename: never a torn file; a local file, not retried
    Storage(folder, retries=0, retry_budget_s=0.0).write_atomic(name, text.encode())
    print(f"updated the {which} reference in {write}")
    return 0


def _step_arg(value: str | None) -> int | Literal["best"] | None:
    """``--step``: a number, ``best``, or None (the latest); ValueError (exit 2) otherwise."""
    if value is None:
        return None
    if value == "best":
        return "best"
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--step {value!r} must be a step number or best") from None


def _eval(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from cluster.api.load import evaluate_checkpoint

    for flag, value in (("--batch-size", args.batch_size), ("--max-batches", args.max_batches)):
        if value is not None and value < 1:
            return _error(f"error: {flag} {value} must be at least 1 (or left out: the run's)", 2)
    task_args = _options(args.task_arg, "--task-arg")
    step = _step_arg(args.step)
    storage = inspect.open_run(args.url, args.name, options)
    res = evaluate_checkpoint(
        storage.root,
        step,
        options,
        task_args=task_args,
        device=args.device,
        batch_size=args.batch_size,
        max_batches=args.max_batches,
    )
    if args.json:
        print(json.dumps(asdict(res), indent=1))
    else:
        shown = "".join(f", {k} {v:.4g}" for k, v in res.metrics.items())
        print(
            f"step {res.step}: loss {res.loss:.4f}{shown} ({res.samples} samples, {res.batches} batches, "
            f"{res.seconds:.1f}s)"
        )
    return 0


def _export(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from cluster.api.export import export_checkpoint

    storage = inspect.open_run(args.url, args.name, options)
    step = _step_arg(args.step)
    try:
        done = export_checkpoint(storage.root, args.out, step, options, args.dtype)
    except ConfigError as exc:
        return _error(f"error: {exc}", 2)
    tied = f", tied: {done['tied']}" if done["tied"] else ""
    print(
        f"wrote {args.out} ({inspect.human_bytes(done['bytes'])}, {done['tensors']} tensors, "
        f"{done['parameters']:,} values) from step {done['step']} of {done['run_url']}{tied}; "
        f"sidecar {args.out}.json (sha256 {done['sha256'][:12]}...)"
    )
    return 0


def _rewind(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from cluster.api.rewind import rewind

    storage = inspect.open_run(args.url, args.name, options)
    try:
        plan = rewind(storage.root, args.to, options, apply=args.yes, say=print)
    except ConfigError as exc:
        return _error(f"error: {exc}", 2)
    if not plan.newer:
        print(f"{plan.run_url}: step {plan.step} is already its newest checkpoint; nothing to delete")
        return 0
    if not plan.done:
        return _error(
            f"would delete the checkpoints after step {plan.step} of {plan.run_url}: {plan.newer}; "
            "pass --yes to delete them",
            2,
        )
    deleted = [s for s in plan.newer if s not in plan.set_aside]
    aside = f", set aside {plan.set_aside} in checkpoints/discarded/" if plan.set_aside else ""
    print(
        f"rewound {plan.run_url} to step {plan.step}: deleted the checkpoints {deleted}{aside}. Resubmit the "
        "job to resume there (training.skip_steps skips batches; see docs/failures.md)"
    )
    return 0


def _unquarantine(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from cluster.run.quarantine import unquarantine

    storage = inspect.open_run(args.url, None, options)
    try:
        rec = unquarantine(storage.root, args.node, options, say=print)
    except ConfigError as exc:
        return _error(f"error: {exc}", 2)
    cleared = ", ".join(f"{i['kind']} at step {i['step']}" for i in rec.released[-1]["incidents"])
    print(f"released node {rec.describe()} of {storage.root} (its incidents: {cleared}): ranks may go there")
    return 0


def _stop(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from cluster.run.lease import current as current_lease
    from cluster.run.requests import write_stop_request

    storage, problem = _running_run(args, options)
    if problem is not None:
        return _error(f"error: {problem}, nothing to stop", 2)
    req = write_stop_request(storage, args.reason)
    holder = current_lease(storage)
    by = f": {holder.describe()}" if holder is not None else ""
    print(f"asked {storage.root} to stop ({req.reason}){by}; its driver looks every few seconds")
    if args.wait <= 0:
        return 0

    def ended() -> dict[str, Any] | None:
        tail = [e for e in inspect.read_events(storage) if float(e.get("time", 0)) >= req.requested_at - 1]
        return next((e for e in tail if e.get("event") in ("stopped", "finished", "run_failed")), None)

    done = _poll_until(args.wait, ended, every_s=1.0)
    if done is None:
        return _error(
            f"not stopped within {args.wait:g}s: is a job training it? The request stays: a running job "
            "acts on it, a later submission removes it unread",
            1,
        )
    if done["event"] == "stopped":
        print(
            f"stopped at step {done.get('global_step')}; checkpoint at step {done.get('checkpoint_step')}"
            + ("" if done.get("committed") else f" ({done.get('note')})")
        )
    else:
        print(f"the run ended first: {done['event']} at step {done.get('global_step')}")
    return 0


def _stacks(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from cluster.run.requests import write_stacks_request

    storage, problem = _running_run(args, options)
    if problem is not None:
        return _error(f"error: {problem}", 2)
    req_id = write_stacks_request(storage)
    e = _poll_until(args.wait, lambda: _answer(storage, "stacks", req_id))
    if e is None:
        return _error(
            f"no answer within {args.wait:g}s: is a job training it? Its driver reads requests every few "
            "seconds while the ranks train (not while a group starts or recovers)",
            1,
        )
    if args.summary:
        for g in e.get("groups", []):
            print(f"ranks {g['ranks']}: {g['where']}")
        if e.get("silent"):
            print(f"ranks {e['silent']}: no answer")
    else:
        sys.stdout.write(storage.read_bytes(e["path"]).decode())
    return 0


def _profile(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from cluster.rank.profiling import table_name, trace_name
    from cluster.run.requests import MAX_STEPS, write_profile_request

    if not 1 <= args.steps <= MAX_STEPS:
        return _error(f"error: --steps {args.steps} must be 1 to {MAX_STEPS}", 2)
    try:
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    except ValueError:
        return _error(f"error: --ranks {args.ranks!r} must list rank numbers, e.g. 0,3", 2)
    storage, problem = _running_run(args, options)
    if problem is not None:
        return _error(f"error: {problem}", 2)
    req_id = write_profile_request(storage, args.steps, ranks)
    t0 = time.time()
    started = _poll_until(args.wait, lambda: _answer(storage, "profile_requested", req_id))
    if started is None:
        return _error(f"no job took the request within {args.wait:g}s: is a job training it?", 1)
    folder, want = started["folder"], started["ranks"]

    def written() -> bool | None:
        have = set(storage.listdir(folder))
        return True if all(table_name(r) in have for r in want) else None

    if _poll_until(args.wait - (time.time() - t0), written) is None:
        return _error(
            f"the ranks did not write every profile within {args.wait:g}s (are they still stepping?)", 1
        )
    sys.stdout.write(storage.read_bytes(f"{folder}/{table_name(want[0])}").decode())
    print("\ntraces (https://ui.perfetto.dev, chrome://tracing, TensorBoard's profiler plugin):")
    for r in want:
        print(f"  {storage.url(f'{folder}/{trace_name(r)}')}")
    return 0


def _answer(storage: Any, event: str, req_id: str) -> dict[str, Any] | None:
    """The event that answers request ``req_id`` (its ``request`` field), once the driver wrote it."""
    found = [
        e for e in inspect.read_events(storage) if e.get("event") == event and e.get("request") == req_id
    ]
    return found[-1] if found else None


def _poll_until(wait_s: float, check: Callable[[], T | None], every_s: float = 0.5) -> T | None:
    """``check()`` until it returns something or ``wait_s`` has passed (then None)."""
    deadline = time.time() + wait_s
    while True:
        got = check()
        if got is not None or time.time() >= deadline:
            return got
        time.sleep(every_s)


def _running_run(args: argparse.Namespace, options: dict[str, Any]) -> tuple[Any, str | None]:
    """The run a request command names, and why no job can answer a request to it (it ended, or its
    driver is gone); None when one can."""
    from cluster.run.lease import current as current_lease
    from cluster.run.lease import gone_here
    from cluster.run.requests import driver_seen

    storage = inspect.open_run(args.url, args.name, options)
    status = inspect.live_status(storage, inspect.read_events(storage))
    # who writes the run (cluster.run.lease): runs of earlier versions have none
    holder = current_lease(storage)
    if holder is not None:
        if not holder.released and gone_here(holder):
            return storage, (
                f"{storage.root} is interrupted: its driver, {holder.describe()}, is gone from this machine; "
                "no job is training it"
            )
        if not holder.released:
            return storage, None
        shown = status if status not in (inspect.RUNNING, inspect.UNFINISHED) else "not training"
        return (
            storage,
            f"{storage.root} is {shown}: no job is training it (the last, {holder.describe()}, ended)",
        )
    if status == inspect.INTERRUPTED:
        seen = driver_seen(storage) or {}
        return storage, (
            f"{storage.root} is interrupted: its driver ({seen.get('host')}, pid {seen.get('pid')}) was last "
            f"heard of {seen.get('age_s', 0):.0f}s ago; no job is training it"
        )
    if status not in (inspect.RUNNING, inspect.UNFINISHED):
        return storage, f"{storage.root} is {status}: no job is training it"
    return storage, None


def _error(text: str, code: int) -> int:
    """One line on stderr, whatever the exception's message held."""
    print(" ".join(text.split()), file=sys.stderr)
    return code


_COMMANDS: dict[str, Callable[[argparse.Namespace, dict[str, Any]], int]] = {
    "list": _list,
    "show": _show,
    "plot": _plot,
    "eval": _eval,
    "export": _export,
    "rewind": _rewind,
    "unquarantine": _unquarantine,
    "stop": _stop,
    "stacks": _stacks,
    "profile": _profile,
    "watch": _watch,
}


if __name__ == "__main__":
    sys.exit(main())
