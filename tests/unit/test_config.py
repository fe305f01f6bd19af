"""Config validation: every bad input is one ConfigError naming the key and the fix."""

from __future__ import annotations

import os
from typing import Any

import pytest

from cluster.core.errors import ConfigError
from cluster.spec.config import JobConfig
from cluster.spec.load import load_config, parse_fault_env
from cluster.spec.reference import field_docs

pytestmark = pytest.mark.timeout(30)

TINY = os.path.abspath("jobs/configs/tiny_cpu.yaml")

BAD = [
    (["trainig.epochs=3"], "unknown key 'trainig'"),
    (["training.epoch=3"], "did you mean 'training.epochs'"),
    (["training.epochs=0"], "training.epochs=0 must be at least 1"),
    (["training.epochs=three"], "training.epochs must be an integer"),
    (["training.epochs=2.5"], "training.epochs must be an integer"),
    (["workers=0"], "scaling.num_workers=0 must be at least 1"),
    (["training.global_batch_size=63"], "set training.global_batch_size to a multiple of 2"),
    (["training.grad_accum_steps=3", "training.global_batch_size=64"], "multiple of 6"),
    (["scaling.min_workers=3"], "scaling.min_workers=3 must be between 1 and scaling.num_workers=2"),
    (["scaling.use_gpu=maybe"], "scaling.use_gpu must be true or false"),
    (["scaling.placement_strategy=RANDOM"], "choose one of 'PACK'"),
    (["scaling.cpus_per_worker=0"], "scaling.cpus_per_worker=0.0 must be positive"),
    (["scaling.gpus_per_worker=2"], "scaling.gpus_per_worker=2 must be in (0, 1]"),
    (["scaling.backend=nccl"], "scaling.backend=nccl needs scaling.use_gpu=true"),
    (["scaling.backend=mpi"], "choose one of 'auto'"),
    (
        ["scaling.use_gpu=true", "scaling.gpus_per_worker=0.5"],
        "scaling.gpus_per_worker=0.5 puts several ranks on one GPU, which NCCL refuses (duplicate GPU); "
        "set scaling.backend=gloo",
    ),
    (["scaling.worker_niceness=20"], "scaling.worker_niceness=20 is not a niceness; use -20..19"),
    (["training.amp=fp8"], "training.amp='fp8' is not allowed"),
    (["training.grad_clip=-1"], "training.grad_clip=-1.0 must be positive"),
    (
        ["training.sync_batchnorm=true"],
        "training.sync_batchnorm=true needs scaling.use_gpu=true: torch's SyncBatchNorm runs only on "
        "GPUs. Set training.sync_batchnorm=false for a CPU job",
    ),
    (["training.compile=maybe"], "training.compile must be true or false"),
    (["training.loader_workers=-1"], "training.loader_workers=-1 must be 0 (fetch in the training thread)"),
    (["training.prefetch=0"], "training.prefetch=0 must be at least 1"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last=0 must be at least 1"),
    (["checkpoint.keep_every_steps=-1"], "checkpoint.keep_every_steps=-1 must be 0 (off) or positive"),
    (
        ["checkpoint.every_steps=25", "checkpoint.keep_every_steps=1010"],
        "keep_every_steps=1010 is not a multiple of checkpoint.every_steps=25, so no checkpoint would land "
        "on it; use a multiple, e.g. 1000",
    ),
    (["training.skip_steps=[12-10]"], "training.skip_steps[0]='12-10' is not a step or a range of steps"),
    (["training.skip_steps=[5, 0]"], "training.skip_steps[1]=0 is not a step or a range of steps"),
    (["training.skip_steps=[ten]"], 'write 1450 or "1201-1300"'),
    (["training.skip_steps=7"], "training.skip_steps must be a list"),
    (["failures.nan_skip_steps=-1"], "failures.nan_skip_steps=-1 must be 0 (a NaN loss stops the run)"),
    (
        ["failures.nan_skip_steps=5", "failures.stop_on_nan=false"],
        "failures.nan_skip_steps=5 rolls back on a NaN loss, but failures.stop_on_nan=false trains on",
    ),
    (["checkpoint.every_steps=-5"], "checkpoint.every_steps=-5 must be 0 (off) or positive"),
    (["failures.max_failures=-2"], "failures.max_failures=-2 must be -1 (unlimited)"),
    (["failures.hang_timeout_s=0"], "failures.hang_timeout_s=0.0 must be positive"),
    (
        ["failures.hang_timeout_s=300"],
        "failures.hang_timeout_s=300 must be shorter than failures.process_group_timeout_s=300",
    ),
    (
        ["failures.process_group_timeout_s=30"],
        "failures.hang_timeout_floor_s=60 must be shorter than failures.process_group_timeout_s=30",
    ),
    (["name=../escape"], "is not a valid run name"),
    (["name=a/b"], "is not a valid run name"),
    (["name=s3://bucket/x"], "is not a valid run name"),
    (["task=not a path"], "must be an import path"),
    (["storage="], "storage.url is empty"),
    # malformed or unsupported storage URLs: one line naming the fix, before anything starts
    (["storage=s3://"], "names no bucket or host after 's3://'; write s3://BUCKET/prefix"),
    (["storage=gs:///runs"], "names no bucket or host after 'gs://'"),
    (["storage=s3:/bucket/runs"], "'s3:' must be followed by '//' (write s3://bucket/runs)"),
    (["storage=s3:bucket"], "'s3:' must be followed by '//'"),
    (["storage=nosuchproto://bucket/runs"], "unknown storage protocol 'nosuchproto'"),
    (["storage=abfs://container/runs"], "backend for abfs:// is not installed; pip install 'cluster[azure]'"),
    (["storage=s3://AKIAXX:hunter2hunter2@bucket/runs"], "has credentials in it; remove them from the URL"),
    (["storage=https://example.com/runs"], "https:// is read-only over HTTP"),
    (["storage=simplecache::s3://bucket/runs"], "chains fsspec protocols"),
    (["storage=file://"], "names no folder"),
    (["storage=memory://"], "names no folder; write memory://NAME"),
    (["storage=runs:v2"], "or ./runs:v2 for a new local folder of that name"),
    (["failures.inject=[{rank: 5, step: 3}]"], "failures.inject[0].rank=5 is not a rank of this job"),
    (
        ["failures.inject=[{rank: 0, step: 3, kind: explode}]"],
        "failures.inject[0].kind='explode' is not allowed",
    ),
    (["scaling=4"], "scaling must be a mapping"),
    (["training.epochs"], "must look like key=value"),
    (
        ["failures.hot_spare=sometimes"],
        "failures.hot_spare='sometimes' is not allowed; use true or false or 'auto'",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_is_one_clear_error(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    assert message in str(info.value)


def test_credentials_never_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["storage=s3://AKIAXX:hunter2hunter2@bucket/runs"])
    assert "hunter2" not in str(info.value) and "AKIAXX" not in str(info.value)


def test_local_path_with_a_colon(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A colon in a local folder's name is allowed when the folder exists or the path starts with ./"""
    monkeypatch.chdir(tmp_path)
    assert load_config(TINY, ["storage=./runs:v2"]).storage.url == "./runs:v2"
    os.mkdir(tmp_path / "old:runs")
    assert load_config(TINY, ["storage=old:runs"]).storage.url == "old:runs"


def test_missing_file_and_bad_yaml(tmp_path: object) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/job.yaml")
    bad = f"{tmp_path}/bad.yaml"
    with open(bad, "w") as fh:
        fh.write("training: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with open(bad, "w") as fh:
        fh.write("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


def test_overrides_and_aliases() -> None:
    cfg = load_config(TINY, ["epochs=7", "storage=s3://b/runs", "name=x1", "training.amp=bf16", "workers=4"])
    assert cfg.training.epochs == 7
    assert cfg.storage.url == "s3://b/runs"
    assert cfg.name == "x1"
    assert cfg.training.amp == "bf16"
    assert cfg.scaling.num_workers == 4
    assert cfg.effective_min_workers == 4
    assert isinstance(cfg.scaling.cpus_per_worker, float)
    for text, value in (("true", True), ("false", False), ("auto", "auto")):
        assert load_config(TINY, [f"failures.hot_spare={text}"]).failures.hot_spare == value


def test_defaults_are_valid_and_secrets_redacted() -> None:
    cfg = load_config(data={"storage": {"url": "s3://b", "options": {"secret": "hunter2hunter2"}}})
    assert isinstance(cfg, JobConfig)
    assert "hunter2hunter2" not in str(cfg.to_dict())
    assert cfg.to_dict(redact=False)["storage"]["options"]["secret"] == "hunter2hunter2"


def test_fault_env_parsing() -> None:
    spec = parse_fault_env("1:30:crash", 2)
    assert (spec.rank, spec.step, spec.kind, spec.attempt) == (1, 30, "crash", 0)
    assert parse_fault_env("0:5:hang:-1", 2).attempt == -1
    with pytest.raises(ConfigError, match="rank:step:kind"):
        parse_fault_env("1-30-crash", 2)
    with pytest.raises(ConfigError, match="not a rank"):
        parse_fault_env("3:30:crash", 2)


def test_field_docs_cover_every_key() -> None:
    rows = field_docs()
    keys = [r[0] for r in rows]
    assert "training.global_batch_size" in keys
    assert "failures.inject" in keys
    assert all(doc for key, _, _, doc in rows if key != "storage"), [k for k, _, _, d in rows if not d]


def test_skip_steps_are_steps_or_ranges_sorted_and_merged() -> None:
    from cluster.spec.schedule import skip_windows

    cfg = load_config(TINY, ['training.skip_steps=[1450, "1201-1300", " 1301 - 1305 ", 90-99, 95]'])
    assert skip_windows(cfg.training.skip_steps) == [(90, 99), (1201, 1305), (1450, 1450)]
    assert skip_windows([]) == []
