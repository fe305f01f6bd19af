"""Which rank hangs, told apart from the ranks that wait for it, so that only that rank is replaced.

In DDP a rank that stops stops every rank: the others wait for it inside the next collective (the gradient
all-reduce in backward, the buffer broadcast in forward, a barrier). The driver takes every rank's stacks
when it finds a hang (``cluster.core.stacks``); here each rank's training thread is read:

- **waiting**: its innermost Python frame is a collective's (``torch.distributed``, DDP's forward
  broadcast, or the autograd engine that DDP's reducer blocks until the gradients are all-reduced);
- **outside a collective**: anywhere else (user code, an input pipeline, a hook, no epoch running);
- **silent**: it did not answer the stacks call at all (a stopped process, one holding the GIL in native
  code: the actor's second thread cannot run).

Exactly one rank that is not waiting, the others all waiting, makes it the suspect; among several such
ranks, the one strictly behind all the others in steps. Otherwise no rank stands out, and the hang is
recovered as before (every rank a fresh process, from the newest checkpoint), the reason said. The driver
then ends the suspect's process (``cluster.worker_group.suspect``): its peers' collective fails at once,
and they recover as from a dead worker, keeping their processes and state (``failures.recover_from_peers``).
"""

from __future__ import annotations

import dataclasses

from cluster.core.errors import Failure, HangVerdict
from cluster.core.stacks import ThreadStack, ranges, where

_COLLECTIVE_FILES = ("torch/distributed/", "torch/nn/parallel/distributed.py")
"""Frames of these files are collectives' (c10d's calls, ZeRO, DDP's forward buffer broadcast)."""
_BACKWARD = ("torch/autograd/",)
"""The autograd engine's entry frames: under DDP a rank blocks there until its gradients are reduced."""


def state_of(threads: list[ThreadStack] | None) -> str:
    """``silent``, ``waiting`` (inside a collective) or ``outside`` for one rank's stacks."""
    if threads is None:
        return "silent"
    train = next((t for t in threads if t.training), None)
    if train is None or not train.frames:
        return "outside"  # no epoch running: not waiting for anyone
    inner = train.frames[-1].file.replace("\\", "/")
    if any(part in inner for part in _COLLECTIVE_FILES + _BACKWARD):
        return "waiting"
    return "outside"


def judge(
    stacks: dict[int, list[ThreadStack] | None], steps: dict[int, int], warm_restart: bool = True
) -> HangVerdict:
    """The suspect of a hang from every rank's ``stacks`` (None: no answer) and the global step each rank
    last reported (``steps``; a rank missing there never answered a heartbeat)."""
    if len(stacks) < 2:
        return HangVerdict(None, "a single rank: no peer holds its state")
    states = {r: state_of(t) for r, t in stacks.items()}
    waiting = sorted(r for r, s in states.items() if s == "waiting")
    others = sorted(r for r, s in states.items() if s != "waiting")
    if not others:
        return HangVerdict(
            None,
            f"{_ranks(waiting)} all wait inside a collective: a collective that lost a peer, "
            "mismatched collectives, or a stuck backend",
            waiting,
        )
    suspect, told = _pick(others, stacks, states, steps, waiting)
    if suspect is None:
        return HangVerdict(None, told, waiting)
    behind = [r for r in waiting if r in steps and suspect in steps and steps[suspect] > steps[r]]
    if behind:  # a rank waiting for the suspect cannot be behind it: the stacks are not what they seem
        return HangVerdict(None, f"rank {suspect} {told}, but it is ahead of rank {behind[0]}", waiting)
    return HangVerdict(suspect, told, waiting, keep_survivors=warm_restart)


def _pick(
    candidates: list[int],
    stacks: dict[int, list[ThreadStack] | None],
    states: dict[int, str],
    steps: dict[int, int],
    waiting: list[int],
) -> tuple[int | None, str]:
    """The one candidate (a rank not waiting), and how it was told apart; else None and why not."""
    wait_note = f"while {_ranks(waiting)} waited inside a collective" if waiting else "no rank waited"
    if len(candidates) == 1:
        r = candidates[0]
        if states[r] == "silent":
            return r, f"silent: its process did not answer the stacks call, {wait_note}"
        return r, f"the only rank outside a collective, at {_where(stacks[r])}, {wait_note}"
    known = [r for r in candidates if r in steps]
    if len(known) == len(candidates) and len(steps) == len(states):
        low = min(steps[r] for r in known)
        lowest = [r for r in known if steps[r] == low]
        if len(lowest) == 1 and all(steps[r] > low for r in steps if r != lowest[0]):
            r = lowest[0]
            return r, f"of {_ranks(candidates)} outside a collective, the only one behind (step {low})"
    silent = [r for r in candidates if states[r] == "silent"]
    outside = [r for r in candidates if states[r] != "silent"]
    parts = ([f"{_ranks(silent)} silent"] if silent else []) + (
        [f"{_ranks(outside)} outside a collective"] if outside else []
    )
    return None, f"{' and '.join(parts)}, at the same step: several suspects"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranges(ranks)}"


def _where(threads: list[ThreadStack] | None) -> str:
    train = next((t for t in threads or [] if t.training), None)
    return where(train) if train is not None else "idle (no epoch running)"


def hang_failure(
    hung: tuple[int, str],
    stacks: dict[int, list[ThreadStack] | None] | None,
    steps: dict[int, int],
    warm_restart: bool,
    timeout_from: str | None = None,
) -> Failure:
    """The ``hang`` failure the hang watch found (``hung``: its rank and message), judged from the ranks'
    ``stacks`` (None: they could not be taken): on the suspect's rank when there is one. ``timeout_from``:
    where the hang timeout came from."""
    if stacks is None:
        verdict = HangVerdict(None, "the ranks' stacks could not be taken")
    else:
        verdict = judge(stacks, steps, warm_restart)
    verdict = dataclasses.replace(verdict, timeout_from=timeout_from)
    rank = verdict.suspect if verdict.suspect is not None else hung[0]
    return Failure("hang", rank, f"{verdict.describe()}. {hung[1]}", hang=verdict)
