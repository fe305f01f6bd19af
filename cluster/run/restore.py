"""Restoring a run's committed state: :func:`load_checkpoint` (the latest verified checkpoint, one step, or
the best), the check of ``training.init_from`` before a run starts (:func:`check_init_from`), and loading
such weights into a model (:func:`init_weights`). Any fsspec URL; no Ray.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from cluster.core.errors import CheckpointError, ConfigError, StorageError
from cluster.core.urls import url_problem
from cluster.run.checkpoint import CKPT_DIR, best_of, deserialize, score_of
from cluster.run.folder import RunFolder

logger = logging.getLogger(__name__)

_STEP_URL = re.compile(rf"^(?P<run>.+)/{CKPT_DIR}/step_(?P<step>\d+)/?$")


@dataclass
class Checkpoint:
    """One verified checkpoint of a run (every file's size and sha256 checked against its manifest)."""

    run_url: str
    step: int
    epoch: int
    url: str
    model: dict[str, Any]
    """The model's state dict (unwrapped: no ``module.`` prefix), tensors on CPU."""
    train_state: dict[str, Any]
    """Optimizer, scheduler, position in the data (epoch, step in epoch) and seed, as a resume reads it."""
    manifest: dict[str, Any]
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """(step, reason) of newer checkpoints passed over because they are torn or corrupt."""


def open_run(url_or_run: str, storage_options: dict[str, Any] | None) -> tuple[RunFolder, int | None]:
    """The run's folder, and the step when the URL names one checkpoint folder (the entry of the read
    paths that start from a URL: :func:`load_checkpoint`, ``cluster.api.load``, ``cluster.api.export``)."""
    problem = url_problem(url_or_run, "url")
    if problem is not None:
        raise ConfigError(problem)
    step = None
    m = _STEP_URL.match(url_or_run.rstrip("/"))
    if m is not None:
        url_or_run, step = m["run"], int(m["step"])
    folder = RunFolder.at(url_or_run, storage_options)
    check_is_run(folder)
    return folder, step


def check_is_run(folder: RunFolder) -> None:
    """CheckpointError when ``folder`` holds neither ``run.json`` nor checkpoints."""
    storage = folder.storage
    if not storage.exists("run.json") and not storage.listdir(CKPT_DIR):
        raise CheckpointError(
            f"{storage.root} is not a run: it has neither run.json nor {CKPT_DIR}/; pass the run's folder "
            "(<storage.url>/<name>), e.g. ./runs/tiny-cpu"
        )


def load_checkpoint(
    url_or_run: str,
    step: int | Literal["best"] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Checkpoint:
    """The latest verified checkpoint of the run at ``url_or_run`` (``<storage.url>/<name>``), the one at
    ``step``, or with ``step="best"`` the one of the best evaluation by the run's ``checkpoint.best_metric``
    (its score is in ``manifest["score"]``); a checkpoint folder's URL (``.../checkpoints/step_000000400``)
    also works.

    Torn or corrupt checkpoints are skipped with the reason (logged, and listed in ``skipped``) when the
    latest is asked for; an explicit ``step`` (or the best) that fails verification raises CheckpointError.
    """
    folder, named = open_run(url_or_run, storage_options)
    return checkpoint_in(folder, named if step is None else step)


def checkpoint_in(folder: RunFolder, step: int | Literal["best"] | None = None) -> Checkpoint:
    """:func:`load_checkpoint` in the run ``folder``: the latest verified checkpoint, ``step``, or best."""
    storage, store = folder.storage, folder.checkpoints
    if step == "best":
        infos = store.list()
        best = best_of(infos)
        if best is None:
            raise CheckpointError(
                f"no checkpoint of {storage.root} carries an evaluation score ({len(infos)} committed): "
                "train with an eval set and checkpoint.best_metric set, or load the latest (step=None)"
            )
        step = best.step
        metric, mode, value = score_of(best) or ("", "", 0.0)
        logger.info("best checkpoint by %s (%s): step %d, %s=%g", metric, mode, step, metric, value)
    if step is None:
        loaded = store.load_latest()
        for s, why in store.last_skipped:
            logger.warning("skipped checkpoint step %d: %s", s, why)
        if loaded is None:
            detail = "; ".join(f"step {s}: {why}" for s, why in store.last_skipped)
            raise CheckpointError(
                f"{storage.root} has no verified checkpoint" + (f" (skipped: {detail})" if detail else "")
            )
        info, files, skipped = loaded.info, loaded.files, loaded.skipped
    else:
        found, why = store.read_manifest(step)
        if found is None:
            have = [i.step for i in store.list()]
            raise CheckpointError(f"no checkpoint at step {step}: {why}; committed steps: {have or 'none'}")
        info = found
        try:
            files = {name: deserialize(data) for name, data in store.read_verified(info).items()}
        except CheckpointError:
            raise
        except Exception as exc:  # a weights_only refusal or a truncated stream
            why = f"{type(exc).__name__}: {exc}"
            raise CheckpointError(f"{info.url} cannot be loaded safely: {why}") from None
        skipped = []
    return Checkpoint(
        run_url=storage.root,
        step=info.step,
        epoch=info.epoch,
        url=info.url,
        model=files["model.pt"],
        train_state=files.get("train_state.pt", {}),
        manifest=info.manifest,
        skipped=skipped,
    )


def check_init_from(url: str, step: int | Literal["best"] | None, options: dict[str, Any] | None) -> int:
    """Before anything starts: the checkpoint ``training.init_from`` (and ``init_from_step``) names exists
    (its manifest; the files are verified by the ranks that load them). Returns its step; ConfigError
    naming what is there otherwise."""
    key = f"training.init_from={url!r}"
    try:
        folder, named = open_run(url, options)
        infos = folder.checkpoints.list()
    except (CheckpointError, StorageError) as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if named is not None and step is not None:
        raise ConfigError(
            f"{key} names one checkpoint folder, and training.init_from_step={step!r} another choice: "
            "give the run's URL with init_from_step, or the folder alone"
        )
    have = [i.step for i in infos]
    if not infos:
        raise ConfigError(f"{key}: the run has no committed checkpoint to start from")
    if step == "best":
        best = best_of(infos)
        if best is None:
            raise ConfigError(
                f"{key} with training.init_from_step=best: none of its {len(infos)} checkpoints carries an "
                "evaluation score (it trained without checkpoint.best_metric); give a step or null (latest)"
            )
        return best.step
    wanted = named if named is not None else step
    if wanted is None:
        return have[-1]
    if wanted not in have:
        raise ConfigError(f"{key}: no committed checkpoint at step {wanted}; its steps: {have}")
    return int(wanted)


def init_weights(model: nn.Module, weights: dict[str, Any], strict: bool, source: str) -> dict[str, Any]:
    """Load ``weights`` into ``model`` for ``training.init_from``: all of them, names and shapes equal
    (``strict``), or those that match (the rest keep the model's own init). ConfigError names what does
    not fit. Returns what was loaded and what was not, for the run's record."""
    own = model.state_dict()
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    mismatched = [
        f"{k} {tuple(weights[k].shape)} -> {tuple(own[k].shape)}"
        for k in own
        if k in weights and tuple(weights[k].shape) != tuple(own[k].shape)
    ]
    fits = [k for k in own if k in weights and tuple(weights[k].shape) == tuple(own[k].shape)]

    def some(names: list[str]) -> str:
        return ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")

    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {some(missing)}")
    if unexpected:
        problems.append(f"not in this model: {some(unexpected)}")
    if mismatched:
        problems.append(f"other shapes: {some(mismatched)}")
    if (strict and problems) or not fits:
        raise ConfigError(
            f"training.init_from: the weights of {source} do not fit this task's model ("
            + "; ".join(problems)
            + "). "
            + (
                "Set training.init_strict=false to load the ones that fit and keep the model's own init "
                "for the rest (a new head)"
                if fits
                else "Nothing matches: is it a checkpoint of this kind of model?"
            )
        )
    model.load_state_dict({k: weights[k] for k in fits}, strict=not problems)
    return {"loaded": len(fits), "kept_init": missing + [m.split(" ", 1)[0] for m in mismatched]}
