"""Take a stopped run back to an older checkpoint (``python -m cluster rewind``): the checkpoints after it
are taken off the run's path, so that the next submission resumes there, typically with
``training.skip_steps`` naming the batches of a loss spike, or a lower learning rate. What verified is not
lost: the best and the run's milestones (``checkpoint.keep_every_steps`` of its ``run.json``) among them are
set aside in ``checkpoints/discarded/``, the others deleted. Refused while a job trains the run."""

from __future__ import annotations

import getpass
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.core.errors import CheckpointError, ConfigError
from cluster.run.folder import RunFolder
from cluster.run.lease import Lease, LeaseHeldError
from cluster.run.logs import EventLog
from cluster.run.restore import check_is_run, checkpoint_in
from cluster.run.storage import Storage


@dataclass
class Rewind:
    run_url: str
    step: int
    """The checkpoint the run goes back to (verified)."""
    newer: list[int] = field(default_factory=list)
    """The step folders after it: taken off the run's path when ``done``."""
    set_aside: list[int] = field(default_factory=list)
    """Those of ``newer`` moved to ``checkpoints/discarded/`` (the best, the milestones), once ``done``; the
    others are deleted."""
    done: bool = False


def rewind(
    run_url: str,
    step: int,
    storage_options: dict[str, Any] | None = None,
    apply: bool = False,
    say: Callable[[str], None] | None = None,
) -> Rewind:
    """Verify the checkpoint at ``step`` of the run at ``run_url`` and list the newer ones; with ``apply``,
    take them off the run's path (the best and the milestones set aside, the others deleted, each manifest
    first, as retention does) and record a ``rewound`` event, holding the run's lease meanwhile
    (``cluster.run.lease``: a job whose lease is not released is watched for a few beats). ConfigError while
    a job trains the run; CheckpointError when ``step`` has no verified checkpoint."""
    folder = RunFolder.at(run_url, storage_options)
    storage = folder.storage
    if not apply:
        return _plan(folder, step)
    try:  # the run's lease: no job trains it meanwhile, and one that was taken over cannot write after
        lease = Lease.take(storage, f"rewind by {_who()}", say=say)
    except LeaseHeldError as exc:
        raise ConfigError(
            f"{exc}. Stop it first (python -m cluster stop {storage.root} --wait 600), then rewind"
        ) from None
    try:
        plan = _plan(folder, step)
        if plan.newer:
            lease.check()
            store = folder.checkpoints
            plan.newer = store.discard_after(step, keep_every=_milestones(storage))
            plan.set_aside = sorted(store.last_set_aside)
            deleted = [s for s in plan.newer if s not in plan.set_aside]
            events = EventLog(storage)
            events.fence = lease.check
            events.append("rewound", to_step=step, deleted=deleted, set_aside=plan.set_aside, by=_who())
        plan.done = True
        return plan
    finally:
        lease.release()


def _plan(folder: RunFolder, step: int) -> Rewind:
    try:
        check_is_run(folder)
        checkpoint_in(folder, step)  # verifies every file
    except CheckpointError as exc:
        raise CheckpointError(f"cannot rewind to step {step}: {exc}") from None
    return Rewind(folder.url, step, [s for s in folder.checkpoints.steps_on_storage() if s > step])


def _milestones(storage: Storage) -> int:
    """The run's ``checkpoint.keep_every_steps`` (its ``run.json``); 0 when it has none."""
    try:
        config = json.loads(storage.read_bytes("run.json")).get("config") or {}
    except FileNotFoundError:
        return 0
    return int((config.get("checkpoint") or {}).get("keep_every_steps") or 0)


def _who() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"
