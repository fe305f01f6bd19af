"""Process tuning for a training rank: environment, thread count, allocator and scheduling priority.

Everything here is process-wide and permanent, so it is only ever called inside a worker process (a Ray
actor or a plain process in the tests), never in the driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterator

from cluster.spec.config import JobConfig

logger = logging.getLogger(__name__)

DETERMINISTIC_CUBLAS = ":4096:8"
"""``CUBLAS_WORKSPACE_CONFIG`` for deterministic cuBLAS (NVIDIA's cuBLAS docs, "Results reproducibility")."""


@contextlib.contextmanager
def worker_env(cfg: JobConfig) -> Iterator[None]:
    """Environment a worker process needs before torch starts threads or sockets."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, int(cfg.scaling.cpus_per_worker))))
    os.environ.update(cfg.scaling.env)
    if cfg.training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS)
    if cfg.scaling.socket_ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = cfg.scaling.socket_ifname
        os.environ["NCCL_SOCKET_IFNAME"] = cfg.scaling.socket_ifname
    yield


def set_niceness(value: int | None) -> str:
    """Give every thread of this process niceness ``value`` (scaling.worker_niceness); returns the outcome.

    Ray starts worker processes at niceness 15 (``RAY_worker_niceness``), so its raylet, GCS, agents and any
    other process on the node preempt a training rank whenever they wake, and the other ranks wait for it at
    the next all-reduce. Linux keeps niceness per thread and a new thread inherits its creator's, so all of
    ``/proc/self/task`` is set (call again after the process group made its threads). Lowering niceness needs
    CAP_SYS_NICE; without it the ranks stay where Ray put them and the result says what to set.
    """
    if value is None:
        return "ray's"
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]  # no /proc (macOS): the whole process
    denied = False
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != value:
                os.setpriority(os.PRIO_PROCESS, tid, value)
        except PermissionError:
            denied = True
        except OSError:
            continue  # the thread exited between listdir and setpriority: nothing to set
    now = os.getpriority(os.PRIO_PROCESS, 0)
    if denied:
        return (
            f"{now} (not permitted to set scaling.worker_niceness={value}: start Ray with "
            f"RAY_worker_niceness={value}, or give the workers CAP_SYS_NICE)"
        )
    return str(now)


# glibc ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
ALLOCATOR_SETTINGS = ((_M_MMAP_THRESHOLD, 256 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))


def tune_allocator() -> str:
    """Stop glibc's malloc from handing freed memory back to the kernel between steps.

    By default glibc serves large blocks (above a threshold that adapts up to 32 MiB) with fresh ``mmap``s and
    trims the heap's top as soon as 128 KiB of it is free. A training step allocates and frees the same
    activations and gradients every time, so each step faults them back in. With a 256 MiB mmap threshold
    and a 1 GiB trim threshold the memory freed at the end of a step is reused by the next one; the process
    keeps its peak heap instead of shrinking between steps. Returns ``tuned``, or why it was not.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "system (no mallopt: not glibc)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    failed = [param for param, value in ALLOCATOR_SETTINGS if mallopt(param, value) != 1]
    if failed:
        logger.warning("mallopt refused parameters %s: the worker keeps glibc's default allocator", failed)
    return "tuned" if not failed else f"system (mallopt refused {failed})"


def make_deterministic() -> None:
    """training.deterministic: torch raises on an op without a deterministic implementation, and cuBLAS gets
    the fixed workspace its deterministic mode needs. The workspace is read when CUDA first runs cuBLAS, so
    this must come before (``worker_env`` sets it for Ray workers, this for processes started otherwise)."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS)
    if torch.cuda.is_initialized():
        logger.warning(
            "training.deterministic: CUDA was initialised before CUBLAS_WORKSPACE_CONFIG was set; if cuBLAS "
            "already ran, its workspace is not the deterministic one. Set it in scaling.env"
        )
    torch.use_deterministic_algorithms(True)


def tune_process(cfg: JobConfig) -> str:
    """What a worker does once, before it builds anything: torch's thread count, deterministic algorithms
    (training.deterministic), the allocator, the niceness of the threads made so far. Returns the
    allocator's outcome (recorded in ``group_started``)."""
    import torch

    torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_worker)))
    if cfg.training.deterministic:
        make_deterministic()
    allocator = tune_allocator() if cfg.scaling.tune_allocator else "system"
    set_niceness(cfg.scaling.worker_niceness)
    return allocator
