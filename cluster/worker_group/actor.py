"""The Ray actor that runs one rank: a thin wrapper over :class:`cluster.rank.worker.Worker`, and the check
that every rank imported the same ``cluster`` code as the driver.

The actor runs with ``max_concurrency=2`` so the driver's heartbeat call (``heartbeat``) is answered while
``run_epoch`` is busy training. Its class keeps the name ``_WorkerActor``: Ray titles the process
``ray::_WorkerActor...`` and tests find the workers by that title.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import logging
import os
import threading
from functools import cache
from typing import Any

import ray

from cluster.core.errors import ConfigError
from cluster.core.imports import gc_paused
from cluster.rank.dist import listen_on, store_address
from cluster.rank.process import worker_env
from cluster.rank.watchdog import DriverWatch
from cluster.rank.worker import Worker
from cluster.run.checkpoint import CommitRecord
from cluster.seam.adoption import RankReport
from cluster.seam.peers import PeerPlan, PeerState
from cluster.seam.protocol import EpochResult, Heartbeat, SetupInfo
from cluster.spec.config import JobConfig
from cluster.spec.schedule import Window
from cluster.worker_group.orphan import EpochOutcome, commit_fence, end_orphan, report
from cluster.worker_group.pulse import Lineage, generation_of

logger = logging.getLogger(__name__)


class _WorkerActor:
    def __init__(
        self,
        cfg: JobConfig,
        rank: int,
        world_size: int,
        run_url: str,
        attempt: int,
        task_cls: Any = None,
        lineage: Lineage | None = None,
    ) -> None:
        with worker_env(cfg):
            self.worker = Worker(cfg, rank, world_size, run_url, attempt, task_cls)
        self.lineage = lineage
        """Set on a detached rank (``cluster.worker_group.pulse``): it outlives its driver."""
        self.watch = DriverWatch(generation_of(cfg), cfg.failures.orphan_timeout_s, self._orphaned)
        """The generation served, the driver's last contact, the orphan timeout (``rank.watchdog``)."""
        self.epochs = EpochOutcome()
        if lineage is not None:
            self.watch.start()
        # DistributedDataParallel's first construction imports torch._dynamo (~820 modules, 0.7-2.6 s on
        # 2 cores): on every rank's critical path. Import it now, while the driver checks the ranks' code
        # and hands out the store's address. (init_process_group waits for an import in progress: it
        # touches torch._dynamo when the module is in sys.modules. So the import overlaps the driver's
        # round trips, not the rendezvous itself.)
        threading.Thread(target=_import_dynamo, name="cluster-import-dynamo", daemon=True).start()

    def call(self, generation: int, name: str, *args: Any, **kwargs: Any) -> Any:
        """Every call of a driver (``cluster.worker_group.calls.Stamped``): refused unless ``generation`` is
        the one this rank serves; counts as the driver's contact."""
        self.watch.contact(generation)
        return getattr(self, name)(*args, **kwargs)

    def touch(self) -> None:
        """The driver's pulse (``cluster.worker_group.pulse``): ``call`` counted it."""

    def report(self) -> RankReport:
        """What this rank says of itself to a driver that looks for ranks to adopt (not a contact)."""
        return report(self.worker, self.lineage, self.watch.generation, self.epochs)

    def serve(self, generation: int, env: dict[str, str]) -> int:
        """Adopted by the driver of ``generation``: only its calls count from now on, rank 0's commits are
        fenced by it, and a later setup sees its ``env`` (its probe token and generation). Returns the pid."""
        self.watch.serve(generation)
        os.environ.update(env)
        if self.lineage is not None:
            self.lineage = dataclasses.replace(self.lineage, generation=generation)
        return os.getpid()

    def collect(self) -> EpochResult:
        """The result of the last epoch this rank was given (waiting for its end): what a driver that adopted
        it collects in place of the dead driver's call."""
        return self.epochs.collect()

    def _orphaned(self, silent_s: float) -> None:
        """No driver for ``failures.orphan_timeout_s``: free the placement group (Ray ends every rank in it)
        and end this process."""
        logger.warning(
            "no driver contacted this rank (rank %d) for %.0fs (failures.orphan_timeout_s): it stops and "
            "frees its resources",
            self.worker.rank,
            silent_s,
        )
        end_orphan()

    def node(self) -> tuple[str, str]:
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address()

    def code(self) -> tuple[str, str]:
        return code_fingerprint()

    def gpu_ids(self) -> list[str]:
        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]

    def use_gpus(self, visible: str, index: int) -> str:
        return self.worker.use_gpus(visible, index)

    def bind_store(self, spans_nodes: bool = True) -> tuple[str, int]:
        """Bind rank 0's store on the one address of ``cluster.rank.dist.store_address``; return it and the
        port (what every rank connects to)."""
        s = self.worker.cfg.scaling
        host = store_address(ray.util.get_node_ip_address(), spans_nodes, s.socket_ifname)
        return host, self.worker.bind_store(ipv4=":" not in host, host=host)

    def connect(self, host: str, port: int) -> None:
        self.worker.connect(host, port)

    def setup(
        self,
        host: str,
        port: int,
        peers: PeerPlan | None = None,
        skips: list[Window] | None = None,
        rollback: Window | None = None,
    ) -> SetupInfo:
        self._listen_near(host)
        session = self.worker.setup(host, port, peers, skips, rollback)
        if self.lineage is not None:  # rank 0 commits only for a live driver of the generation it serves
            session.store.fence = commit_fence(self.watch, session.store.storage)
        return session.info

    def _listen_near(self, store_host: str) -> None:
        """This rank's gloo listens on loopback when the store does (the group is on one node), else on
        this node's address of ``cluster.rank.dist.store_address``: never on every interface."""
        if ipaddress.ip_address(store_host).is_loopback:
            listen_on(store_host)
        else:
            node_ip = ray.util.get_node_ip_address()
            listen_on(store_address(node_ip, True, self.worker.cfg.scaling.socket_ifname))

    def run_epoch(
        self, epoch: int, start_step: int, dispatch: int = 0, evaluate_first: bool = False, seq: int = 0
    ) -> EpochResult:
        with self.epochs.running(epoch, start_step, dispatch):
            return self.epochs.done(self.worker.run_epoch(epoch, start_step, dispatch, evaluate_first, seq))

    def hold_stop(self, dispatch: int) -> int:
        return self.worker.hold_stop(dispatch)

    def stop_at(self, dispatch: int, step: int, checkpoint: bool) -> None:
        self.worker.stop_at(dispatch, step, checkpoint)

    def heartbeat(self) -> Heartbeat:
        return self.worker.heartbeat()

    def stacks(self) -> list[dict[str, Any]]:
        return self.worker.stacks()

    def profile(self, req_id: str, steps: int, folder: str) -> None:
        self.worker.profile(req_id, steps, folder)

    def finish(self) -> list[CommitRecord]:
        return self.worker.finish()

    def shutdown(self) -> None:
        self.worker.shutdown()

    def reset(self, rank: int, world_size: int, attempt: int) -> None:
        self.worker.reset(rank, world_size, attempt)

    def release(self, rank: int, world_size: int, attempt: int) -> PeerState | None:
        return self.worker.release(rank, world_size, attempt)

    def abort(self) -> bool:
        return self.worker.abort()

    def prepare(self) -> float:
        return self.worker.prepare()


@cache
def _import_dynamo() -> None:
    try:
        with gc_paused():  # less CPU without the collector (cluster.core.imports)
            import torch._dynamo  # noqa: F401
    except Exception as exc:  # setup imports it again (and raises there if it must)
        logger.warning("importing torch._dynamo ahead of DDP failed: %s", exc)


TRAINING_FOLDERS = ("core", "spec", "run", "seam", "data", "rank", "worker_group")
"""The folders of ``cluster`` whose code a worker runs (docs/layout.md): the layers a rank imports. The
driver, the operator tools (``inspect``, ``__main__``) and the entry points do not change what trains."""


def _sources(here: str) -> list[str]:
    """Every ``.py`` file of ``TRAINING_FOLDERS`` under ``here``, relative to it, in a fixed order."""
    out = []
    for folder in TRAINING_FOLDERS:
        for root, dirs, files in os.walk(os.path.join(here, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            out += [os.path.relpath(os.path.join(root, f), here) for f in sorted(files) if f.endswith(".py")]
    return out


def code_fingerprint() -> tuple[str, str]:
    """(directory, sha256 of its sources) of the ``cluster`` package this process imported."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return here, sources_digest(here)


def sources_digest(here: str) -> str:
    """sha256 of the ``TRAINING_FOLDERS`` sources of the ``cluster`` package at ``here``."""
    digest = hashlib.sha256()
    for path in _sources(here):
        with open(os.path.join(here, path), "rb") as fh:
            digest.update(path.encode() + b"\0" + fh.read())
    return digest.hexdigest()


def check_same_code(codes: list[tuple[str, str]], nodes: list[tuple[str, str]]) -> None:
    """Refuse to train when a worker imported a different ``cluster`` than the driver (e.g. a node's
    installed copy instead of the job's ``--working-dir``): mixed code silently breaks checkpoints."""
    here, mine = code_fingerprint()
    for rank, (where, theirs) in enumerate(codes):
        if theirs != mine:
            raise ConfigError(
                f"rank {rank} on {nodes[rank][1]} imports the cluster package from {where} (sources "
                f"{theirs[:12]}) but the driver runs {here} ({mine[:12]}): "
                "the workers would not run the job's "
                "code. Submit with `ray job submit --working-dir <repo root>` (Ray puts it first on every "
                "worker's PYTHONPATH), or install the same version of this package on every node"
            )
