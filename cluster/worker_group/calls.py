"""Calls to the workers' actors that every part of the Ray worker group makes the same way: wait for
answers failing fast, kill an actor without raising, and shorten an error to one line for a log."""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

logger = logging.getLogger(__name__)


_unread: list[tuple[str | None, Any]] = []
"""Calls of ranks whose answers the driver no longer waits for (another rank failed first), with the Ray job
that made them: kept until they settle and are read (:func:`read_settled`). Ray reports an error that was
never read as an "Unhandled error" traceback once its reference is freed, although the driver has handled
the failure already."""


def _job() -> str | None:
    """The Ray session this process is connected to (its node and job: a new embedded Ray numbers its jobs
    from 1 again), or None without Ray: a ref belongs to one."""
    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    return f"{ctx.get_node_id()}:{ctx.get_job_id()}"


def read_later(refs: list[Any]) -> None:
    """Keep ``refs`` until they settle; their errors are read (and dropped) by :func:`read_settled`."""
    job = _job()
    _unread.extend((job, ref) for ref in refs)
    read_settled()


def read_settled(wait_s: float = 0.0) -> int:
    """Read the answers of :func:`read_later` that have settled within ``wait_s``; the number still open.
    Those of an earlier Ray session (a second ``cluster.train`` in the same process, after the first one's
    embedded Ray stopped) are dropped: Ray can no longer wait on them, nor report them."""
    job = _job()
    old = sum(1 for j, _ in _unread if j != job)
    if old:
        logger.debug("dropping %d unread answers of an earlier Ray session", old)
    mine = [ref for j, ref in _unread if j == job and job is not None]
    _unread[:] = []
    if not mine:
        return 0
    ready, rest = ray.wait(mine, num_returns=len(mine), timeout=wait_s)
    _unread.extend((job, ref) for ref in rest)
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except Exception as exc:  # the group's failure was acted on already, through the first error
            logger.debug("a rank's answer read after its group failed: %s", short(exc))
    return len(rest)


def get_all(refs: list[Any], timeout: float) -> list[Any]:
    """ray.get that fails fast: the first error from any rank ends the wait (the other ranks' answers are
    read once they settle: :func:`read_later`)."""
    pending = list(refs)
    deadline = time.monotonic() + timeout
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            read_later(pending)
            raise TimeoutError(f"workers did not answer within {timeout:g}s")
        try:
            ray.get(ready[0])  # raises on error
        except BaseException:
            read_later(pending)
            raise
    return ray.get(refs)


def kill(actor: Any, what: str) -> None:
    """``ray.kill`` that logs instead of raising: an actor already gone is what we wanted."""
    try:
        ray.kill(handle_of(actor), no_restart=True)
    except Exception as exc:
        logger.info("ray.kill of %s: %s", what, short(exc))


def short(err: BaseException) -> str:
    """The first line of an error (at most 300 characters), or its type's name when it has no text."""
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__


class Stamped:
    """An actor handle whose calls carry the calling driver's lease generation: ``a.run_epoch.remote(...)``
    reaches the actor as ``call(generation, "run_epoch", ...)``, which a rank refuses unless it serves that
    generation (``cluster.rank.watchdog``). A driver that was taken over commands nothing more."""

    __slots__ = ("generation", "handle")

    def __init__(self, handle: Any, generation: int) -> None:
        self.handle = handle
        self.generation = generation

    def __getattr__(self, name: str) -> _StampedMethod:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StampedMethod(self.handle, self.generation, name)


class _StampedMethod:
    __slots__ = ("generation", "handle", "name")

    def __init__(self, handle: Any, generation: int, name: str) -> None:
        self.handle, self.generation, self.name = handle, generation, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.handle.call.remote(self.generation, self.name, *args, **kwargs)


def handle_of(actor: Any) -> Any:
    """The Ray actor handle of ``actor`` (a :class:`Stamped` one or a plain handle)."""
    return actor.handle if isinstance(actor, Stamped) else actor
