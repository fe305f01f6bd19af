"""Take a stopped run back to an older checkpoint (``python -m cluster rewind``): the checkpoints after it
are deleted, so that the next submission resumes there, typically with ``training.skip_steps`` naming the
batches of a loss spike, or a lower learning rate. Refused while a job trains the run."""

from __future__ import annotations

import getpass
import socket
from dataclasses import dataclass, field
from typing import Any

from cluster.checkpoint import CheckpointStore
from cluster.errors import CheckpointError, ConfigError
from cluster.inspect.runs import RUNNING, live_status, read_events
from cluster.load import load_checkpoint
from cluster.metrics import EventLog
from cluster.storage import Storage


@dataclass
class Rewind:
    run_url: str
    step: int
    """The checkpoint the run goes back to (verified)."""
    newer: list[int] = field(default_factory=list)
    """The step folders after it: deleted when ``done``."""
    done: bool = False


def rewind(
    run_url: str, step: int, storage_options: dict[str, Any] | None = None, apply: bool = False
) -> Rewind:
    """Verify the checkpoint at ``step`` of the run at ``run_url`` and list the newer ones; with ``apply``,
    delete them (each manifest first, as retention does) and record a ``rewound`` event.
    ConfigError while a job trains the run; CheckpointError when ``step`` has no verified checkpoint."""
    storage = Storage(run_url, storage_options)
    status = live_status(storage, read_events(storage))
    if status == RUNNING:
        raise ConfigError(
            f"a job is training {storage.root}: stop it first (python -m cluster stop {storage.root} --wait "
            "600), then rewind"
        )
    try:
        load_checkpoint(storage.root, step, storage_options)  # verifies every file
    except CheckpointError as exc:
        raise CheckpointError(f"cannot rewind to step {step}: {exc}") from None
    store = CheckpointStore(storage)
    plan = Rewind(storage.root, step, [s for s in store.steps_on_storage() if s > step])
    if apply and plan.newer:
        plan.newer = store.discard_after(step)
        EventLog(storage).append(
            "rewound", to_step=step, deleted=plan.newer, by=f"{getpass.getuser()}@{socket.gethostname()}"
        )
    plan.done = apply
    return plan
