"""Ending a hung rank's process by its pid, on its node, so that the ranks waiting for it are released.

A hung rank may not answer anything: a stopped process (SIGSTOP, a frozen container) or one holding the GIL
in native code cannot run its actor's calls, so ``ray.kill`` would wait on it. SIGKILL works on any process:
the kernel closes its sockets, and its gloo peers' collective fails within milliseconds ("Connection reset
by peer"; checked by ``tests/ray/test_hang_peers.py``). The driver signals a process on its own node
directly, and one on another node through a task pinned to that node (``NodeAffinitySchedulingStrategy``,
no CPU reserved).
"""

from __future__ import annotations

import logging
import os
import signal
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

logger = logging.getLogger(__name__)

REMOTE_KILL_S = 20.0
"""The longest the task that signals a process on another node is waited for (it may start a worker)."""


def end_process(node_id: str, pid: int) -> bool:
    """SIGKILL process ``pid`` on Ray node ``node_id``; whether it was signalled (False: gone already, or
    the node could not be reached; logged)."""
    try:
        here = ray.get_runtime_context().get_node_id()
        if not node_id or node_id == here:
            return _sigkill(pid)
        strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
        ref = (
            ray.remote(num_cpus=0, max_retries=0)(_sigkill).options(scheduling_strategy=strategy).remote(pid)
        )
        return bool(ray.get(ref, timeout=REMOTE_KILL_S))
    except Exception as exc:  # the caller kills the actor through Ray either way
        logger.warning("could not SIGKILL pid %d on node %s: %s: %s", pid, node_id, type(exc).__name__, exc)
        return False


def _sigkill(pid: int) -> bool:
    t0 = time.monotonic()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    logger.info("SIGKILLed the hung rank's process %d in %.3fs", pid, time.monotonic() - t0)
    return True
