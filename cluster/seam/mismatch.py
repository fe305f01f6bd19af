"""A replica mismatch as it crosses the seam: a rank raises ``cluster.rank.replica.ReplicaMismatchError``
(its ``detail["replica"]``: the step, the suspects, the last step the replicas agreed at); the worker group
reads it into a ``replica_mismatch`` :class:`cluster.core.errors.Failure` (:func:`failure_of`), keeps the
suspects' processes out of the next group (:func:`suspect_ranks`), and the driver rolls back
(``cluster.driver.replica_rollback``)."""

from __future__ import annotations

from typing import Any

from cluster.core.errors import Failure, WorkerError


def mismatch(failure: Failure) -> dict[str, Any] | None:
    """The check that failed (``ReplicaMismatchError.detail``), when ``failure`` is a replica mismatch."""
    e = failure.error
    if failure.kind != "replica_mismatch" or e is None:
        return None
    found = e.detail.get("replica")
    return found if isinstance(found, dict) else None


def failure_of(error: WorkerError) -> Failure | None:
    """A rank's error as a ``replica_mismatch`` failure (its rank: the first suspect); None for others."""
    found = error.detail.get("replica") if error.exc_type == "ReplicaMismatchError" else None
    if not isinstance(found, dict):
        return None
    ranks = [int(r) for r in found.get("suspects") or []]
    return Failure("replica_mismatch", min(ranks, default=error.rank), error.message, error)


def suspect_ranks(failure: Failure) -> set[int]:
    """The ranks whose processes must not be reused after ``failure`` (none unless a mismatch)."""
    found = mismatch(failure)
    return {int(r) for r in found.get("suspects") or []} if found else set()
