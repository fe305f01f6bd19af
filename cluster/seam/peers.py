"""Recovery from peers, what crosses the seam: a survivor's report (:class:`PeerState`), the driver's plan
(:class:`PeerPlan`) and its rule (:func:`plan_recovery`, pure logic). The transfer itself is the ranks'
(``cluster.rank.peer_transfer``).

The rule (why it is exact). In DDP an optimizer step needs the gradients of every rank, all-reduced. A
survivor whose all-reduce of step ``k`` completed holds exactly the fault-free run's state after step ``k``;
one whose all-reduce failed never stepped and holds the state after ``k - 1``. So survivors differ by at most
one step, the highest step any survivor completed is a state of the fault-free run, and the group resumes
there: at most the step in flight is lost. Every survivor at that step must hold the same digest; any
disagreement, a gap of more than one step, or a state that cannot be sent falls back to the latest verified
checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerState:
    """A survivor's report after it left the failed process group."""

    rank: int
    global_step: int
    epoch: int
    """The epoch to continue in (the next one when the rank finished an epoch's last step)."""
    step_in_epoch: int
    digest: str
    """``cluster.rank.peer_transfer.state_digest`` of the state it would send."""
    nbytes: int
    """Bytes of tensor data it would send."""
    unsendable: str = ""
    """Why this state cannot be sent from one rank (e.g. optimizer state sharded across ranks); "" when it
    can."""


@dataclass(frozen=True)
class PeerPlan:
    """The driver's decision: rank ``source`` sends its state (at ``global_step``) to every other rank."""

    source: int
    global_step: int
    epoch: int
    step_in_epoch: int
    digest: str
    nbytes: int
    holders: tuple[int, ...]
    """Ranks that already hold this exact state (the source included): they check, they do not load."""


def plan_recovery(peers: dict[int, PeerState]) -> PeerPlan | str:
    """The plan, or the reason to fall back to the latest checkpoint (the rule: see the module docstring)."""
    if not peers:
        return "no healthy survivor kept its state"
    unsendable = sorted({p.unsendable for p in peers.values() if p.unsendable})
    if unsendable:
        return f"the survivors' state cannot be sent: {'; '.join(unsendable)}"
    top = max(p.global_step for p in peers.values())
    low = min(p.global_step for p in peers.values())
    if top - low > 1:
        return (
            f"survivors stand at steps {low} to {top}, more than one step apart: one of them did not take "
            "part in a collective it should have"
        )
    at_top = sorted(r for r, p in peers.items() if p.global_step == top)
    digests = {peers[r].digest for r in at_top}
    if len(digests) > 1:
        detail = ", ".join(f"rank {r}: {peers[r].digest[:12]}" for r in at_top)
        return f"the survivors at step {top} hold different states ({detail})"
    src = peers[at_top[0]]
    return PeerPlan(
        source=src.rank,
        global_step=top,
        epoch=src.epoch,
        step_in_epoch=src.step_in_epoch,
        digest=src.digest,
        nbytes=src.nbytes,
        holders=tuple(at_top),
    )
