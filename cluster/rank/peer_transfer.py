"""Recovery from peers, the ranks' side: after a rank dies, the survivors keep their state in memory and one
of them sends it to the replacement over the new process group, instead of every rank reloading a
checkpoint from storage. What a survivor reports and the driver's plan (which survivor sends, and why that
is exact) are ``cluster.seam.peers``.

- :func:`state_digest`: a digest of everything exact resume needs, compared across ranks;
- :func:`broadcast_state`: the transfer itself, a handful of ``dist.broadcast`` calls (NCCL on GPU, gloo on
  CPU): the structure once as a pickled object, the tensors in large flat buffers per dtype.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 << 20
"""Tensors are sent in flat buffers of at most this size per dtype (a tensor larger than it goes alone)."""


# ----------------------------------------------------------------------------------------- state digest
def state_digest(state: Any) -> tuple[str, int]:
    """(hex digest, tensor bytes) of a nested state (dicts, lists, tensors, plain values).

    Each tensor contributes its dtype, shape and ``torch.hash_tensor`` (an xor of its elements' 64-bit
    patterns, computed where the tensor lives: no copy to the host); everything else contributes its repr.
    Any change to one element changes the digest; it is a check that replicas agree, not a cryptographic
    hash.
    """
    skeleton, tensors = _flatten(state)
    h = hashlib.blake2b(digest_size=16)
    h.update(pickle.dumps(skeleton, protocol=4))
    nbytes = 0
    if tensors:
        hashes = torch.stack([_tensor_hash(t).to(tensors[0].device) for t in tensors]).cpu()
        h.update(hashes.numpy().tobytes())
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return h.hexdigest(), nbytes


def _tensor_hash(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.uint64, device=t.device)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return torch.hash_tensor(t.detach())


# ----------------------------------------------------------------------------------------- transfer
@dataclass(frozen=True)
class _Slot:
    """Where a tensor sat in the structure: its index in the flat list, and how to rebuild it."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


def _map(obj: Any, leaf: Any) -> Any:
    """``obj`` with every leaf (anything but a dict, list or tuple) replaced by ``leaf(x)``, in a fixed
    order: dicts in their order, sequences front to back."""
    if isinstance(obj, dict):
        return type(obj)((k, _map(v, leaf)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_map(v, leaf) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map(v, leaf) for v in obj)
    return leaf(obj)


def _flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """(the structure with each tensor replaced by its :class:`_Slot`, the tensors in slot order)."""
    tensors: list[torch.Tensor] = []

    def slot(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        tensors.append(x.detach())
        return _Slot(len(tensors) - 1, tuple(x.shape), x.dtype, x.device.type == "cpu")

    return _map(obj, slot), tensors


def _unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    return _map(skeleton, lambda x: tensors[x.index] if isinstance(x, _Slot) else x)


@dataclass(frozen=True)
class Transfer:
    """What one :func:`broadcast_state` call moved."""

    nbytes: int
    seconds: float
    """Seconds of the tensor data's broadcast (after every rank arrived)."""
    wait_s: float
    """Seconds until every rank of the group arrived (the structure's broadcast)."""
    collectives: int


def broadcast_state(
    state: Any, src: int, device: torch.device, group: dist.ProcessGroup | None = None
) -> tuple[Any, Transfer]:
    """Send ``state`` (a nested dict of tensors and plain values; only read on rank ``src``) from ``src`` (a
    global rank) to every rank of ``group`` (default: the whole default group); return the state (the source
    gets its own back) and what moved.

    The structure travels once (``broadcast_object_list``); tensors travel on ``device`` (the process
    group's: the GPU under NCCL) in flat buffers of one dtype each, at most :data:`BUCKET_BYTES` large. The
    receivers rebuild every tensor on the device the source had it on (CPU or this rank's GPU).
    """
    t0 = time.perf_counter()
    rank = dist.get_rank()
    box: list[Any] = [None]
    tensors: list[torch.Tensor] = []
    if rank == src:
        skeleton, tensors = _flatten(state)
        box = [skeleton]
    dist.broadcast_object_list(box, src=src, group=group, device=device if device.type == "cuda" else None)
    t_arrived = time.perf_counter()
    skeleton = box[0]
    slots = _slots(skeleton)
    out: list[torch.Tensor | None] = [None] * len(slots)
    collectives = 1
    nbytes = 0
    for bucket in _buckets(slots):
        dtype = bucket[0].dtype
        sizes = [_numel(s.shape) for s in bucket]
        if rank == src:
            flat = torch.cat([tensors[s.index].reshape(-1).to(device) for s in bucket])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        collectives += 1
        nbytes += flat.numel() * flat.element_size()
        if rank == src:
            continue
        for slot, part in zip(bucket, torch.split(flat, sizes)):
            t = part.view(slot.shape)  # a view into the received buffer: no copy
            out[slot.index] = t.cpu() if slot.on_cpu else t
    moved = Transfer(nbytes, time.perf_counter() - t_arrived, t_arrived - t0, collectives)
    if rank == src:
        return state, moved
    for slot in slots:  # zero-element tensors travel in no bucket
        if out[slot.index] is None:
            where = torch.device("cpu") if slot.on_cpu else device
            out[slot.index] = torch.empty(slot.shape, dtype=slot.dtype, device=where)
    received = [t for t in out if t is not None]
    return _unflatten(skeleton, received), moved


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _slots(skeleton: Any) -> list[_Slot]:
    found: list[_Slot] = []
    _map(skeleton, lambda x: found.append(x) if isinstance(x, _Slot) else None)
    return sorted(found, key=lambda s: s.index)


def _buckets(slots: list[_Slot]) -> list[list[_Slot]]:
    """Group tensors by dtype into flat buffers of at most BUCKET_BYTES, in a fixed order (every rank
    computes the same buckets from the same structure)."""
    by_dtype: dict[torch.dtype, list[list[_Slot]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for s in slots:
        n = _numel(s.shape)
        if n == 0:
            continue
        b = n * torch.empty((), dtype=s.dtype).element_size()
        groups = by_dtype.setdefault(s.dtype, [[]])
        if groups[-1] and sizes[s.dtype] + b > BUCKET_BYTES:
            groups.append([])
            sizes[s.dtype] = 0
        groups[-1].append(s)
        sizes[s.dtype] = sizes.get(s.dtype, 0) + b
    return [g for groups in by_dtype.values() for g in groups if g]
