"""`python -m cluster list|show|plot` on a real run (trained on a local Ray, with one injected failure),
run as subprocesses exactly as a user runs them; and its one-line errors."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import struct
import subprocess
import sys

import pytest

from cluster import load_config, train
from cluster.run.checkpoint import step_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.timeout(240)


def cli(*args: str, pre: str = "") -> subprocess.CompletedProcess[str]:
    """``python -m cluster ARGS``; ``pre`` is Python run first in the same process (to hide a module)."""
    if pre:
        cmd = [
            sys.executable,
            "-c",
            f"{pre}; import sys; from cluster.__main__ import main; sys.exit(main())",
        ]
    else:
        cmd = [sys.executable, "-m", "cluster"]
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=90)


def png_size(path: pathlib.Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def assert_one_line_error(out: subprocess.CompletedProcess[str], code: int, *fragments: str) -> None:
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_list_show_plot_on_a_real_run(
    ray_local: None, tiny_overrides: list[str], tmp_path: pathlib.Path
) -> None:
    overrides = [
        *tiny_overrides,
        "name=cli-run",
        "training.epochs=2",
        "checkpoint.every_steps=5",
        "failures.backoff_s=0.2",
        "failures.inject=[{rank: 1, step: 3, kind: raise}]",
    ]
    cfg = load_config("jobs/configs/tiny_cpu.yaml", overrides)
    result = train(cfg, out=io.StringIO())
    assert result.status == "finished" and len(result.failures) == 1
    storage = cfg.storage.url
    run_url = result.run_url
    steps = result.global_step
    ckpt_steps = sorted(int(n[5:]) for n in os.listdir(f"{run_url}/checkpoints"))
    assert ckpt_steps[-1] == steps and len(ckpt_steps) == 3  # keep_last=3

    # list: one header, one line for the run with its real numbers
    out = cli("list", storage)
    assert out.returncode == 0, out.stderr
    header, line = out.stdout.strip().splitlines()
    assert header.split() == [
        "NAME",
        "STATUS",
        "EPOCHS",
        "STEP",
        "CHECKPOINT",
        "LOSS",
        "ATTEMPTS",
        "FAILURES",
    ]
    name, status, epochs, step, ckpt, loss, attempts, failures = line.split()
    assert (name, status, epochs, step, ckpt, attempts, failures) == (
        "cli-run",
        "finished",
        "2/2",
        str(steps),
        str(steps),
        "2",
        "1",
    )
    assert float(loss) == pytest.approx(result.metrics["loss"], abs=1e-4)

    listed = json.loads(cli("list", storage, "--json").stdout)
    assert listed[0]["latest_checkpoint"] == steps and listed[0]["epochs_total"] == 2

    # show, both spellings: status, config, the failure and its recovery, checkpoints, metrics
    by_path, by_name = cli("show", run_url), cli("show", storage, "cli-run")
    assert by_path.returncode == 0 and by_name.returncode == 0, by_path.stderr + by_name.stderr
    assert by_path.stdout == by_name.stdout
    text = by_path.stdout
    assert "run        cli-run" in text and "status     finished" in text
    assert "training.epochs: 2" in text and "checkpoint.every_steps: 5" in text
    assert f"global step {steps}" in text and f"latest verified step {steps}" in text
    failure_rows = text.split("failures (1)\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert failure_rows[0].split()[:11] == [
        "ATTEMPT",
        "KIND",
        "RANK",
        "STEP",
        "DECISION",
        "SOURCE",
        "SPARE",
        "RESUMED_AT",
        "RECOVERY_S",
        "LOST_STEPS",
        "MOVED",
    ]
    attempt, kind, rank, step, decision, source, spare, resumed, recovery_s, lost = failure_rows[1].split()[
        :10
    ]
    # the raising rank keeps its process: no rank is missing, so no spare steps in
    assert (attempt, kind, rank, decision, source, spare) == ("0", "user_error", "1", "restart", "peers", "-")
    assert float(recovery_s) > 0 and int(lost) <= 1 and int(resumed) >= int(step) - 1
    assert "RuntimeError" in failure_rows[1]
    section = text.split("checkpoints (3 committed)\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [int(r.split()[0]) for r in section[1:]] == ckpt_steps
    assert "epoch 2 done" in section[-1] and section[-1].split()[-1] == "yes"  # the latest is verified
    assert "MiB" in section[-1] or "KiB" in section[-1]
    assert "EPOCH  STEP  LOSS" in text and "latest step: global_step" in text

    report = json.loads(cli("show", run_url, "--verify", "--json").stdout)
    assert [c["step"] for c in report["checkpoints"]] == ckpt_steps
    assert all(c["verified"] is True for c in report["checkpoints"])
    assert report["failures"][0]["kind"] == "user_error" and report["summary"]["attempts"] == 2

    # plot: a real PNG of the promised size
    png = tmp_path / "run.png"
    out = cli("plot", run_url, "--out", str(png))
    assert out.returncode == 0, out.stderr
    assert png_size(png) == (1000, 400)
    assert png.stat().st_size > 10_000  # two axes with curves, not an empty canvas

    # plot without matplotlib: one line that says how to get it
    missing = cli(
        "plot", run_url, "--out", str(tmp_path / "x.png"), pre="import sys; sys.modules['matplotlib'] = None"
    )
    assert_one_line_error(missing, 2, "pip install -e '.[plot]'")
    assert not (tmp_path / "x.png").exists()

    # an unknown name under a root with runs: the error lists what is there
    assert_one_line_error(cli("show", storage, "nope"), 2, "no run named 'nope'", "runs there: cli-run")
    assert_one_line_error(cli("plot", f"{storage}/nope", "--out", str(png)), 2, "no run named 'nope'")
    assert_one_line_error(cli("show", storage), 2, "not a run", "cli-run")

    # any fsspec URL: the same run copied to memory:// reads the same (in-process: memory:// is per process)
    import fsspec

    from cluster import inspect

    mem = fsspec.filesystem("memory")
    mem.put(run_url, "/cli-test/runs/cli-run", recursive=True)
    try:
        assert inspect.list_runs("memory://cli-test/runs") == [
            dataclasses.replace(s, url="memory://cli-test/runs/cli-run") for s in inspect.list_runs(storage)
        ]
    finally:
        mem.rm("/cli-test", recursive=True)

    # a corrupted older checkpoint is reported by --verify; a corrupted latest one makes list fall back
    with open(f"{run_url}/{step_dir(ckpt_steps[0])}/model.pt", "r+b") as fh:
        fh.write(b"garbage")
    rows = json.loads(cli("show", run_url, "--verify", "--json").stdout)["checkpoints"]
    assert [r["verified"] for r in rows] == [False, True, True]
    assert "fails its checksum" in rows[0]["problem"]
    with open(f"{run_url}/{step_dir(steps)}/model.pt", "r+b") as fh:
        fh.write(b"garbage")
    line = cli("list", storage).stdout.strip().splitlines()[1]
    assert line.split()[4] == str(ckpt_steps[1])


def test_errors_are_one_line_with_exit_2(tmp_path: pathlib.Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(cli("list", str(empty)), 2, "no runs under", str(empty))
    assert_one_line_error(cli("list", str(tmp_path / "does-not-exist")), 2, "no runs under")
    assert_one_line_error(cli("show", str(empty), "ghost"), 2, "no run named 'ghost'", "no runs at all")
    assert_one_line_error(cli("plot", str(empty / "ghost"), "--out", str(tmp_path / "p.png")), 2, "no runs")

    # a run folder with run.json but nothing else yet: listed as not finished; no metrics to plot
    run = tmp_path / "runs" / "young"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"name": "young", "config": {"training": {"epochs": 4}}}))
    out = cli("list", str(tmp_path / "runs"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[1].split()[:5] == ["young", "running/interrupted", "0/4", "0", "-"]
    assert_one_line_error(cli("plot", str(run), "--out", str(tmp_path / "p.png")), 2, "no metrics yet")
    assert_one_line_error(cli("list", str(tmp_path / "runs"), "-o", "novalue"), 2, "key=value")


BAD_URLS = [
    ("s3://", "names no bucket or host"),
    ("s3:/bucket/runs", "'s3:' must be followed by '//'"),
    ("nosuchproto://bucket/runs", "unknown storage protocol"),
    ("abfs://container/runs", "pip install 'cluster[azure]'"),
    ("s3://AKIAXX:hunter2hunter2@bucket/runs", "has credentials in it"),
    ("memory://runs", "memory:// lives inside one process"),
    ("runs:v2", "./runs:v2"),
]


@pytest.mark.parametrize(("url", "fragment"), BAD_URLS, ids=[u for u, _ in BAD_URLS])
def test_job_with_a_bad_storage_url_exits_2_before_ray(
    tmp_path: pathlib.Path, url: str, fragment: str
) -> None:
    """`python -m jobs.train` as a user runs it: exit 2, one line naming the fix, nothing written. RAY_ADDRESS
    points at a port where no Ray listens, so reaching ray.init would end in a connection error instead."""
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_ADDRESS": "127.0.0.1:9", "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "jobs.train", "--config", f"{REPO}/jobs/configs/tiny_cpu.yaml"]
    out = subprocess.run(
        [*cmd, "--set", f"storage={url}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    assert_one_line_error(out, 2, "config error: storage.url", fragment)
    assert "hunter2" not in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_show_with_a_malformed_url_is_one_line_exit_2() -> None:
    assert_one_line_error(cli("show", "s3:/bucket/runs/x"), 2, "'s3:' must be followed by '//'")
    assert_one_line_error(cli("list", "s3://"), 2, "names no bucket or host")
