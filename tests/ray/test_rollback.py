"""A NaN loss rolled back past its batches (failures.nan_skip_steps), against the same batches skipped by
hand (training.skip_steps), on a real local Ray with real gloo ranks.

Sample 413 is corrupt: any batch holding it has a NaN loss. With the sampler's order (seed 0, 512 samples,
global batch 32, 2 ranks) it lands on rank 1 at step 11 (epoch 1) and at step 32, the last (epoch 2):
- step 11: rank 1's NaN reaches every rank's weights through the all-reduce, so rank 0's logged loss is NaN
  at step 12: the window of 3 steps ending there is 10-12, and the run rolls back to checkpoint 8;
- step 32: rank 0's own loss is finite there; the epoch's mean is not, and every rank's first non-finite
  step, reduced over the ranks, names step 32: window 30-32, back to checkpoint 28."""

from __future__ import annotations

import io
import json
import math
import os

import pytest
import torch

from cluster import load_config, run_metrics, train
from cluster.inspect import format_show, read_events, report
from cluster.run.checkpoint import CheckpointStore
from cluster.run.storage import Storage
from tests.support.goodput import account

pytestmark = pytest.mark.timeout(240)

POISON = 413
WINDOWS = [(10, 12), (30, 32)]


def job(storage: str, name: str, audit_dir: str, *extra: str) -> list[str]:
    return [
        f"storage={storage}",
        f"name={name}",
        "task=tests.support.tasks:AuditTask",
        f"task_args.audit_dir={audit_dir}",
        f"task_args.nan_ids=[{POISON}]",
        "training.global_batch_size=32",
        "training.epochs=2",
        "training.log_every_steps=1",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=3",
        "failures.backoff_s=0.1",
        "failures.hot_spare=false",  # no rank dies: a NaN rolls back in place
        *extra,
    ]


def trained_steps(audit_dir: str) -> dict[int, list[dict]]:
    by_step: dict[int, list[dict]] = {}
    for name in os.listdir(audit_dir):
        for line in open(os.path.join(audit_dir, name)):
            rec = json.loads(line)
            by_step.setdefault(rec["step"], []).append(rec)
    return by_step


def test_a_nan_loss_rolls_back_past_its_batches_exactly_as_skipping_them_by_hand(
    tmp_path: object, ray_local: None
) -> None:
    storage = f"{tmp_path}/runs"
    auto_dir, hand_dir = f"{tmp_path}/audit_auto", f"{tmp_path}/audit_hand"
    os.makedirs(auto_dir)
    os.makedirs(hand_dir)

    out = io.StringIO()
    auto = job(storage, "auto", auto_dir, "failures.nan_skip_steps=3")
    cfg = load_config("jobs/configs/tiny_cpu.yaml", auto)
    result = train(cfg, out=out)
    assert result.status == "finished" and result.global_step == 32, out.getvalue()[-3000:]
    assert result.skipped_steps == WINDOWS
    assert [f["kind"] for f in result.failures] == ["user_error", "user_error"]  # each counted
    run = Storage(result.run_url)
    ev = read_events(run)
    rollbacks = [e for e in ev if e["event"] == "rollback"]
    assert [r["window"] for r in rollbacks] == [[10, 12], [30, 32]]
    assert [r["skipped"] for r in rollbacks] == [[10, 12], [30, 32]]
    assert [r["checkpoint_step"] for r in rollbacks] == [8, 28]
    # 10 (and 30) trained batches of the window: deleted, never resumed from by a later recovery
    assert [r["discarded"] for r in rollbacks] == [[10], [30]]
    ends = [e for e in ev if e["event"] == "epoch_end"]
    assert [e.get("skipped_steps") for e in ends] == [3, 3]  # each epoch's window, as its last pass ran
    decisions = [e for e in ev if e["event"] == "decision"]
    assert all(d["restart"] and d["source"] == "checkpoint" for d in decisions)
    assert "rolled back to checkpoint step 8" in out.getvalue()
    assert "the batches of steps 10-12 are skipped; deleted the newer checkpoints [10]" in out.getvalue()
    latest = CheckpointStore(run).load_latest()
    assert latest is not None and latest.info.step == 32
    assert latest.files["train_state.pt"]["skipped_steps"] == [[10, 12], [30, 32]]  # a resubmission's too
    # the metrics of the path the run took: each trained step once, none of the abandoned NaN rows
    final = run_metrics(result.run_url).to_pylist()
    steps = [r["global_step"] for r in final if r["kind"] == "step"]
    assert steps == [s for s in range(1, 33) if not any(a <= s <= b for a, b in WINDOWS)]
    assert all(math.isfinite(r["loss"]) for r in final)
    every = run_metrics(result.run_url, final=False).to_pylist()
    assert any(not math.isfinite(r["loss"]) for r in every)  # what was written stays: the rollbacks' NaN rows
    shown = format_show(report(run))
    assert "rollback" in shown and "10-12" in shown and "30-32" in shown
    # the goodput account: what each rollback threw away (from its checkpoint to where the NaN was seen) is
    # recomputed; the skipped steps train no batch: neither kept nor redone
    g = account(result.run_url)
    lost = sum(e["lost_steps"] for e in ev if e["event"] == "recovered")
    assert g.steps["recomputed"] == lost > 0 and g.seconds["recomputed"] > 0, g.steps
    assert g.steps["productive"] == 32 - 6 - 3 and g.seconds["recovery"] > 0  # each start's first step aside
    assert "goodput" in shown and "ETTR" in shown

    # The same batches skipped by hand, in loader processes this time: if a window missed the corrupt
    # batch, this run (no rollback) would stop diverged.
    skips = 'training.skip_steps=["10-12", "30-32"]'
    by_hand = job(storage, "hand", hand_dir, skips, "training.loader_workers=1")
    hand = train(load_config("jobs/configs/tiny_cpu.yaml", by_hand), out=io.StringIO())
    assert hand.status == "finished" and hand.attempts == 1 and hand.skipped_steps == WINDOWS
    want = CheckpointStore(Storage(hand.run_url)).load_latest()
    assert want is not None and want.info.step == 32
    for k, v in want.files["model.pt"].items():
        assert torch.equal(v, latest.files["model.pt"][k]), k  # bitwise: the rollback replayed exactly

    # The ranks' copies in memory (failures.nan_snapshot_steps=4; no step checkpoints, so without them each
    # rollback would go back to the run's start or the epoch's checkpoint): copies at 8 and 12 when step
    # 12's NaN is seen, 8 is before the window; at 28 and 32 at the epoch's end, 28 is. Nothing is read
    # from storage for either, and the run ends bitwise equal to the hand run.
    mem_dir = f"{tmp_path}/audit_memory"
    os.makedirs(mem_dir)
    memory = job(storage, "memory", mem_dir, "failures.nan_skip_steps=3", "failures.nan_snapshot_steps=4")
    memory = [a for a in memory if not a.startswith("checkpoint.")] + ["checkpoint.every_steps=0"]
    out = io.StringIO()
    mem = train(load_config("jobs/configs/tiny_cpu.yaml", memory), out=out)
    assert mem.status == "finished" and mem.global_step == 32 and mem.skipped_steps == WINDOWS
    mem_ev = read_events(Storage(mem.run_url))
    backs = [e for e in mem_ev if e["event"] == "rollback"]
    assert [(r["memory_step"], r["checkpoint_step"]) for r in backs] == [(8, None), (28, None)]
    assert [r["discarded"] for r in backs] == [[], []]  # no step checkpoints; epoch 1's (16) is before 28
    recovered = [e for e in mem_ev if e["event"] == "recovered"]
    assert [(r["source"], r["resume_step"], r["lost_steps"]) for r in recovered] == [
        ("memory", 8, 4),  # from 12, where the NaN was seen, back to 8
        ("memory", 28, 4),
    ]
    assert [r["storage_reads"] for r in recovered] == [0, 0]
    assert "rolled back to step 8 (the ranks' copy in memory)" in out.getvalue()
    assert (
        "from the newest state before step 10 (the ranks' copy in memory or a checkpoint)" in out.getvalue()
    )
    assert [d.get("rollback") for d in mem_ev if d["event"] == "decision"] == [[10, 12], [30, 32]]
    got = CheckpointStore(Storage(mem.run_url)).load_latest()
    assert got is not None and got.info.step == 32
    for k, v in want.files["model.pt"].items():
        assert torch.equal(v, got.files["model.pt"][k]), k  # bitwise, as from a checkpoint
    assert account(mem.run_url).steps["recomputed"] == 8

    # What the hand run trained: every step but the windows', both ranks, each sample once an epoch, never
    # the corrupt one.
    by_step = trained_steps(hand_dir)
    skipped = {s for a, b in WINDOWS for s in range(a, b + 1)}
    assert set(by_step) == set(range(1, 33)) - skipped
    for epoch in range(2):
        steps = range(16 * epoch + 1, 16 * epoch + 17)
        ids = [i for s in steps for r in by_step.get(s, []) for i in r["ids"]]
        assert len(ids) == len(set(ids)) == 32 * (16 - 3)
        assert POISON not in ids
    assert all(sorted(r["rank"] for r in recs) == [0, 1] for recs in by_step.values())
