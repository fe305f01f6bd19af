"""The process group, written once: rendezvous store, init with an explicit timeout, device, cleanup.

Rendezvous is race-free: rank 0 binds a TCPStore on port 0 (the kernel picks a free port while the
socket is already bound) and publishes the address; the other ranks connect to it. Nobody picks a port
and hopes it is still free.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def bind_store(world_size: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """Rank 0: listen on a kernel-chosen port; return the store and the port."""
    store = dist.TCPStore(
        "0.0.0.0",
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return store, int(store.port)


def connect_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(
        host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def pick_device(use_gpu: bool) -> torch.device:
    """The GPU Ray assigned (it sets CUDA_VISIBLE_DEVICES, so it is local index 0) or the CPU."""
    if not use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "scaling.use_gpu=true but this worker sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def init_process_group(
    store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float
) -> str:
    """nccl on CUDA, gloo on CPU, with an explicit timeout. Returns the backend."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,  # type: ignore[arg-type]
    )
    return backend


def destroy_process_group() -> None:
    """Safe to call on every exit path, initialised or not."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a broken group (a peer died) may fail to tear down; the process moves on
            logger.warning("destroy_process_group failed: %s: %s", type(exc).__name__, exc)
