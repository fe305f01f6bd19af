"""The rank's side of outliving its driver (docs/failures.md, "driver dies"), for the actor
(``cluster.worker_group.actor``): the last epoch's outcome kept for the next driver, the report a driver
that looks for ranks to adopt reads, rank 0's commit fence, and the orphan's end."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator

import ray
from ray.util.placement_group import get_current_placement_group, remove_placement_group

from cluster.rank import dist as cdist
from cluster.rank.replica import digest, short
from cluster.rank.watchdog import NO_DRIVER, DriverWatch
from cluster.rank.worker import Worker
from cluster.run.lease import Fence
from cluster.run.storage import Storage
from cluster.seam.adoption import RankReport
from cluster.seam.protocol import EpochResult
from cluster.worker_group.pulse import Lineage

logger = logging.getLogger(__name__)


class EpochOutcome:
    """The last epoch a rank was given: what it was, whether it still runs, and its result or error,
    kept until the next epoch (a driver that died never read it; the next one ``collect``s it)."""

    def __init__(self) -> None:
        self.dispatched: tuple[int, int, int] | None = None
        self.result: EpochResult | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._done.set()

    @property
    def in_epoch(self) -> bool:
        return not self._done.is_set()

    @contextlib.contextmanager
    def running(self, epoch: int, start_step: int, dispatch: int) -> Iterator[None]:
        self.dispatched = (epoch, start_step, dispatch)
        self.result, self.error = None, None
        self._done.clear()
        try:
            yield
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self._done.set()

    def done(self, result: EpochResult) -> EpochResult:
        self.result = result
        return result

    def collect(self) -> EpochResult:
        """The epoch's result once it ends (its error raised); the commits refused for want of a live driver
        are left out: they were never attempted for the driver that collects it."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        if self.result is None:
            raise RuntimeError("this rank was given no epoch to collect")
        kept = [c for c in self.result.commits if NO_DRIVER not in (c.error or "")]
        if len(kept) < len(self.result.commits):
            logger.warning(
                "checkpoints at steps %s were not committed: no live driver then",
                [c.step for c in self.result.commits if c not in kept],
            )
        return dataclasses.replace(self.result, commits=kept)


def report(worker: Worker, lineage: Lineage | None, generation: int, epochs: EpochOutcome) -> RankReport:
    """What a rank says of itself to a driver that looks for ranks to adopt."""
    s = worker.session
    idle = not epochs.in_epoch
    params = None
    if s is not None and idle:
        cdist.bind_thread(s.device)
        params = short(digest([p.detach() for p in s.raw_model.parameters()]).tolist())
    pg = get_current_placement_group() if ray.is_initialized() else None  # (it would start a Ray)
    return RankReport(
        run=lineage.run if lineage is not None else "",
        generation=generation,
        world_size=worker.world_size,
        rank=worker.rank,
        global_step=worker.pos.global_step,
        epoch=worker.pos.epoch,
        in_epoch=epochs.in_epoch,
        dispatched=epochs.dispatched,
        failed=f"{type(epochs.error).__name__}: {epochs.error}" if epochs.error is not None else None,
        digest=params,
        pid=os.getpid(),
        info=s.info if s is not None else None,
        slot=(pg, lineage.bundle) if pg is not None and lineage is not None else None,
        skipped_steps=tuple(worker.pos.skips),
    )


def commit_fence(watch: DriverWatch, storage: Storage) -> Callable[[], None]:
    """Rank 0's check before a commit writes (``CheckpointStore.fence``): a driver of the generation served
    contacted the rank within a few pulses, and no newer generation took the run."""

    def check() -> None:
        watch.check_live()
        Fence(storage, watch.generation).check()

    return check


def end_orphan() -> None:
    """Free this rank's placement group (Ray ends every rank placed in it) and end the process."""
    try:
        pg = get_current_placement_group()
        if pg is not None:
            remove_placement_group(pg)
    except Exception:  # the process ends below either way; its bundle is freed with it
        logger.exception("an orphaned rank could not remove its placement group")
    finally:
        logging.shutdown()
        os._exit(0)
