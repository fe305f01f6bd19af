"""A checkpoint's weights as one plain file for serving or sharing (``python -m cluster export``): the
verified ``model.pt`` of a run's latest, best or named checkpoint, as ``.safetensors`` (the ``export`` extra;
what Hugging Face and vLLM load) or ``.pt`` (a state dict ``torch.load(weights_only=True)`` reads), cast to a
dtype if asked, with a JSON sidecar saying where it came from."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
from typing import Any, Literal

import torch

from cluster.core.errors import ConfigError, StorageError
from cluster.core.redact import redact_tree, redact_url
from cluster.run.folder import RunFolder
from cluster.run.restore import checkpoint_in, open_run
from cluster.run.storage import Storage

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMATS = (".safetensors", ".pt")
WRITE_RETRIES = 2
"""Retries of a failed write of the exported file (a one-off command: a full disk is reported in seconds,
not after storage's whole retry budget)."""


def export_checkpoint(
    url_or_run: str,
    out: str,
    step: int | Literal["best"] | None = None,
    storage_options: dict[str, Any] | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """Write the weights of a run's checkpoint (the latest verified, ``step``, or ``"best"``) to ``out`` (a
    path or fsspec URL ending in ``.safetensors`` or ``.pt``) and ``out + ".json"`` beside it; ``dtype``
    (``fp32``, ``bf16``, ``fp16``) casts the floating-point tensors. Returns the sidecar's content."""
    fmt = next((f for f in FORMATS if out.endswith(f)), None)
    if fmt is None:
        raise ConfigError(f"--out {out!r}: name the file .safetensors or .pt (the format follows the name)")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(
            f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)} (or leave the weights as they are)"
        )
    folder, named = open_run(url_or_run, storage_options)
    ckpt = checkpoint_in(folder, named if step is None else step)
    weights = dict(ckpt.model)
    other = sorted(k for k, v in weights.items() if not isinstance(v, torch.Tensor))
    if other and fmt == ".safetensors":
        raise ConfigError(
            f"the model's state dict holds entries that are not tensors ({', '.join(other[:5])}), which "
            ".safetensors cannot store; export to .pt instead"
        )
    if dtype is not None:
        cast: dict[tuple[int, int, int], torch.Tensor] = {}  # tied tensors stay one tensor
        weights = {
            k: cast.setdefault(_where(v), v.to(DTYPES[dtype]))
            if isinstance(v, torch.Tensor) and v.is_floating_point()
            else v
            for k, v in weights.items()
        }
    data, tied = _encode(weights, fmt, {"run": redact_url(ckpt.run_url), "step": str(ckpt.step)})
    sidecar = {  # travels with the weights: URLs and task_args redacted (cluster.core.redact)
        "run_url": redact_url(ckpt.run_url),
        "checkpoint_url": redact_url(ckpt.url),
        "step": ckpt.step,
        "epoch": ckpt.epoch,
        "format": fmt.lstrip("."),
        "dtype": dtype,
        "tensors": sum(isinstance(v, torch.Tensor) for v in weights.values()),
        "parameters": sum(v.numel() for v in weights.values() if isinstance(v, torch.Tensor)),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "tied": tied,
        "score": ckpt.manifest.get("score"),
        "eval": ckpt.manifest.get("eval"),
        "exported_at": time.time(),
        **_task_of(folder),
    }
    _publish(out, data, json.dumps(sidecar, indent=1, default=str).encode(), storage_options)
    return sidecar


def _publish(out: str, data: bytes, sidecar: bytes, storage_options: dict[str, Any] | None) -> None:
    """Replace ``out`` and then its sidecar, each atomically (:meth:`Storage.write_all_atomic`): in a local
    folder both go to temporary files there first and are renamed into place only once both are whole, so
    a write that fails (a full disk, a file-size limit) leaves the old file and its sidecar as they were,
    and no temporary file. On an object store each is one PUT, the file first; should the sidecar's fail
    after the file's, the old sidecar (naming the old file's sha256) is removed. StorageError when storage
    fails. A local ``out``'s folder is made when missing."""
    remote = "://" in out and not out.startswith("file://")
    folder, name = out.rsplit("/", 1) if "/" in out else (".", out)
    options = (storage_options or {}) if remote else None  # -o is for object stores, not a local file
    storage = Storage(folder or "/", options, retries=WRITE_RETRIES, retry_budget_s=0.0)
    if storage.local:
        os.makedirs(storage.path, exist_ok=True)  # as before: the folder of --out is made when missing
    try:
        storage.write_all_atomic({name: data, f"{name}.json": sidecar})  # the sidecar last
    except StorageError:
        _drop_stale_sidecar(storage, name)
        raise


def _drop_stale_sidecar(storage: Storage, name: str) -> None:
    """After a failed export: remove the sidecar when it no longer names the file's sha256 (the file was
    replaced, its sidecar not), so that no sidecar vouches for other bytes."""
    side = f"{name}.json"
    try:
        body = json.loads(storage.read_bytes(side))
        said = body.get("sha256") if isinstance(body, dict) else None
        if said is not None and said != hashlib.sha256(storage.read_bytes(name)).hexdigest():
            storage.rm(side)
            logger.warning("removed %s: it named another sha256 than %s holds now", storage.url(side), name)
    except FileNotFoundError:
        return
    except (StorageError, ValueError) as exc:
        logger.warning("could not check %s against %s after the failed export: %s", side, name, exc)


def _encode(weights: dict[str, Any], fmt: str, meta: dict[str, str]) -> tuple[bytes, list[list[str]]]:
    """The file's bytes, and the groups of names that shared one tensor (tied weights): ``.safetensors``
    stores each of them whole (it refuses shared memory), ``.pt`` keeps them shared."""
    groups: dict[tuple[int, int, int], list[str]] = {}
    for k, v in weights.items():
        if isinstance(v, torch.Tensor):
            groups.setdefault(_where(v), []).append(k)
    tied = [names for names in groups.values() if len(names) > 1]
    if fmt == ".pt":
        buf = io.BytesIO()
        torch.save(weights, buf)
        return buf.getvalue(), tied
    try:
        from safetensors.torch import save
    except ImportError:
        raise ConfigError(
            ".safetensors needs the safetensors package: pip install 'cluster[export]' (or export to .pt)"
        ) from None
    plain = {
        k: v.detach().contiguous().clone() if _shared(k, tied) else v.detach().contiguous()
        for k, v in weights.items()
    }
    return save(plain, metadata=meta), tied


def _where(t: torch.Tensor) -> tuple[int, int, int]:
    """What two names of one tied tensor have in common: its memory, offset and size."""
    return (t.untyped_storage().data_ptr(), int(t.storage_offset()), t.numel())


def _shared(name: str, tied: list[list[str]]) -> bool:
    return any(name in names[1:] for names in tied)


def _task_of(folder: RunFolder) -> dict[str, Any]:
    """The run's task and task_args from its run.json (what builds the model these weights fit), redacted
    again: a run.json of an earlier version may hold a secret-looking key's value."""
    try:
        config = json.loads(folder.storage.read_bytes("run.json"))["config"]
    except (FileNotFoundError, KeyError, ValueError):
        return {"task": None, "task_args": None}
    return {"task": config.get("task"), "task_args": redact_tree(config.get("task_args"), known=False)}
