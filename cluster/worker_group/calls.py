"""Calls to the workers' actors that every part of the Ray worker group makes the same way: wait for
answers failing fast, kill an actor without raising, and shorten an error to one line for a log."""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

logger = logging.getLogger(__name__)


def get_all(refs: list[Any], timeout: float) -> list[Any]:
    """ray.get that fails fast: the first error from any rank ends the wait."""
    pending = list(refs)
    deadline = time.monotonic() + timeout
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"workers did not answer within {timeout:g}s")
        ray.get(ready[0])  # raises on error
    return ray.get(refs)


def kill(actor: Any, what: str) -> None:
    """``ray.kill`` that logs instead of raising: an actor already gone is what we wanted."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:
        logger.info("ray.kill of %s: %s", what, short(exc))


def short(err: BaseException) -> str:
    """The first line of an error (at most 300 characters), or its type's name when it has no text."""
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__
