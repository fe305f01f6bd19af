"""The hot spare (``failures.hot_spare``): one idle worker, prepared ahead (imports, task, dataset), that
can take a dead rank's place at once instead of a process started after the failure."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray

from cluster.spec.config import JobConfig
from cluster.worker_group.calls import kill, short
from cluster.worker_group.placement import Slot

logger = logging.getLogger(__name__)


class HotSpare:
    """The spare of one group: its actor (None: no spare), its ``prepare`` call and the node it runs on."""

    def __init__(self) -> None:
        self.actor: Any = None
        self._ready: Any = None
        self.node = ""

    def start(
        self,
        cfg: JobConfig,
        slots: dict[int, Slot],
        nodes: list[tuple[str, str]],
        spawn: Callable[[Slot], Any],
    ) -> str:
        """Start the spare with ``spawn(slot)`` in a bundle of the group's ranks (rank -> its node in
        ``nodes``) and let it prepare; return its state for ``WorkerGroup.spare_note``: "preparing",
        "off" or "off: <why>"."""
        mode = cfg.failures.hot_spare
        if mode is False or cfg.scaling.use_gpu or not slots:
            return "off"
        rank = _spare_bundle(cfg.scaling.cpus_per_worker, nodes) if mode == "auto" else len(nodes) - 1
        if rank is None:
            return (
                "off: no node of the job has a free CPU share for it (failures.hot_spare=auto); "
                "set failures.hot_spare=true to keep one anyway"
            )
        self.actor = spawn(slots[rank])
        self._ready = self.actor.prepare.remote()
        self.node = nodes[rank][0]
        return "preparing"

    def ready_s(self) -> float | None:
        """The seconds the hot spare took to prepare, once it has; None while it prepares or with no spare."""
        if not self.prepared():
            return None
        assert self._ready is not None
        return float(ray.get(self._ready))

    def state(self) -> str | None:
        """ "prepared", "preparing" (its process starting, or importing and loading), or None: no spare, or
        its preparation failed (then it is gone)."""
        if self.actor is None or self._ready is None:
            return None
        if self.prepared():
            return "prepared"
        return "preparing" if self.actor is not None else None

    def prepared(self) -> bool:
        if self.actor is None or self._ready is None:
            return False
        ready, _ = ray.wait([self._ready], timeout=0)
        if not ready:
            return False
        try:
            ray.get(ready[0])
        except Exception as exc:
            logger.warning(
                "the hot spare failed to prepare; a dead rank gets a new process instead: %s", short(exc)
            )
            self.kill()
            return False
        return True

    def take(self) -> Any:
        """The spare's actor, to become a rank of the next group; the group has no spare after."""
        actor, self.actor = self.actor, None
        return actor

    def kill(self) -> None:
        if self.actor is not None:
            kill(self.actor, "the hot spare")
            self.actor = None


def _spare_bundle(share: float, nodes: list[tuple[str, str]]) -> int | None:
    """The bundle (= rank) on the first node with a CPU share (``share``) this job does not use, if any:
    there the spare's preparation (a torch import, the dataset) does not take CPU from training."""
    totals = {n["NodeID"]: float(n.get("Resources", {}).get("CPU", 0)) for n in ray.nodes() if n.get("Alive")}
    used: dict[str, float] = {}
    for node_id, _ in nodes:
        used[node_id] = used.get(node_id, 0.0) + share
    for rank, (node_id, _) in enumerate(nodes):
        if totals.get(node_id, 0.0) - used[node_id] >= share - 1e-9:
            return rank
    return None
