"""The Ray side of the workers: the implementation of :class:`cluster.seam.protocol.WorkerGroup` on Ray.

- ``ray_group``: :class:`RayWorkerGroup` (start and rendezvous, epochs, heartbeats, stop, moves, shutdown);
- ``actor``: the Ray actor wrapping :class:`cluster.rank.worker.Worker`, and the same-code check;
- ``placement``: placement groups, room for more ranks, drain notices;
- ``spare``: the hot spare;
- ``classify``: Ray's and the actors' errors as a :class:`cluster.core.errors.Failure`;
- ``salvage``: workers kept for the next group, after a failure or a stop (over the ``gang``: what it may
  read and change of the live group);
- ``suspect``: ending a hung rank's process;
- ``calls``: waiting for and killing actors.
"""

from cluster.worker_group.actor import TRAINING_FOLDERS, code_fingerprint
from cluster.worker_group.placement import NODE_ID_LABEL, avoid_selector
from cluster.worker_group.ray_group import CONNECT_WAVE, RayWorkerGroup, connect_waves
from cluster.worker_group.salvage import RELEASE_MAX_S, RELEASE_S, wait_released

__all__ = [
    "CONNECT_WAVE",
    "NODE_ID_LABEL",
    "RELEASE_MAX_S",
    "RELEASE_S",
    "TRAINING_FOLDERS",
    "RayWorkerGroup",
    "avoid_selector",
    "code_fingerprint",
    "connect_waves",
    "wait_released",
]
