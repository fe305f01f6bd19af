"""Turning what a gang of Ray actors raised into one :class:`cluster.core.errors.Failure`: its root cause and
rank, looked for across every rank (a dead process, then a user exception, then the collateral errors a
death causes on the survivors), and told apart from an error of the start itself."""

from __future__ import annotations

import socket
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from cluster.core.errors import Failure, WorkerError
from cluster.seam.mismatch import failure_of
from cluster.worker_group.calls import short

_COLLATERAL = ("Connection reset", "Connection closed", "Broken pipe", "Socket Timeout", "peer", "Gloo")


def classify(
    exc: BaseException, pending: list[Any], nodes: list[tuple[str, str]], starting: bool = False
) -> Failure:
    """Turn the first error seen into a Failure, looking at every rank's call in ``pending`` (rank order;
    ``nodes``: rank -> (node id, ip)) for the root cause.

    A dead process beats a user exception, which beats the collateral errors (connection reset by
    peer) that a death causes on the survivors; a death whose node is gone is a lost node. With
    ``starting``, an error that did not come from Ray (a timeout waiting for the ranks, a refused GPU
    assignment) is ``start_failed``. An exception a rank raised in set-up is a ``user_error`` of that rank
    (:func:`setup_failure`); ranks whose parameters disagree (``cluster.rank.replica``) are a
    ``replica_mismatch``.
    """
    if starting and not isinstance(exc, RayError):
        return Failure("start_failed", None, f"{type(exc).__name__}: {exc}")
    cause = exc.cause if isinstance(exc, RayTaskError) else None
    if isinstance(cause, WorkerError) and cause.detail.get("phase") == "setup":
        return setup_failure(cause)
    errors = rank_errors(pending, 0.5)
    only_collateral = errors and all(
        not isinstance(e, RayActorError) and _collateral(_describe(e)) for e in errors.values()
    )
    if only_collateral:
        errors.update(rank_errors(pending, 2.0))  # the peer that broke the collective may still be dying
    deaths = {r: e for r, e in errors.items() if isinstance(e, RayActorError)}
    if deaths:
        rank, death = min(deaths.items())
        node_id = nodes[rank][0] if rank < len(nodes) else ""
        if node_dead(node_id):
            return Failure("node_lost", rank, f"node {node_id} (rank {rank}) was lost: {short(death)}")
        return Failure("worker_died", rank, f"rank {rank}'s process died: {short(death)}")
    user = {r: e for r, e in errors.items() if isinstance(e, RayTaskError)}
    if user:
        rank, err = min(user.items(), key=lambda kv: (_collateral(_describe(kv[1])), kv[0]))
        cause = err.cause if isinstance(err.cause, WorkerError) else None
        mismatch = failure_of(cause) if cause is not None else None
        return mismatch or Failure("user_error", rank, str(cause) if cause else short(err), cause)
    return Failure("worker_died", None, short(exc))


def setup_failure(error: WorkerError) -> Failure:
    """A rank's exception in set-up (``Worker.setup``): a ``user_error`` whose first line names the
    exception, its message and the ``file:line`` of the task's code that raised it."""
    ranks = "every rank" if error.detail.get("every_rank") else f"rank {error.rank}"
    first = f"{error.exc_type} in set-up at {error.detail.get('where')} on {ranks}: {error.message}"
    return Failure("user_error", error.rank, f"{' '.join(first.split())}\n{error.traceback}", error)


def rank_errors(refs: list[Any], timeout: float) -> dict[int, BaseException]:
    """rank -> the error its call in ``refs`` raised, for the calls done within ``timeout``."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    out: dict[int, BaseException] = {}
    for rank, ref in enumerate(refs):
        if ref in ready:
            try:
                ray.get(ref)
            except Exception as err:
                out[rank] = err
    return out


def node_dead(node_id: str) -> bool:
    """Whether Ray's node ``node_id`` is gone (declared dead, or its raylet does not answer)."""
    for node in ray.nodes():
        if node["NodeID"] != node_id:
            continue
        if not node.get("Alive", False):
            return True
        # Ray marks a node dead only after its health checks fail (seconds); its raylet refusing or
        # not answering a connection tells at once that the whole node is gone, not one process.
        return not _port_open(node["NodeManagerAddress"], int(node["NodeManagerPort"]))
    return False


def _port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _collateral(message: str) -> bool:
    return any(s.lower() in message.lower() for s in _COLLATERAL)


def _describe(err: BaseException) -> str:
    if isinstance(err, RayTaskError) and isinstance(err.cause, WorkerError):
        return err.cause.message
    return str(err)
