"""Fine-tuning on a real local Ray: a new run starts from another run's weights (``training.init_from``),
all of them or those that fit a changed model, and a model they cannot fit is one clear error."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from cluster import load_checkpoint, load_config, train
from cluster.core.errors import ConfigError
from cluster.inspect import read_events
from cluster.run.storage import Storage
from cluster.spec.config import JobConfig

pytestmark = pytest.mark.timeout(300)


def config(storage: str, name: str, *extra: str) -> JobConfig:
    return load_config(
        "jobs/configs/tiny_cpu.yaml",
        [
            f"storage={storage}",
            f"name={name}",
            "task_args.max_chars=40000",
            "task_args.d_model=32",
            "task_args.n_layers=1",
            "task_args.context=32",
            "training.global_batch_size=32",
            "training.max_steps_per_epoch=8",
            "training.epochs=1",
            "failures.hot_spare=false",  # no rank dies
            *extra,
        ],
    )


# The baseline evaluation before the first step is checkpointed as the first best: the initial weights.
AT_START = [
    "task_args.eval_chars=2048",
    "evaluation.at_start=true",
    "checkpoint.best_metric=loss",
    "checkpoint.keep_last=10",
]


def started(run_url: str) -> dict[str, Any]:
    return next(e for e in read_events(Storage(run_url)) if e["event"] == "group_started")


def test_a_new_run_starts_from_another_runs_weights_all_or_those_that_fit(
    ray_local: None, tmp_path: Any
) -> None:
    pretrained = train(config(str(tmp_path), "pretrain"), out=io.StringIO())
    assert pretrained.status == "finished"
    source = load_checkpoint(pretrained.run_url)

    # all of them: the new run's step-0 weights are the source checkpoint's, bitwise
    out = io.StringIO()
    tuned = train(
        config(str(tmp_path), "tuned", f"training.init_from={pretrained.run_url}", *AT_START), out=out
    )
    assert tuned.status == "finished"
    init = started(tuned.run_url)["init_from"]
    assert init == {"url": source.url, "step": source.step, "loaded": len(source.model), "kept_init": []}
    assert f"with the weights of {source.url}" in out.getvalue()
    first = load_checkpoint(tuned.run_url, step=0).model
    assert first.keys() == source.model.keys()
    assert all(torch.equal(first[k], source.model[k]) for k in first)
    # ... and it trained on from there with an optimizer and a step of its own
    assert load_checkpoint(tuned.run_url).train_state["global_step"] == tuned.global_step == 8

    # a deeper model: strict refuses, naming what is missing, once (no retry), with no Ray traceback
    deeper = config(
        str(tmp_path), "deeper", f"training.init_from={pretrained.run_url}", "task_args.n_layers=2"
    )
    with pytest.raises(ConfigError, match=r"missing from the checkpoint: blocks\.layers\.1\.") as caught:
        train(deeper, out=io.StringIO())
    assert type(caught.value) is ConfigError and "ray::" not in str(caught.value)

    # init_strict=false: the layers that fit come from the source, the new one keeps its own init
    loose = config(
        str(tmp_path),
        "loose",
        f"training.init_from={pretrained.run_url}",
        "task_args.n_layers=2",
        "training.init_strict=false",
        *AT_START,
    )
    assert train(loose, out=io.StringIO()).status == "finished"
    init = started(loose_url := f"{tmp_path}/loose")["init_from"]
    assert init["loaded"] == len(source.model) and all(
        k.startswith("blocks.layers.1.") for k in init["kept_init"]
    )
    first = load_checkpoint(loose_url, step=0).model
    assert all(torch.equal(first[k], v) for k, v in source.model.items())
    assert not torch.equal(first["blocks.layers.1.linear1.weight"], first["blocks.layers.0.linear1.weight"])
