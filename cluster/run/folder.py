"""One run's folder in storage (``<storage.url>/<name>``), made once per process and handed down.

A job's process (``cluster.api.train``) makes one :class:`RunFolder` and gives it to the lease and the driver,
which gives its storage to its parts (the record, the requests, the quarantine), as Ray Train's controller
makes one ``StorageContext``; a rank makes one for its process (``cluster.rank.worker.Worker``). The read
paths that start from a URL (a checkpoint to load, a run to rewind, the stop request) make theirs here, so
that a run's storage is opened from a URL at one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.core.urls import join, normalize_url
from cluster.run.storage import Storage
from cluster.spec.config import JobConfig


@dataclass(frozen=True)
class RunFolder:
    """A run's storage and where it is (``url``, with ``options`` for the filesystem)."""

    storage: Storage

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
