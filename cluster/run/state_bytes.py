"""What a checkpoint may hold, and its bytes: states go through ``torch.save`` and come back only through
``torch.load(weights_only=True)`` (a checkpoint is data, never code). :func:`check_loadable` proves a state
comes back before it is written and names the value that would not; :func:`nonfinite` finds weights that
diverged."""

from __future__ import annotations

import io
import math
from typing import Any

import torch

from cluster.core.errors import CheckpointError


def serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def deserialize(data: bytes) -> Any:
    """Load with ``weights_only=True``: tensors and plain containers only; pickled code is refused."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def loader_reason(exc: Exception) -> str:
    """The line of torch's refusal that names the type (its message is a page of advice)."""
    text = str(exc)
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            return line.strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def check_loadable(obj: Any, where: str = "state") -> None:
    """Raise CheckpointError unless ``obj`` loads back through the safe loader exactly as the store loads
    it (``torch.load(weights_only=True)``); the message names the first offending value's type and where
    it sits (``train_state.pt['optimizer']['param_groups'][0]['lr'] is a numpy.float64``). A state that
    cannot be loaded is never written: a run could not resume from it."""
    try:
        deserialize(serialize(obj))
    except Exception as exc:
        spot = _first_unloadable(obj, where)
        what = (
            f"{spot[0]} is a {spot[1]}"
            if spot is not None
            else f"{where} does not load back ({type(exc).__name__}: {exc})"
        )
        raise CheckpointError(
            f"{what}: torch.load(weights_only=True) refuses it, so no run could resume from this state. "
            "Store plain values instead (float(x), int(x), x.item(), torch.tensor(x)), e.g. in the "
            "optimizer's param groups or the scheduler's state"
        ) from None


_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _first_unloadable(obj: Any, where: str) -> tuple[str, str] | None:
    """(where it sits, its type) of the first value in ``obj`` the safe loader refuses."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            found = _first_unloadable(value, f"{where}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found = _first_unloadable(value, f"{where}[{i}]")
            if found is not None:
                return found
        return None
    if type(obj) in _PLAIN or isinstance(obj, torch.Tensor):
        return None
    try:
        deserialize(serialize(obj))
    except Exception:
        kind = type(obj)
        return where, f"{kind.__module__}.{kind.__qualname__}"
    return None


def nonfinite(state: Any) -> str | None:
    """The name of the first floating-point tensor of a state dict holding a NaN or an infinity; None when
    every value is finite (or ``state`` is not a dict). One read of each tensor and no copy: its float64
    sum is NaN or infinite exactly when an element is (float32 or narrower values cannot overflow it)."""
    if not isinstance(state, dict):
        return None
    for name, t in state.items():
        floating = isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0
        if floating and not math.isfinite(float(t.sum(dtype=torch.float64))):
            return str(name)
    return None
