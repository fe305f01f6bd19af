"""Ranks that outlive their driver (docs/failures.md, "driver dies"): their names, and the driver's pulse.

On a running Ray cluster (``RAY_ADDRESS``: ``ray job submit``, ``cluster.submit``) a group's ranks and
placement groups are detached: they live on when the driver's process dies, so that the next submission of
the run can adopt them (``cluster.worker_group.adoption``). Each rank is named in the product's namespace
after its run (a digest of the run's URL), the lease generation of the driver that made it, the attempt and
its role, so that the next driver finds them and nothing else.

The driver that holds them pulses them (a ``touch`` call stamped with its generation) every
``pulse_every(failures.orphan_timeout_s)`` seconds from a thread of its own, whatever its main loop does
(waiting for room, backing off): a rank whose driver stops pulsing commits nothing (a few pulses later) and
stops by itself after the orphan timeout (``cluster.rank.watchdog``).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from cluster.core.errors import StorageError
from cluster.rank.watchdog import pulse_every
from cluster.run.folder import RunFolder
from cluster.run.lease import GENERATION_ENV, fence_check
from cluster.spec.config import JobConfig
from cluster.worker_group.calls import Stamped, short

logger = logging.getLogger(__name__)

NAMESPACE = "cluster-ranks"
"""The Ray namespace of every detached rank of this product."""


def run_key(run_url: str) -> str:
    """16 hex digits naming a run (its storage URL and name) in actor names."""
    return hashlib.sha256(run_url.rstrip("/").encode()).hexdigest()[:16]


def generation_of(cfg: JobConfig) -> int:
    """The lease generation the driver told its workers (``cluster.driver.starting.group_config``); 0 when
    it holds none (a driver built without a lease, in tests)."""
    return int(cfg.scaling.env.get(GENERATION_ENV, "0") or 0)


@dataclass(frozen=True)
class Lineage:
    """Who a detached rank belongs to: its run and the lease generation of the driver that made it."""

    run: str
    """``run_key`` of the run's URL."""
    generation: int
    bundle: int = -1
    """The bundle of its placement group a rank runs in (the group's lineage: -1)."""

    def actor_name(self, attempt: int, what: str) -> str:
        return f"{self.run}:g{self.generation}:a{attempt}:{what}"

    def pg_name(self, attempt: int, n: int) -> str:
        return f"{self.run}:g{self.generation}:a{attempt}:pg{n}"


SPARE_ROLE = "spare"
"""The role in a detached hot spare's name (``Lineage.actor_name``): a spare that became a rank runs in the
bundle it was started in, not in the dead rank's it took over (``cluster.worker_group.salvage``)."""


def parse_name(name: str) -> tuple[str, int] | None:
    """(run key, generation) of a detached rank's name; None for another name."""
    parts = name.split(":")
    if len(parts) < 4 or not parts[1].startswith("g") or not parts[1][1:].isdigit():
        return None
    return parts[0], int(parts[1][1:])


def stale_placement_groups(
    table: dict[str, dict[str, Any]], run: str, generation: int, keep: Collection[str] = ()
) -> list[str]:
    """The ids of the placement groups in ``table`` (``ray.util.placement_group_table()``: id -> entry with
    ``name`` and ``state``) that run ``run``'s drivers of lease generations older than ``generation`` made
    and that nobody holds now: not removed yet and not in ``keep`` (the ids of an adopted group's). Their
    ranks are gone (killed, or never adopted), so no orphan's timeout will free them. A newer generation's
    (a driver that took the run over) and this generation's own are never listed."""
    out = []
    for pg_id, entry in table.items():
        parsed = parse_name(str(entry.get("name") or ""))
        if parsed is None or parsed[0] != run or parsed[1] >= generation:
            continue
        if entry.get("state") == "REMOVED" or pg_id in keep:
            continue
        out.append(pg_id)
    return sorted(out)


class Pulse:
    """This driver's pulse to its detached ranks: one thread, one ``touch`` per rank per interval. A rank
    that is gone (or refuses: it was adopted by a newer driver) is dropped."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._actors: list[Stamped] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, actor: Stamped) -> None:
        with self._lock:
            self._actors.append(actor)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="cluster-rank-pulse", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        stop = threading.Event()
        while not stop.wait(self.every_s):
            try:
                self.beat()
            except Exception as exc:  # Ray shut down under it (the run ended): nothing left to pulse
                logger.debug("the ranks' pulse stops: %s", short(exc))
                return

    def beat(self) -> None:
        with self._lock:
            actors = list(self._actors)
        if not actors:
            return
        refs = [a.touch.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.every_s)
        gone = set()
        for actor, ref in zip(actors, refs):
            if ref not in ready:
                continue  # busy (a call queued behind two long ones): the next pulse tries again
            try:
                ray.get(ref)
            except (RayActorError, RayTaskError) as exc:
                gone.add(id(actor))
                logger.debug("a rank no longer takes this driver's pulse: %s", short(exc))
        if gone:
            with self._lock:
                self._actors = [a for a in self._actors if id(a) not in gone]


_pulse: Pulse | None = None


def pulse(cfg: JobConfig) -> Pulse:
    """This process's pulse (made at the first detached rank)."""
    global _pulse
    if _pulse is None:
        _pulse = Pulse(pulse_every(cfg.failures.orphan_timeout_s))
    return _pulse


def detached_options(lineage: Lineage, attempt: int, what: str) -> dict[str, Any]:
    """The Ray actor options of a detached rank: it lives on without its driver, under a name the next
    driver looks for. Three calls at once: a dead driver's epoch, the next driver's ``collect`` of it, and
    its heartbeats and pulse."""
    return {
        "lifetime": "detached",
        "namespace": NAMESPACE,
        "name": lineage.actor_name(attempt, what),
        "max_concurrency": 3,
    }


def taken_over(cfg: JobConfig, run_url: str, generation: int) -> bool:
    """Whether a newer lease generation than ``generation`` holds the run (one listing of its lease).
    Storage that cannot be read counts as not taken over: the driver ends its ranks as it always did."""
    try:
        return fence_check(RunFolder.at(run_url, cfg.storage.options).storage, generation) is not None
    except StorageError as exc:
        logger.warning("could not read the run's lease (its ranks are ended): %s", exc)
        return False
