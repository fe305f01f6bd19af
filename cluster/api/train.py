"""The entry points: train a job from Python (``cluster.train``), the checks that run before anything starts,
connecting to (or starting) Ray, and Ctrl-C / ``ray job stop`` handling. A run returns a
:class:`cluster.driver.result.Result`.

``python -m jobs.train`` and ``cluster.submit`` reach the same :func:`train`; the state machine that runs the
job is :class:`cluster.driver.driver.Driver`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TextIO

from cluster.api import local_ray
from cluster.core.errors import ConfigError
from cluster.driver.result import Result
from cluster.run.folder import RunFolder
from cluster.run.lease import Lease
from cluster.seam.adoption import Adoption
from cluster.seam.protocol import WorkerGroup
from cluster.spec.config import JobConfig, resolve_notify_url
from cluster.spec.task import Task, task_path

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from cluster.driver.driver import Driver


def ray_group_factory(
    cfg: JobConfig, run_url: str, attempt: int, task_cls: Any = None, detached: bool = False
) -> WorkerGroup:
    """The driver's default group factory: a gang of Ray actors (``detached``: they outlive the driver, on
    a running cluster)."""
    from cluster.worker_group import RayWorkerGroup

    return RayWorkerGroup(cfg, run_url, attempt, task_cls, detached=detached)


def on_running_cluster() -> bool:
    """Whether this job trains on a running Ray cluster (``RAY_ADDRESS``: ``ray job submit``,
    ``cluster.submit``), where its ranks outlive a driver that dies and the next submission adopts them;
    not on the embedded Ray, which dies with the driver (docs/failures.md)."""
    return bool(os.environ.get("RAY_ADDRESS"))


def adopt_previous(cfg: JobConfig, folder: RunFolder, lease: Lease, task: Any) -> Adoption | None:
    """The ranks the run's previous driver left running, adopted or stopped (``cluster.worker_group``)."""
    from cluster.driver.starting import group_config
    from cluster.worker_group.adoption import adopt

    return adopt(group_config(cfg, "", lease), folder.url, lease.generation, task, folder.storage)


def ensure_ray(cfg: JobConfig) -> bool:
    """Connect to the Ray in ``RAY_ADDRESS`` (set inside ``ray job submit``) or start an embedded one.

    Returns True when this call started Ray (the caller shuts it down).
    """
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        _check_reachable(os.environ["RAY_ADDRESS"])
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return True
    s = cfg.scaling
    local_ray.start(
        max(os.cpu_count() or 1, int(s.num_workers * s.cpus_per_worker + 0.999))
    )  # fits: preflight
    return True


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """ConfigError when nothing answers at ``RAY_ADDRESS``'s host and port: ``ray.init`` would retry for
    minutes and then fail with a wall of warnings. ``auto`` and addresses without a port are Ray's to find."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number
        raise ConfigError(f"RAY_ADDRESS={address!r} must look like host:port (e.g. 10.0.0.1:6379)") from None
    if not host or port is None or address == "auto":
        return
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(
            f"RAY_ADDRESS={address!r}: nothing answers at {host}:{port} ({exc.strerror or exc}); start the "
            "cluster (ray start --head, or ray up), fix the address, or unset RAY_ADDRESS to train on an "
            "embedded local Ray"
        ) from None


def check_cluster(cfg: JobConfig) -> None:
    """Fail before anything starts when the cluster can never run this job: GPUs asked for and none there,
    a custom resource (``scaling.resources_per_worker``) that no node has."""
    import ray

    total = ray.cluster_resources()
    if cfg.scaling.use_gpu and total.get("GPU", 0) < 1:
        raise ConfigError(
            "scaling.use_gpu=true but the Ray cluster has no GPUs; "
            "set scaling.use_gpu=false to train on CPUs, "
            "or connect to a cluster with GPU nodes (RAY_ADDRESS)"
        )
    for name, amount in cfg.scaling.resources_per_worker.items():
        if total.get(name, 0) < amount:
            have = ", ".join(sorted(k for k in total if k not in _BUILTIN and not k.startswith("node:")))
            raise ConfigError(
                f"scaling.resources_per_worker asks for {amount:g} {name!r} per worker, but no node of the "
                f"Ray cluster has it (custom resources there: {have or 'none'}); start the nodes with "
                f"--resources='{{\"{name}\": N}}', or remove it from scaling.resources_per_worker"
            )


_BUILTIN = {"CPU", "GPU", "memory", "object_store_memory", "accelerator_type"}


def check_embedded_fits(cfg: JobConfig) -> None:
    """When the job will start an embedded Ray (no ``RAY_ADDRESS``, none running in this process): the
    workers' CPUs must fit this machine, else N torch processes would share fewer cores and crawl; a
    ``scaling.socket_ifname`` must be an interface of this machine."""
    ray = sys.modules.get("ray")
    if os.environ.get("RAY_ADDRESS") or (ray is not None and ray.is_initialized()):
        return
    s, cores = cfg.scaling, os.cpu_count() or 1
    names = [n for _, n in socket.if_nameindex()]
    if s.socket_ifname is not None and s.socket_ifname not in names:
        raise ConfigError(
            f"scaling.socket_ifname={s.socket_ifname!r} is not a network interface of this machine (it has "
            f"{', '.join(names)}), where the embedded Ray runs every rank; name one of them, or remove it"
        )
    need = s.num_workers * s.cpus_per_worker
    if need > cores + 1e-9:
        fit = int(cores // s.cpus_per_worker) if s.cpus_per_worker > 0 else s.num_workers
        raise ConfigError(
            f"scaling.num_workers={s.num_workers} x scaling.cpus_per_worker={s.cpus_per_worker:g} = "
            f"{need:g} CPUs, but this machine has {cores} and the embedded Ray runs on it alone: "
            f"{fit} workers of {s.cpus_per_worker:g} CPU fit. Lower scaling.num_workers (or "
            "scaling.cpus_per_worker, to share cores on purpose), or connect to a Ray cluster (RAY_ADDRESS)"
        )


def preflight(cfg: JobConfig, task: type[Task] | None = None, folder: RunFolder | None = None) -> None:
    """Checks that need no Ray and write nothing, run before Ray starts: the task imports (unless given as
    a class), and the storage is one that the workers (other processes, often other machines) can see.
    ``folder``: the run's (``cfg``'s when not given), read for its checkpoints when ``init_from`` is set."""
    from cluster.spec.task import load_task_class

    if task is None:
        load_task_class(cfg.task)  # an unknown task is a config error, found before anything starts
    resolve_notify_url(cfg.tracking)  # env:NAME set where the driver runs
    if cfg.training.init_from is not None:
        from cluster.run.restore import check_init_from

        run = folder or RunFolder.of(cfg)
        if not run.checkpoints.list():  # a run that resumes from its own checkpoint ignores init_from
            check_init_from(cfg.training.init_from, cfg.training.init_from_step, cfg.storage.options)
    check_embedded_fits(cfg)
    if cfg.storage.url.strip().lower().startswith("memory://"):
        raise ConfigError(
            f"storage.url={cfg.storage.url!r}: memory:// lives inside one process, and the workers are Ray "
            "actors in other processes that would each see an empty store; use a local folder (./runs), "
            "a shared mount, or an object store (s3://, gs://)"
        )


def train(
    cfg: JobConfig,
    out: TextIO | None = None,
    task: type[Task] | None = None,
    takeover: bool = False,
    lease: Lease | None = None,
) -> Result:
    """Run (or resume) the job described by ``cfg`` to completion and return its Result.

    One job trains a run at a time: while another job's lease on the run beats, this one is refused
    (LeaseHeldError) before anything is written; ``takeover=True`` takes the run from a job that is gone
    (or fences out one that is not: its writes are refused from then on). ``lease``: one already taken
    (``Lease.take_for``), released when the run ends.

    ``task``: the Task class itself instead of ``cfg.task``'s import path (which then records it): sent to
    the workers by value, so a class defined in a notebook or in the running script works. Uses the Ray
    cluster in ``RAY_ADDRESS`` or an already initialised one; otherwise starts an embedded local Ray and
    shuts it down afterwards.
    """
    from cluster.driver.driver import Driver

    asked_at = time.time()  # the goodput ledger's start: Ray's start counts as the run's
    if task is not None:
        cfg = dataclasses.replace(cfg, task=task_path(task))
    folder = RunFolder.of(cfg)  # the run's storage, made once and handed to the preflight, lease and driver
    preflight(cfg, task, folder)
    started = False
    try:
        started = ensure_ray(cfg)
        check_cluster(cfg)  # refusals write nothing: the lease is taken after them
        say = None if out is None else lambda t: print(t, file=out)
        lease = lease or Lease.take_for(cfg, takeover, say, folder)
        detached = on_running_cluster()
        factory = functools.partial(ray_group_factory, task_cls=task, detached=detached)
        adoption = adopt_previous(cfg, folder, lease, task) if detached else None
        driver = Driver(
            cfg,
            group_factory=factory,
            out=out,
            lease=lease,
            started_at=asked_at,
            folder=folder,
            adoption=adoption,
        )
        with stop_on_signals(driver):
            return driver.run()
    finally:
        if lease is not None:
            lease.release()  # (the driver released it already when it ran)
        if started:
            local_ray.shutdown()


@contextlib.contextmanager
def stop_on_signals(driver: Driver) -> Iterator[None]:
    """While ``driver`` runs in the main thread: the first SIGINT (Ctrl-C) or SIGTERM (``ray job stop``)
    stops it cleanly (``Driver.request_stop``: a checkpoint at the next step, status ``stopped``); a second
    raises KeyboardInterrupt, which kills the workers at once. The previous handlers come back after.
    Installed after ``ray.init``, whose own SIGTERM handler would end the process without the checkpoint."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names: dict[int, str] = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: object) -> None:
        if driver.stopping:
            raise KeyboardInterrupt(f"{names.get(signum, signum)} again while stopping")
        driver.request_stop(names.get(signum, str(signum)))  # only sets a field: the loop prints and acts

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
