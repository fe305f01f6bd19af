"""The replica guard: ranks that should hold the same parameters check that they do
(``failures.replica_check_steps``).

In DDP every rank applies the same all-reduced gradient, so after every step every rank holds the same
parameters, bit for bit. A rank whose device or host computes a wrong number without an error (silent data
corruption) breaks that, and nothing else notices: its weights drift, its gradients spoil every rank's, and
its checkpoints are trusted. Every ``replica_check_steps`` steps, and at every checkpoint step before the
checkpoint is taken, each rank reduces its parameters to a digest on its device (:func:`digest`), the ranks
exchange the digests in one small ``all_gather``, and each compares them (:func:`suspects`). A disagreement
raises :class:`ReplicaMismatchError` on every rank alike; the driver then rolls the run back to the newest
checkpoint at or before the last check that agreed, and replaces the ranks outside the majority
(``cluster.driver.replica_rollback``; the worker group reads the error with ``cluster.seam.mismatch``).

The check is read one step after it is launched (:meth:`ReplicaGuard.after_step`): on a GPU the gather's
result is copied to pinned host memory behind an event, so the host never waits for the device beyond that
gather, while the next step already runs.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cluster.core.errors import ClusterError

logger = logging.getLogger(__name__)

CHUNK = 1 << 20
"""Elements reduced at once: a parameter is read in slices of this many, so the temporaries of a digest
stay a few MiB whatever the size of the largest tensor."""
_MUL = 0x5851F42D4C957F2D  # odd 64-bit constants (PCG's multiplier, the golden ratio's bits)
_GOLDEN = 0x9E3779B97F4A7C15
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_weights: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch holds."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _salt(index: int, chunk: int) -> int:
    """An odd multiplier for slice ``chunk`` of parameter ``index``."""
    return _signed(((index + 1) * _GOLDEN + (chunk + 1) * _MUL) | 1)


def _position_weights(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``CHUNK`` odd multipliers that differ with the position, in ``dtype`` (kept per device)."""
    key = (device, dtype)
    if key not in _weights:
        i = torch.arange(CHUNK, dtype=torch.int64, device=device)
        w = torch.bitwise_or(torch.bitwise_xor(i * _signed(_MUL), i >> 13), 1)
        _weights[key] = w.to(dtype)  # truncation keeps the low bit: still odd
    return _weights[key]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern as signed integers of its element size, flat."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(-1).view(_INT[t.element_size()])


def digest(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One int64 per tensor of ``params``, computed on their device without a host sync: the wrap-around sum
    of each element's bit pattern times an odd multiplier that depends on its position, times an odd salt
    of the tensor and slice. A float sum would miss a flipped low bit (rounding) and a swap of two values;
    here flipping any one bit of any element changes the tensor's value: it adds ``±2^j * odd`` in a ring
    of 2^8-2^64 elements, never 0. Equal tensors give equal digests on any device."""
    if not params:
        return torch.zeros(0, dtype=torch.int64)
    out = []
    for i, p in enumerate(params):
        bits = _bits(p)
        total = torch.zeros((), dtype=torch.int64, device=bits.device)
        for c, part in enumerate(bits.split(CHUNK)):
            w = _position_weights(bits.device, part.dtype)[: part.numel()]
            # the product wraps in the element's own width; the sum of those in int64 keeps every change
            total = total + (part * w).sum(dtype=torch.int64) * _salt(i, c)
        out.append(total)
    return torch.stack(out)


def flip_bit(t: torch.Tensor, index: int = 0, bit: int = 12) -> None:
    """Flip bit ``bit`` of element ``index`` of ``t`` in place (the injected ``flip_bit`` fault, and a
    task that corrupts its own weights in the tests): a silent error in one replica."""
    with torch.no_grad():
        bits = _bits(t)
        one = torch.ones((), dtype=bits.dtype, device=bits.device) << bit
        bits[index] ^= one


def suspects(rows: Sequence[Sequence[int]]) -> list[int]:
    """The ranks (row indices) whose digests differ from the majority's; every rank when no digest is held
    by more than half the ranks (at 2 ranks a disagreement leaves both suspect). [] when all agree."""
    keys = [tuple(r) for r in rows]
    if len(set(keys)) <= 1:
        return []
    top, count = Counter(keys).most_common(1)[0]
    if 2 * count <= len(keys):
        return list(range(len(keys)))
    return [r for r, k in enumerate(keys) if k != top]


def short(row: Sequence[int]) -> str:
    """A rank's digests as 16 hex digits (the manifest's ``replica_check.digest``)."""
    data = b"".join(int(v).to_bytes(8, "little", signed=True) for v in row)
    return hashlib.sha256(data).hexdigest()[:16]


class ReplicaMismatchError(ClusterError):
    """The ranks' parameters differ: some rank computed wrong numbers silently. Raised on every rank alike;
    ``detail["replica"]`` holds the check's ``step``, the ``suspects``, the ``agreed_step`` (the last check
    that agreed, or where this group's state was loaded), the first ``params`` that differ and each rank's
    ``digests``."""

    def __init__(self, message: str, detail: dict[str, Any]) -> None:
        super().__init__(message, detail)

    def __str__(self) -> str:
        return str(self.args[0])

    @property
    def detail(self) -> dict[str, Any]:
        return dict(self.args[1])


@dataclass
class _Pending:
    step: int
    gathered: torch.Tensor
    host: torch.Tensor | None = None
    event: Any = None  # torch.cuda.Event behind the copy to ``host``


class ReplicaGuard:
    """A rank's half. ``begin`` with each group's model (the state it resumed is agreed: it was loaded or
    sent and checked alike on every rank), ``after_step`` after every step (skipped ones too), ``verify``
    before a checkpoint, ``settle`` at the epoch's end; ``meta`` is what a checkpoint's manifest records.
    Every rank calls them at the same steps, so every rank raises the same error at the same point. Off
    with ``every == 0`` or a single rank."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.agreed_step = 0
        self.agreed_digest = ""
        self._names: list[str] = []
        self._params: list[torch.Tensor] = []
        self._world = 1
        self._pending: _Pending | None = None

    @property
    def on(self) -> bool:
        return self.every > 0 and self._world > 1

    def begin(self, model: nn.Module, world_size: int, step: int) -> None:
        named = list(model.named_parameters())
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._world = world_size
        self.agreed_step, self.agreed_digest, self._pending = step, "", None

    def after_step(self, step: int) -> None:
        """Read the check launched at an earlier step (raises on a disagreement); launch one at every
        ``every``-th step."""
        if not self.on:
            return
        if self._pending is not None and self._pending.step < step:
            self._settle()
        if step % self.every == 0:
            self._launch(step)

    def verify(self, step: int) -> None:
        """Before a checkpoint at ``step``: the ranks agree on the state at ``step`` (checked now unless
        already), or :class:`ReplicaMismatchError`. Never a collective once ``step`` agreed (rank 0 alone
        may write a failed checkpoint again at the end)."""
        if not self.on or self.agreed_step == step:
            return
        if self._pending is None or self._pending.step != step:
            self.settle()
            self._launch(step)
        self._settle()

    def settle(self) -> None:
        """Read the check in flight, if any (the epoch's end)."""
        if self.on and self._pending is not None:
            self._settle()

    def meta(self, step: int) -> dict[str, Any]:
        """The manifest's record of the check the checkpoint at ``step`` agrees with (none when off)."""
        if not self.on or self.agreed_step != step:
            return {}
        return {"replica_check": {"step": step, "digest": self.agreed_digest}}

    def _launch(self, step: int) -> None:
        mine = digest(self._params)
        flat = torch.empty(self._world * mine.numel(), dtype=mine.dtype, device=mine.device)
        dist.all_gather_single(flat, mine)  # (gloo takes only the concatenated form)
        gathered = flat.view(self._world, mine.numel())
        pending = _Pending(step, gathered)
        if gathered.is_cuda:  # read later without waiting for the steps queued after it
            pending.host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            pending.host.copy_(gathered, non_blocking=True)
            pending.event = torch.cuda.Event()
            pending.event.record()
        self._pending = pending

    def _settle(self) -> None:
        p, self._pending = self._pending, None
        assert p is not None
        if p.event is not None:
            p.event.synchronize()
        rows = (p.host if p.host is not None else p.gathered).tolist()
        bad = suspects(rows)
        if not bad:
            self.agreed_step, self.agreed_digest = p.step, short(rows[0])
            return
        raise self._error(p.step, rows, bad)

    def _error(self, step: int, rows: list[list[int]], bad: list[int]) -> ReplicaMismatchError:
        good = [r for r in range(len(rows)) if r not in bad]
        ref = rows[good[0]] if good else None
        differ = [n for i, n in enumerate(self._names) if len({row[i] for row in rows}) > 1]
        who = f"rank {bad[0]}" if len(bad) == 1 else f"ranks {', '.join(map(str, bad))}"
        against = f"from ranks {', '.join(map(str, good))}" if ref is not None else "from each other"
        message = (
            f"replicas disagree at step {step}: the parameters of {who} differ {against} (first: "
            f"{differ[0] if differ else '?'}); the last check that agreed was at step {self.agreed_step}. "
            "Rolling back to the newest checkpoint at or before it; the differing ranks get new processes"
        )
        detail = {
            "step": step,
            "suspects": bad,
            "agreed_step": self.agreed_step,
            "params": differ[:5],
            "digests": [short(r) for r in rows],
        }
        return ReplicaMismatchError(message, {"replica": detail})
