"""Where a group's workers run: the placement groups it reserves (one bundle per rank), the room the
cluster has for more, the wait for Ray to re-place a lost node's bundles, and the drain notices for the
nodes that hold its ranks."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from cluster.core.errors import ResourcesUnavailableError
from cluster.seam.preemption import DrainNotice
from cluster.seam.protocol import Salvage, StartCancelled
from cluster.spec.config import JobConfig
from cluster.worker_group.calls import kill, short

logger = logging.getLogger(__name__)

Slot = tuple[PlacementGroup, int]
"""A placement group and the index of one of its bundles: where one rank runs."""

NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its id: a bundle's label selector keeps it off given nodes."""

NODE_DEAD_WAIT_S = 60.0
"""After a node loss, seconds to wait for Ray to declare the node dead (its health checks; Ray re-places a
placement group's bundles only then) before waiting for room for its ranks."""


def avoid_selector(nodes: list[str], bundles: int) -> list[dict[str, str]]:
    """``bundle_label_selector`` that keeps each of ``bundles`` bundles off ``nodes`` (Ray node ids)."""
    return [{NODE_ID_LABEL: "!in(" + ",".join(nodes) + ")"}] * bundles


@dataclass(frozen=True)
class Resources:
    """What a group hands to the next one in a Salvage: its placement groups and where each rank runs."""

    pg: PlacementGroup | None
    slots: dict[int, Slot]
    extra_pgs: list[PlacementGroup]


class Placement:
    """The placement groups one worker group holds, and the bundle each of its ranks runs in."""

    def __init__(self, cfg: JobConfig, name: Callable[[int], str] | None = None) -> None:
        self.cfg = cfg
        self.name = name
        """Detached placement groups (``cluster.worker_group.pulse``): the name of the n-th one made; None:
        the groups end with the driver's job."""
        self._made = 0
        self.pg: PlacementGroup | None = None
        self.slots: dict[int, Slot] = {}
        """rank -> (placement group, bundle index) it runs in: ``(self.pg, rank)`` unless the rank moved."""
        self.extra_pgs: list[PlacementGroup] = []
        """Placement groups of ranks that moved off a draining node (see ``RayWorkerGroup.prepare_move``)."""
        self.avoid: list[str] = []
        """Quarantined nodes (``cluster.run.quarantine``): no bundle of this group is placed there."""

    def bundle(self) -> dict[str, float]:
        """The resources of one rank."""
        s = self.cfg.scaling
        b: dict[str, float] = {"CPU": s.cpus_per_worker, **s.resources_per_worker}
        if s.use_gpu:
            b["GPU"] = s.gpus_per_worker
        return b

    def available_for(self, n: int) -> bool:
        """Whether the cluster has free resources for ``n`` more ranks now (draining nodes not counted)."""
        avail = ray.available_resources()
        drains = draining_nodes() if self.cfg.failures.preemption else {}
        for node in ray.nodes() if drains or self.avoid else []:
            # free there, but Ray places nothing new on a draining node, nor this job on a quarantined one
            if node["NodeID"] in drains or node["NodeID"] in self.avoid:
                for k, v in node.get("Resources", {}).items():
                    avail[k] = avail.get(k, 0.0) - v
        return all(avail.get(k, 0) >= v * n - 1e-9 for k, v in self.bundle().items())

    def room_without(self, nodes: list[str], n: int) -> bool:
        """Whether the live nodes other than ``nodes`` (and other than the quarantined and draining ones) can
        hold ``n`` bundles of this group by their capacity, whatever runs there now: a node is quarantined
        only when the run can still be placed without it (``cluster.run.quarantine``)."""
        bundle = {k: v for k, v in self.bundle().items() if v > 0}
        out = {*nodes, *self.avoid, *(draining_nodes() if self.cfg.failures.preemption else {})}
        fits = 0
        for node in ray.nodes():
            if not node.get("Alive", False) or node["NodeID"] in out:
                continue
            have = node.get("Resources", {})
            fits += min((int((have.get(k, 0.0) + 1e-9) // v) for k, v in bundle.items()), default=0)
        return fits >= n

    def reserve(self, sizes: list[int], wait_s: float, cancelled: Callable[[], bool] | None = None) -> int:
        """Reserve bundles for ``sizes[0]`` workers, waiting up to ``wait_s``; failing that, the largest
        of the smaller ``sizes`` the cluster grants now. Raise ResourcesUnavailableError otherwise, and
        StartCancelled as soon as ``cancelled()`` (asked about every second of the wait) says so."""
        strategy = self.cfg.scaling.placement_strategy
        if self.slots and len(self.slots) in sizes:
            return len(self.slots)  # adopted from the previous attempt (warm restart): already reserved
        for i, n in enumerate(sizes):
            pg = self.request(n)
            if _granted(pg, wait_s if i == 0 else 2.0, cancelled):
                self.pg = pg
                self.slots = {r: (pg, r) for r in range(n)}
                return n
            remove_placement_group(pg)
        need = ", ".join(f"{k}={v:g}" for k, v in self.bundle().items())
        raise ResourcesUnavailableError(
            f"the cluster did not provide {sizes[0]} workers of {{{need}}} "
            f"(nor the minimum {sizes[-1]}) within "
            f"scaling.resource_wait_s={wait_s:g}s with strategy {strategy}; the cluster has "
            f"{_fmt(ray.cluster_resources())}, free {_fmt(ray.available_resources())}{self._kept_out()}. "
            "Add nodes, lower scaling.num_workers / scaling.min_workers, or raise scaling.resource_wait_s"
        )

    def _kept_out(self) -> str:
        if not self.avoid:
            return ""
        return (
            f"; quarantined node(s) {', '.join(n[:12] for n in self.avoid)} are kept out "
            "(failures.quarantine_after; python -m cluster unquarantine RUN NODE releases one)"
        )

    def request(self, n: int, avoid: list[str] | None = None) -> PlacementGroup:
        """A new placement group of ``n`` bundles, none on the nodes in ``avoid`` nor on a quarantined node
        (nor, Ray's rule, on a draining node); not waited for."""
        nodes = sorted({*(avoid or []), *self.avoid})
        self._made += 1
        return placement_group(
            [self.bundle()] * n,
            strategy=self.cfg.scaling.placement_strategy,
            name=self.name(self._made) if self.name is not None else "",
            lifetime="detached" if self.name is not None else None,
            bundle_label_selector=avoid_selector(nodes, n) if nodes else None,
        )

    def relocate(self, salvage: Salvage | None) -> Salvage | None:
        """A salvage whose ranks run off the quarantined nodes: every rank whose bundle is on one gets a
        bundle elsewhere (a placement group of their own, waited for up to ``scaling.resource_wait_s``) and
        a kept worker there is killed once that room is granted. Deciding to quarantine never costs the
        survivors' memory: with no such room, or with no survivor off those nodes to send the state, the
        salvage is kept as it is (those ranks stay there for this attempt; said in a warning)."""
        if salvage is None or not self.avoid:
            return salvage
        res: Resources = salvage.resources
        tables = {
            pg.id: placement_group_table(pg).get("bundles_to_node_id", {}) for pg, _ in res.slots.values()
        }
        moving = sorted(r for r, (pg, i) in res.slots.items() if str(tables[pg.id].get(i, "")) in self.avoid)
        if not moving:
            return salvage
        actors = {r: a for r, a in salvage.actors.items() if r not in moving}
        if not actors and salvage.actors:
            logger.warning(
                "every survivor (ranks %s) runs on a quarantined node: they are kept there for this attempt, "
                "so that their state in memory is not lost",
                sorted(salvage.actors),
            )
            return salvage
        pg = self.request(len(moving))
        wait_s = self.cfg.scaling.resource_wait_s
        if not _granted(pg, wait_s, None):
            remove_placement_group(pg)
            logger.warning(
                "no room off the quarantined node(s) for ranks %s within scaling.resource_wait_s=%gs: they "
                "stay there for this attempt, every survivor kept",
                moving,
                wait_s,
            )
            return salvage
        for r in moving:
            if r in salvage.actors:
                kill(salvage.actors[r], f"rank {r} (on a quarantined node)")
        slots = {**res.slots, **{r: (pg, i) for i, r in enumerate(moving)}}
        peers: Any = salvage.peers
        if peers is not None:
            peers = {r: p for r, p in peers.items() if r not in moving}
        return dataclasses.replace(
            salvage,
            resources=Resources(res.pg, slots, [*res.extra_pgs, pg]),
            actors=actors,
            peers=peers,
        )

    def hand_over(self, slots: dict[int, Slot]) -> Resources:
        """The placement groups for the next group, whose ranks run in ``slots``; this group holds none."""
        res = Resources(self.pg, slots, list(self.extra_pgs))
        self.pg, self.slots, self.extra_pgs = None, {}, []
        return res

    def adopt(self, res: Resources) -> None:
        self.pg, self.slots, self.extra_pgs = res.pg, dict(res.slots), list(res.extra_pgs)

    def groups(self) -> list[PlacementGroup]:
        """Every placement group this group holds (its ranks' and any other)."""
        pgs = ([self.pg] if self.pg is not None else []) + self.extra_pgs
        pgs += [pg for pg, _ in self.slots.values()]
        return list({pg.id.hex(): pg for pg in pgs}.values())

    def forget(self) -> None:
        """Hold no placement group any more, leaving them to whoever holds them now (a newer driver)."""
        self.pg, self.slots, self.extra_pgs = None, {}, []

    def remove(self) -> None:
        """Give every placement group back to Ray."""
        pgs = ([self.pg] if self.pg is not None else []) + self.extra_pgs
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception as exc:
                logger.warning(
                    "could not remove a placement group (Ray frees it with the job): %s", short(exc)
                )
        self.pg, self.slots, self.extra_pgs = None, {}, []

    def bundles_replaced(self, lost_nodes: set[str]) -> bool:
        """After a node loss: wait until Ray has re-placed the placement group's bundles that were on the
        lost nodes (the survivors' stay where they are), at most ``scaling.resource_wait_s`` once Ray has
        declared the nodes dead (it reschedules bundles only then)."""
        deadline = time.monotonic() + NODE_DEAD_WAIT_S
        while time.monotonic() < deadline:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if not lost_nodes & alive:
                break
            time.sleep(0.1)
        deadline = time.monotonic() + self.cfg.scaling.resource_wait_s
        while True:
            # the bundles the ranks use (a bundle vacated by a move may stay unplaced: it is not used)
            tables = {id(pg): placement_group_table(pg) for pg, _ in self.slots.values()}
            on = {tables[id(pg)].get("bundles_to_node_id", {}).get(i) for pg, i in self.slots.values()}
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if on <= alive - lost_nodes:  # an unplaced bundle maps to no node, or to an empty id
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


def bundle_nodes(pg: PlacementGroup, n: int) -> list[str]:
    """The node each of the first ``n`` bundles of ``pg`` was placed on ("" where none yet)."""
    table = placement_group_table(pg).get("bundles_to_node_id", {})
    return [str(table.get(i, "")) for i in range(n)]


def draining(nodes: list[tuple[str, str]]) -> list[DrainNotice]:
    """Ray's drain notices for the nodes in ``nodes`` (rank -> (node id, ip)), with the ranks on each."""
    out = []
    for node_id, deadline in draining_nodes().items():
        ranks = tuple(r for r, (n, _) in enumerate(nodes) if n == node_id)
        if ranks:
            out.append(DrainNotice(node_id, ranks, deadline))
    return out


def _granted(pg: PlacementGroup, wait_s: float, cancelled: Callable[[], bool] | None) -> bool:
    """Whether Ray grants ``pg`` within ``wait_s``, asking ``cancelled()`` every second meanwhile (removing
    the request and raising StartCancelled when it says so)."""
    ready = pg.ready()
    deadline = time.monotonic() + wait_s
    while True:
        done, _ = ray.wait([ready], timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        if done:
            ray.get(ready)
            return True
        if time.monotonic() >= deadline:
            return False
        if cancelled is not None and cancelled():
            remove_placement_group(pg)
            raise StartCancelled("asked to stop while waiting for resources")


def _fmt(res: dict[str, float]) -> str:
    keep = {k: v for k, v in res.items() if not k.startswith(("node:", "memory", "object_store"))}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"


def draining_nodes() -> dict[str, float | None]:
    """Ray's draining nodes that are still alive: node id (hex) -> deadline in seconds since the epoch, or
    None for a drain without a deadline.

    Ray 2.60 has no public reader for drains: this is the call Ray Train's own preemption watcher makes
    (``ray._private.state.state.get_draining_nodes``, one GCS query; Ray keeps a node in it after it died,
    hence the filter). Isolated here; ``tests/cluster/test_preemption.py`` fails loudly when Ray changes it.
    """
    drains: dict[str, int] = ray._private.state.state.get_draining_nodes()
    if not drains:
        return {}
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return {node: (ms / 1000.0 if ms else None) for node, ms in drains.items() if node in alive}
