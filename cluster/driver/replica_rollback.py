"""The driver after a replica mismatch (``failures.replica_check_steps``, ``cluster.rank.replica``): no
checkpoint after the last check that agreed is used again, an event names the differing ranks, and their
nodes count an incident (``cluster.run.quarantine``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cluster.core.errors import Failure
from cluster.seam.mismatch import mismatch

if TYPE_CHECKING:
    from cluster.run.checkpoint import CheckpointInfo, CheckpointStore
    from cluster.run.quarantine import Quarantine
    from cluster.spec.config import JobConfig


def agreed(info: CheckpointInfo) -> bool:
    """Whether a checkpoint's manifest records a replica check that agreed at its own step."""
    check = info.manifest.get("replica_check")
    return isinstance(check, dict) and check.get("step") == info.step


def roll_back(store: CheckpointStore, agreed_step: int, keep_every: int) -> dict[str, Any]:
    """Take every checkpoint after ``agreed_step`` (the last check that agreed) off the run's path, so
    that the next start, and every later one, resumes at or before it. Among them the best and the
    milestones are set aside (``checkpoints/discarded/``) only when their manifest records an agreeing
    check; the others are deleted. Returns the newest ``checkpoint_step`` left at or before it (None: the
    run's start), the steps ``discarded`` (deleted) and ``set_aside``."""
    off = store.discard_after(agreed_step, keep_every=keep_every, may_keep=agreed)
    aside = sorted(store.last_set_aside)
    left = [i.step for i in store.list() if i.step <= agreed_step]
    return {
        "checkpoint_step": left[-1] if left else None,
        "discarded": [s for s in off if s not in aside],
        "set_aside": aside,
    }


def after_mismatch(
    failure: Failure,
    store: CheckpointStore,
    cfg: JobConfig,
    event: Callable[..., None],
    hosts: Sequence[str],
    nodes: Sequence[str],
    quarantine: Quarantine | None = None,
) -> None:
    """The driver, after a replica mismatch (whether or not it restarts): no checkpoint after the last
    agreement is used again (:func:`roll_back` in ``store``, the run's, whose ``fence`` checks every deletion
    against the run's lease), a ``replica_mismatch`` event names the differing ranks, their hosts and nodes
    (``hosts``, ``nodes``: the failed group's, by rank), and ``quarantine`` counts an incident on each
    suspect's node. The suspects' processes are replaced by the salvage
    (``cluster.seam.mismatch.suspect_ranks``), the others reload the checkpoint."""
    found = mismatch(failure)
    if found is None:
        return
    ranks = [int(r) for r in found.get("suspects") or []]
    back = roll_back(store, int(found.get("agreed_step") or 0), cfg.checkpoint.keep_every_steps)
    suspect_nodes = [nodes[r] for r in ranks if r < len(nodes)]
    event(
        "replica_mismatch",
        step=found.get("step"),
        ranks=ranks,
        hosts=[hosts[r] if r < len(hosts) else "" for r in ranks],
        nodes=suspect_nodes,
        agreed_step=found.get("agreed_step"),
        params=found.get("params"),
        digests=found.get("digests"),
        **back,
    )
    if quarantine is not None:
        quarantine.ranks("replica_mismatch", ranks, int(found.get("step") or 0), nodes, hosts)
