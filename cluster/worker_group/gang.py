"""The live gang of a Ray worker group as the salvage reads and changes it (``cluster.worker_group.salvage``):
its actors, their nodes, pids and pending calls, the placement, the hot spare, a move in progress.

:class:`Gang` is what :class:`cluster.worker_group.ray_group.RayWorkerGroup` is to the salvage: it names
what the salvage may touch, so that the salvage does not import the group that calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ray.util.placement_group import PlacementGroup

from cluster.spec.config import JobConfig
from cluster.worker_group.placement import Placement
from cluster.worker_group.spare import HotSpare


@dataclass
class MoveInProgress:
    """Replacements being placed and prepared for ``ranks`` (``RayWorkerGroup.prepare_move``)."""

    ranks: list[int]
    pg: PlacementGroup
    placed: Any
    actors: dict[int, Any] | None = None
    prepared: list[Any] = field(default_factory=list)


class Gang(Protocol):
    """The parts of a running Ray worker group that a salvage reads and changes."""

    cfg: JobConfig
    actors: list[Any]
    """rank -> its actor."""
    nodes: list[tuple[str, str]]
    """rank -> (Ray node id, ip) it runs on."""
    pids: list[int]
    """rank -> its process id (on its node), once set up."""
    pending: list[Any]
    """rank -> its call of the running (or last) epoch."""
    beats: dict[int, Any]
    """rank -> heartbeat call not yet collected."""
    world_size: int
    placement: Placement
    spare: HotSpare
    move: MoveInProgress | None

    def cancel_move(self) -> None: ...
