"""Starting a group, the parts that need no driver state: the config its workers get (the storage probe's
token, the lease's generation) and its set-up's errors sorted into a Failure a retry can help or the user's
error (module doc of ``cluster.api.train``)."""

from __future__ import annotations

import dataclasses

from cluster.core.errors import ConfigError, Failure, StorageError
from cluster.run.checkpoint import CheckpointUnreadableError
from cluster.run.lease import GENERATION_ENV, Lease
from cluster.run.storage import PROBE_ENV
from cluster.seam.peers import PeerPlan
from cluster.seam.protocol import SetupInfo, WorkerGroup
from cluster.spec.config import JobConfig
from cluster.spec.schedule import Window


def group_config(cfg: JobConfig, probe_token: str, lease: Lease | None) -> JobConfig:
    """``cfg`` with the workers told the storage probe's token (``Worker.setup`` checks it sees the
    driver's storage: storage visible only here fails at once) and the lease's generation (rank 0's commits
    check no newer one took the run over)."""
    env = {**cfg.scaling.env, PROBE_ENV: probe_token}
    if lease is not None:
        env[GENERATION_ENV] = str(lease.generation)
    return dataclasses.replace(cfg, scaling=dataclasses.replace(cfg.scaling, env=env))


def set_up(
    group: WorkerGroup, n: int, peers: PeerPlan | None, skips: list[Window], rollback: Window | None
) -> list[SetupInfo] | Failure:
    """Start and set up ``n`` ranks; a Failure of this attempt when that fails in a way a retry can help.
    What a retry cannot help is raised for the user."""
    try:
        return group.start(n, peers, skips, rollback)
    except CheckpointUnreadableError as exc:
        # storage failed past its retries while a rank read the checkpoint (or it holds a state the safe
        # loader refuses): a failure of this attempt, retried by the policy; never a fresh start
        cause = getattr(exc, "cause", None) or exc
        return Failure("storage", None, f"{type(cause).__name__}: {cause}")
    except (ConfigError, StorageError) as exc:
        # e.g. workers import other code than the driver, or cannot see its storage (after the retry
        # budget): retrying cannot help. Raised in a worker, Ray wraps it with its traceback: the user gets
        # the error itself.
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ConfigError | StorageError):
            raise cause from None
        raise
    except Exception as exc:
        return group.classify(exc, starting=True)
