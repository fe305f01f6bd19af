"""A rank's view of the driver it serves, for ranks that outlive their driver (docs/failures.md).

On a running Ray cluster the ranks are detached actors: a driver that dies leaves them alive. Each rank then
knows three things about its driver, here:

- the lease generation it serves (``cluster.run.lease``): a call stamped with another generation is refused
  (:class:`StaleDriverError`), so a driver that was paused and taken over commands nothing once it wakes;
  the next submission moves it forward (:meth:`DriverWatch.serve`) only after adopting the rank;
- when a driver of that generation last contacted it (every call, and the driver's pulse between them:
  ``cluster.worker_group.pulse``): rank 0 commits a checkpoint only while that is recent
  (:meth:`DriverWatch.check_live`), so a dead or paused driver's ranks write nothing for it;
- whether the group is orphaned: no contact for ``failures.orphan_timeout_s``; the watch thread then calls
  ``on_orphaned`` once (the actor frees its placement group and exits).

Plain Python, no Ray: the clock is injected, so the rules are unit-tested without threads or waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PULSES_LIVE = 3
"""A driver is live while its last contact is at most this many pulse intervals old."""

NO_DRIVER = "no live driver"
"""Starts the message of a commit refused for want of a live driver (``OrphanedError``)."""


def pulse_every(orphan_timeout_s: float) -> float:
    """Seconds between the driver's pulses to its ranks: six per orphan timeout, at most every 5 s."""
    return min(5.0, orphan_timeout_s / 6)


class StaleDriverError(Exception):
    """A call from a driver whose lease generation is not the one this rank serves."""

    def __init__(self, called: int, served: int) -> None:
        self.called, self.served = called, served
        super().__init__(
            f"a driver of lease generation {called} called a rank that serves generation {served}: "
            + ("it was taken over, and commands nothing more" if called < served else "it did not adopt it")
        )

    def __reduce__(self) -> tuple[type, tuple[int, int]]:
        return (StaleDriverError, (self.called, self.served))


class OrphanedError(Exception):
    """A commit refused because no driver of the served generation contacted the rank recently."""

    def __init__(self, seconds: float, generation: int) -> None:
        self.seconds, self.generation = seconds, generation
        super().__init__(
            f"{NO_DRIVER}: the driver of lease generation {generation} has not contacted this rank for "
            f"{seconds:.0f}s; nothing is committed without one"
        )

    def __reduce__(self) -> tuple[type, tuple[float, int]]:
        return (OrphanedError, (self.seconds, self.generation))


class DriverWatch:
    """The generation a rank serves, its driver's last contact, and the orphan timeout's watch."""

    def __init__(
        self,
        generation: int,
        timeout_s: float,
        on_orphaned: Callable[[float], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.generation = generation
        self.timeout_s = timeout_s
        self.pulse_s = pulse_every(timeout_s)
        self.on_orphaned = on_orphaned
        self.clock = clock
        self.last = clock()
        self._lock = threading.Lock()
        self._fired = False
        self._stop = threading.Event()

    def contact(self, generation: int) -> None:
        """A call stamped with ``generation``: refused (StaleDriverError) unless it is the one served."""
        with self._lock:
            if generation != self.generation:
                raise StaleDriverError(generation, self.generation)
            self.last = self.clock()

    def serve(self, generation: int) -> None:
        """A newer driver adopted this rank: from now on only its calls count (an older one is refused)."""
        with self._lock:
            if generation < self.generation:
                raise StaleDriverError(generation, self.generation)
            self.generation = generation
            self.last = self.clock()

    def silent_s(self) -> float:
        """Seconds since the served driver's last contact."""
        return max(0.0, self.clock() - self.last)

    def live(self) -> bool:
        return self.silent_s() <= PULSES_LIVE * self.pulse_s

    def check_live(self) -> None:
        """Raise OrphanedError unless the served driver contacted this rank within a few pulses."""
        silent = self.silent_s()
        if silent > PULSES_LIVE * self.pulse_s:
            raise OrphanedError(silent, self.generation)

    def poll(self) -> bool:
        """Call ``on_orphaned`` (once) when no driver contacted this rank for the orphan timeout; whether it
        fired now."""
        silent = self.silent_s()
        if self._fired or silent <= self.timeout_s:
            return False
        self._fired = True
        self.on_orphaned(silent)
        return True

    def start(self, every_s: float = 1.0) -> None:
        """Poll on a daemon thread until ``stop`` (or until it fired)."""

        def loop() -> None:
            while not self._stop.wait(every_s):
                try:
                    if self.poll():
                        return
                except Exception:  # the orphan's own exit failed: logged, the rank keeps serving
                    logger.exception("the orphan timeout's action failed")
                    return

        threading.Thread(target=loop, name="cluster-driver-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
