"""The public ``cluster.Driver``: the driver of ``cluster/driver/`` with a gang of Ray actors as its group
unless the caller gives another (the driver itself knows no Ray: ``group_factory`` is handed to it)."""

from __future__ import annotations

from typing import Any

from cluster.api.train import ray_group_factory
from cluster.driver.driver import Driver as _Driver
from cluster.spec.config import JobConfig


class Driver(_Driver):
    """:class:`cluster.driver.driver.Driver`; ``group_factory`` defaults to Ray's worker group."""

    def __init__(self, cfg: JobConfig, group_factory: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, group_factory or ray_group_factory, *args, **kwargs)
