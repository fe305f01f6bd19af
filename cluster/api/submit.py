"""Submit a job to a Ray cluster from Python (``cluster.submit``), as ``ray job submit`` does from a shell:
the driver runs on the cluster's head, not in this process, so a laptop that sleeps or a notebook that
restarts does not end the run. The config is checked here first (a mistake never costs a submission), the
returned :class:`SubmittedJob` follows the run through its storage and stops it cleanly.

The job's config travels as a file inside the shipped working directory (``.cluster/job-<id>.json``, there
only while the directory is uploaded), never on the entrypoint's command line: ``ray job list``, the
dashboard and ``ps`` on the head show a command line to anyone who can see the cluster."""

from __future__ import annotations

import functools
import json
import os
import shlex
import time
import uuid
from dataclasses import dataclass
from typing import Any, TextIO

from cluster.core.errors import ConfigError
from cluster.core.urls import is_local, join, normalize_url
from cluster.run.folder import RunFolder
from cluster.spec.config import JobConfig
from cluster.spec.load import load_config

EXCLUDES = [".venv", ".git", "runs", "data", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache"]
"""Left out of the shipped working directory by default (Ray also honours its .gitignore files)."""
STOP_WAIT_S = 600
"""``RAY_JOB_STOP_WAIT_TIME_S`` for a submitted job: how long ``ray job stop`` (and :meth:`SubmittedJob.stop`)
lets the driver stop every rank with a checkpoint before Ray kills it (Ray's default is 3 s)."""
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
CONFIG_DIR = ".cluster"
"""Folder of ``working_dir`` the job's config file is written to while the folder is uploaded (keep it out of
``.gitignore``/``.rayignore``: Ray leaves out what they list)."""


@dataclass
class SubmittedJob:
    """A job running on a Ray cluster: its Ray job id, and its run in storage."""

    job_id: str
    address: str | None
    run_url: str
    config: JobConfig

    @functools.cached_property
    def folder(self) -> RunFolder:
        """The run's folder (``cluster.run.folder``), made on first use and kept: what the run's status
        and its events are read from."""
        return RunFolder.at(self.run_url, self.config.storage.options)

    def _client(self) -> Any:
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.address)

    def status(self) -> str:
        """Ray's job status: ``PENDING``, ``RUNNING``, ``SUCCEEDED``, ``FAILED`` or ``STOPPED``."""
        return str(self._client().get_job_status(self.job_id).value)

    def run_status(self) -> str:
        """The run's status from its storage (``python -m cluster list``'s: running, finished, ...)."""
        from cluster.inspect import live_status, read_events

        storage = self.folder.storage
        return live_status(storage, read_events(storage))

    def logs(self) -> str:
        """The driver's output so far (progress lines, failures, the result line)."""
        return str(self._client().get_job_logs(self.job_id))

    def stop(self) -> None:
        """Stop cleanly: every rank stops at its next step with a checkpoint there (SIGTERM to the driver,
        which was given ``STOP_WAIT_S`` to finish). Returns at once; :meth:`wait` for the end."""
        self._client().stop_job(self.job_id)

    def wait(self, timeout_s: float | None = None, out: TextIO | None = None, every_s: float = 5.0) -> str:
        """Until the job ends (or ``timeout_s``, then TimeoutError); with ``out``, print the run's notable
        events as they land (``python -m cluster watch``'s lines). Returns Ray's final job status."""
        from cluster.inspect import WATCHED, event_line, read_events

        storage = self.folder.storage
        seen = len(read_events(storage)) if out is not None else 0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            status = self.status()
            if out is not None:
                events = read_events(storage)
                for e in events[seen:]:
                    if e.get("event") in WATCHED:
                        out.write(f"{event_line(e)}\n")
                seen = len(events)
            if status in TERMINAL:
                return status
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} is still {status} after {timeout_s:g}s")
            time.sleep(every_s)


def submit(
    config: str | JobConfig,
    overrides: list[str] | None = None,
    address: str | None = None,
    working_dir: str = ".",
    runtime_env: dict[str, Any] | None = None,
    job_id: str | None = None,
    takeover: bool = False,
) -> SubmittedJob:
    """Submit ``python -m jobs.train`` with ``config`` (a YAML path inside ``working_dir``, with ``overrides``
    as ``--set``; or a ``JobConfig``) to the Ray cluster at ``address`` (its dashboard, e.g.
    ``http://127.0.0.1:8265``; default ``RAY_ADDRESS``), shipping ``working_dir`` (your task's code, the
    ``cluster`` package) to every node. ``runtime_env`` adds to the one built here (``excludes``,
    ``env_vars``). The config is loaded and checked here first: ConfigError before anything is submitted.
    The resolved config (overrides applied) reaches the job as a file (the module docstring). One job
    trains a run at a time (``cluster.run.lease``): while another holds it, this job fails with exit 2 naming
    it; ``takeover=True`` takes the run from a job that is gone."""
    overrides = list(overrides or [])
    root = os.path.abspath(working_dir)
    if isinstance(config, JobConfig):
        if overrides:
            raise ConfigError("overrides go with a config file; apply them to the JobConfig instead")
        cfg = config
    else:
        cfg = load_config(config, overrides)
        if os.path.relpath(os.path.abspath(config), root).startswith(".."):
            raise ConfigError(
                f"config {config!r} is outside working_dir {root!r}, which is all the cluster receives; move "
                "it inside, or pass working_dir= a folder that holds it"
            )
    remote = address is not None and not any(h in address for h in ("127.0.0.1", "localhost", "[::1]"))
    if remote and is_local(cfg.storage.url):
        raise ConfigError(
            f"storage.url={cfg.storage.url!r} is a folder on the machine that writes it, and this job runs "
            f"on the cluster at {address}: its nodes would each write their own. Use storage the cluster "
            "shares (s3://, gs://, a mount every node has)"
        )
    env = dict(runtime_env or {})
    env["working_dir"] = root
    env.setdefault("excludes", EXCLUDES)
    env["env_vars"] = {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S), **env.get("env_vars", {})}
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(address)
    except ConnectionError as exc:
        raise ConfigError(
            f"no Ray cluster answers at {address or 'RAY_ADDRESS (unset: a local one)'} ({exc}): pass "
            "address= the head's dashboard (http://HEAD:8265, through `ray dashboard ray_cluster.yaml`), or "
            "start one with `ray start --head`"
        ) from None
    rel = write_config_file(cfg, root)
    try:  # the upload of working_dir happens inside submit_job: the file is needed until it returns
        command = entrypoint(rel, takeover)
        submitted = client.submit_job(entrypoint=command, runtime_env=env, submission_id=job_id)
    finally:
        remove_config_file(root, rel)
    run_url = join(normalize_url(cfg.storage.url), cfg.name)
    return SubmittedJob(str(submitted), address, run_url, cfg)


def entrypoint(config_file: str, takeover: bool = False) -> str:
    """The job's command line: names the config file (relative to the working directory), holds no value
    of it."""
    return shlex.join(
        ["python", "-m", "jobs.train", "--config-file", config_file, *(["--takeover"] if takeover else [])]
    )


def write_config_file(cfg: JobConfig, root: str) -> str:
    """Write ``cfg`` whole (the driver needs its secrets) to a new file of :data:`CONFIG_DIR` in ``root``,
    readable by this user only; return its path relative to ``root``."""
    rel = f"{CONFIG_DIR}/job-{uuid.uuid4().hex[:16]}.json"
    os.makedirs(os.path.join(root, CONFIG_DIR), exist_ok=True)
    fd = os.open(os.path.join(root, rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(cfg.to_dict(redact=False), fh)
    return rel


def remove_config_file(root: str, rel: str) -> None:
    """Remove the file :func:`write_config_file` wrote, and :data:`CONFIG_DIR` once it is empty."""
    os.remove(os.path.join(root, rel))
    try:
        os.rmdir(os.path.join(root, CONFIG_DIR))
    except OSError:  # another submission's file is still there
        pass
