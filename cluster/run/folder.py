"""One run's folder in storage (``<storage.url>/<name>``), made once per process and handed down.

A :class:`RunFolder` owns the run's storage and its checkpoint store (``checkpoints``, made once with the
folder). A job's process (``cluster.api.train``) makes one and gives it to the preflight, the lease and the
driver, which gives it to its parts (the record, the result, the replica rollback; the requests and the
quarantine take its storage), as Ray Train's controller makes one ``StorageContext``; a rank makes one at
each setup (``cluster.rank.worker.Worker``). The read paths that start from a URL (a checkpoint to load, a
run to rewind, the stop request) make theirs here, so that a run's storage is opened from a URL at one place
and its checkpoint store made at one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.core.urls import join, normalize_url
from cluster.run.checkpoint import CheckpointStore
from cluster.run.storage import Storage
from cluster.spec.config import JobConfig


@dataclass(frozen=True)
class RunFolder:
    """A run's storage and where it is (``url``, with ``options`` for the filesystem), and its checkpoint
    store."""

    storage: Storage
    checkpoints: CheckpointStore = field(init=False, repr=False, compare=False)
    """The run's checkpoints (``cluster.run.checkpoint``), one store for everyone handed this folder. Its
    ``fence`` is the writer's to set (the driver: its lease's check; a rank: its generation's); its
    ``last_*`` fields are each call's report, read right after that call by its caller; the checkpoints it
    read back whole (``_passed``) count for every later retention through it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoints", CheckpointStore(self.storage))

    @classmethod
    def at(cls, url: str, options: dict[str, Any] | None = None, **retry: Any) -> RunFolder:
        """The run at ``url``; ``retry``: the storage's retry settings (``Storage``'s keywords) when not the
        defaults."""
        return cls(Storage(url, options, **retry))

    @classmethod
    def of(cls, cfg: JobConfig) -> RunFolder:
        """The run ``cfg`` trains: ``<storage.url>/<name>``."""
        return cls.at(join(normalize_url(cfg.storage.url), cfg.name), cfg.storage.options)

    @property
    def url(self) -> str:
        return self.storage.root

    @property
    def options(self) -> dict[str, Any]:
        return self.storage.options

    def unretried(self) -> Storage:
        """The same folder through a storage that fails at once instead of retrying (a request file read
        at every heartbeat must not hold the run up)."""
        return RunFolder.at(self.url, self.options, retries=0, retry_budget_s=0.0).storage
