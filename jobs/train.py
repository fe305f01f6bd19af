"""Train a model with fault-tolerant DDP on Ray. The same command runs on a laptop and on a cluster.

On this machine (embedded local Ray, 2 CPU workers over gloo, storage in ./runs):

    python -m jobs.train --config jobs/configs/tiny_cpu.yaml
    python -m jobs.train --config jobs/configs/tiny_cpu.yaml --set epochs=5      # resumes, trains 2 more

The tabular example (write its Parquet dataset first):

    python -m jobs.make_tabular --out ./data/tabular
    python -m jobs.train --config jobs/configs/tabular_cpu.yaml

On a Ray cluster (the job's driver runs on the head; --working-dir ships this folder to every worker):

    RAY_AUTH_MODE=token ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python -m jobs.train --config jobs/configs/gpt_gpu.yaml --set storage=s3://bucket/runs

Exit status: 0 when training finished (or was already finished), 1 on a failed run, 2 on a bad config,
130 when stopped before the end. The first Ctrl-C, `ray job stop` (SIGTERM), `python -m cluster stop RUN`
or `training.time_limit_s` running out stops every rank at the next step with a checkpoint there:
resubmitting resumes from it exactly. A second
signal kills the workers at once (committed checkpoints stay). `ray job stop` kills this driver 3 s after its
SIGTERM unless the job's runtime_env sets RAY_JOB_STOP_WAIT_TIME_S higher: give it the time a checkpoint
takes, e.g. --runtime-env-json '{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "120"}}'.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from cluster import ClusterError, ConfigError, JobConfig, load_config, train
from cluster.api import local_ray
from cluster.api.train import ensure_ray, preflight
from cluster.core.urls import join, normalize_url
from cluster.driver.result import result_to_json
from cluster.run.lease import LeaseHeldError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jobs.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", help="YAML job spec, e.g. jobs/configs/tiny_cpu.yaml")
    which.add_argument(
        "--config-file",
        help="the job spec as a JSON file (what cluster.submit ships in the working directory: a command "
        "line is visible to anyone who lists the cluster's jobs)",
    )
    which.add_argument("--config-json", help="the job spec as JSON (kept for scripts of earlier versions)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted, e.g. training.epochs=5; short: name, storage, epochs, workers)",
    )
    p.add_argument("--result-json", help="also write the result object as JSON to this local file")
    p.add_argument(
        "--takeover",
        action="store_true",
        help="train the run even though another job's lease on it is not released (that job is gone, or is "
        "fenced out: its writes are refused from then on)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="try the task here instead (no Ray, nothing written): build the model and datasets, train rank "
        "0's share of two steps and one eval batch, print steps, batch per rank, checkpoint size and memory",
    )
    p.add_argument(
        "--device", choices=["cpu", "cuda"], help="--dry-run's device (default: the job's kind if here)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The package's warnings (a swallowed error and its reason) on stderr; progress lines stay on stdout.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = _load(args)
        preflight(cfg)  # an unknown task or storage the workers cannot see, found before Ray starts
    except json.JSONDecodeError as exc:
        return _refuse(f"config error: the config is not JSON: {exc}")
    except ConfigError as exc:
        return _refuse(f"config error: {exc}")
    if args.dry_run:
        from cluster.api.dryrun import DryRunError, dry_run, format_report

        try:
            print(format_report(dry_run(cfg, args.device), cfg))
        except DryRunError as exc:
            print(f"dry run failed: {exc}", file=sys.stderr)
            return 2
        except ConfigError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        started = ensure_ray(cfg)
    except ConfigError as exc:  # RAY_ADDRESS names no reachable cluster
        return _refuse(f"config error: {exc}")
    # Every rank's error reaches the user through the driver, once: a failure event and its one line. When
    # several ranks fail alike, the driver acts on the first and reads the others' answers once they settle
    # (cluster.worker_group.calls.read_later), so Ray has none to print as an "Unhandled error" traceback.
    # Ray's own switch for those reports as well, for the command line: set in this process only (after
    # Ray started: not inherited by its workers).
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")

    # Outside `train` (which stops cleanly on a first signal), SIGTERM becomes an exception so the
    # finally-blocks kill the workers; committed checkpoints are never touched. Installed after ray.init,
    # which sets SIGTERM handlers of its own (Python and C++) that end the process without that cleanup.
    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    try:
        result = train(cfg, takeover=args.takeover)
    except LeaseHeldError as exc:  # another job trains the run: it is named, nothing was written
        print(f"refused: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except ClusterError as exc:
        print(f"training failed: {_one_line(exc, cfg)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "stopped: workers shut down; the last committed checkpoint is intact", file=sys.stderr, flush=True
        )
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if started:
            local_ray.shutdown()
    if args.result_json:
        with open(args.result_json, "w") as fh:
            fh.write(result_to_json(result))
    if result.status == "stopped":
        print(
            f"result: status=stopped steps={result.global_step} reason={result.stop_reason!r} "
            f"latest_checkpoint={result.latest_checkpoint}"
        )
        return 130
    evaluated = (
        f" eval_loss={result.evaluation['loss']} (step {result.evaluation['global_step']})"
        if result.evaluation
        else ""
    )
    print(
        f"result: status={result.status} steps={result.global_step} loss={result.metrics.get('loss')}"
        f"{evaluated}{' stopped_early' if result.stopped_early else ''} "
        + (f"skipped_steps={[f'{a}-{b}' for a, b in result.skipped_steps]} " if result.skipped_steps else "")
        + f"latest_checkpoint={result.latest_checkpoint}"
    )
    return 0


def _load(args: argparse.Namespace) -> JobConfig:
    """The job spec the command line gives (``--config``, ``--config-file`` or ``--config-json``, then
    ``--set``); ConfigError (or JSONDecodeError) for one that cannot be read."""
    if args.config_file is not None:
        return load_config(data=_read_config_file(args.config_file), overrides=args.overrides)
    if args.config_json is not None:
        return load_config(
            data=_spec(json.loads(args.config_json), "--config-json"), overrides=args.overrides
        )
    return load_config(_readable(args.config), args.overrides)


def _read_config_file(path: str) -> dict[str, object]:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(
            f"--config-file {path!r} is not in the job's working directory ({os.getcwd()}): a .gitignore or "
            ".rayignore there (Ray leaves out what they list) or runtime_env excludes left it out; keep "
            ".cluster/ out of them"
        ) from None
    return _spec(data, f"--config-file {path!r}")


def _spec(data: object, where: str) -> dict[str, object]:
    """A job spec given as JSON is an object of sections; ConfigError for a list, a number..."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} holds {type(data).__name__}, not a job spec (a JSON object of sections)")
    return data


def _readable(path: str) -> str:
    """``--config``: a file that can be read (a folder or an unreadable file is a config error, exit 2)."""
    if os.path.isdir(path):
        raise ConfigError(
            f"--config {path!r} is a folder; pass the YAML file, e.g. jobs/configs/tiny_cpu.yaml"
        )
    if os.path.exists(path) and not os.access(path, os.R_OK):
        raise ConfigError(f"--config {path!r} cannot be read (permissions); pass a readable YAML file")
    return path


def _one_line(exc: BaseException, cfg: JobConfig) -> str:
    """The error's first line, which says what failed and what a rerun does; the rest (the last failure's
    traceback) is in the run's failure event, which the line points to."""
    first, _, rest = str(exc).strip().partition("\n")
    if not rest.strip():
        return first
    run = join(normalize_url(cfg.storage.url), cfg.name)
    return f"{first} (the last failure's traceback: its failure event in {run}/events)"


def _refuse(text: str) -> int:
    """A mistake found before anything started: one line on stderr, exit status 2."""
    print(" ".join(text.split()), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
