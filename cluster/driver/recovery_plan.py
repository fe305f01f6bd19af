"""The driver's half of recovering from a failure: where the next group's state comes from.

After a failure the driver asks the failure policy whether to restart (``cluster.driver.policy``), salvages
what the failed group can keep (``WorkerGroup.salvage``), and then decides here how the next group gets its
state: from a survivor's memory (:func:`peer_plan`: at most one step lost, no storage read) or from the newest
verified checkpoint, rolled back past a loss that was not finite (:func:`rollback_window`). The workers' half
(leaving the failed collective, sending and receiving the state, loading a checkpoint) is
``cluster.rank.rejoin``.
"""

from __future__ import annotations

from cluster.core.errors import Failure
from cluster.driver.states import RecoveryTiming
from cluster.seam.peers import PeerPlan, plan_recovery
from cluster.seam.preemption import Move
from cluster.seam.protocol import Salvage
from cluster.spec.config import JobConfig
from cluster.spec.schedule import Window


def diverged(failure: Failure) -> bool:
    """A rank's loss was not finite (``DivergedError``), and it says where that began."""
    e = failure.error
    return e is not None and e.exc_type == "DivergedError" and bool(e.detail.get("first_step"))


def rollback_window(cfg: JobConfig, failure: Failure) -> Window | None:
    """After a loss that was not finite: the ``failures.nan_skip_steps`` steps ending at the first bad one,
    whose batches the run skips from the checkpoint before them; None for any other failure."""
    if not diverged(failure):
        return None
    assert failure.error is not None  # diverged
    last = int(failure.error.detail["first_step"])
    return (max(1, last - cfg.failures.nan_skip_steps + 1), last)


def peer_plan(
    cfg: JobConfig, failure: Failure, salvage: Salvage | None, timing: RecoveryTiming
) -> PeerPlan | None:
    """Whom to copy the state from, or None (checkpoint) with the reason in ``timing.fallback``."""
    f = cfg.failures
    if not f.recover_from_peers:
        return None
    if diverged(failure):
        timing.fallback = "a loss that was not finite: no rank's weights can be trusted; rolling back"
        return None
    if failure.kind == "replica_mismatch":  # the differing rank's gradients reached every rank's weights
        timing.fallback = "the replicas disagreed: back to the newest checkpoint they agreed on"
        return None
    hung_alone = failure.kind == "hang" and failure.hang is not None and failure.hang.keep_survivors
    if failure.kind == "hang" and not hung_alone:
        why = failure.hang.how if failure.hang is not None else "its stacks were not taken"
        timing.fallback = f"a hang with no suspect told apart ({why}): no rank's memory is trusted"
    elif salvage is None or salvage.peers is None:
        timing.fallback = (
            "a node was lost and no survivor could be kept (no room for its ranks within "
            "scaling.resource_wait_s, or no rank left)"
            if failure.kind == "node_lost"
            else "no survivor could be kept"
        )
    else:
        plan = plan_recovery(salvage.peers)
        if isinstance(plan, PeerPlan):
            return plan
        timing.fallback = plan
    if failure.kind != "hang" and not f.warm_restart:
        timing.fallback = "failures.warm_restart is off: no survivor keeps its process"
    return None


def move_plan(salvage: Salvage | None, m: Move) -> PeerPlan | None:
    """Whom the replacements of a move copy the state from, or None (the checkpoint); when the kept ranks'
    states disagree, the move says so in its reason."""
    if salvage is None or salvage.peers is None:
        return None
    chosen = plan_recovery(salvage.peers)
    if isinstance(chosen, PeerPlan):
        return chosen
    m.reason = f"the ranks' states disagree ({chosen}): from the checkpoint instead"
    return None
