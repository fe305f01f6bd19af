"""Real gloo process groups in real processes (no Ray): the hand-written DDP worker's math."""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess.mp_helpers import run_workers, tiny_config

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow  # > 10 s on 2 cores: full suite only
def test_two_workers_equal_one_process_on_the_same_global_batch(tmp_path: object) -> None:
    # SGD, not Adam: Adam's update is invariant to the gradient's scale and would hide a scaling bug.
    overrides = [
        "training.max_steps_per_epoch=6",
        "training.epochs=2",
        "checkpoint.every_epochs=0",
        "task_args.optimizer=sgd",
        "task_args.lr=0.1",
    ]
    plan = [(0, 0), (1, 0)]
    one = run_workers(
        1, tiny_config(f"{tmp_path}/a", overrides), f"{tmp_path}/a/one", plan, str(_mk(tmp_path, "o1"))
    )
    two = run_workers(
        2, tiny_config(f"{tmp_path}/b", overrides), f"{tmp_path}/b/two", plan, str(_mk(tmp_path, "o2"))
    )
    # both ranks of the pair hold the same parameters ...
    for name, value in two[0]["params"].items():
        torch.testing.assert_close(two[1]["params"][name], value, rtol=0, atol=0)
    # ... and they equal single-process training on the same global batch
    for name, value in one[0]["params"].items():
        torch.testing.assert_close(two[0]["params"][name], value, rtol=1e-5, atol=1e-6)
    assert one[0]["epochs"][-1][1] == two[0]["epochs"][-1][1] == 12  # global steps
    # and the parameters actually moved
    assert one[0]["epochs"][0][2] > one[0]["epochs"][-1][2]
    # rank 0's logged gradient norm is the global batch's (after the all-reduce), as one process's is
    norms_one = [r["grad_norm"] for r in one[0]["rows"]]
    norms_two = [r["grad_norm"] for r in two[0]["rows"]]
    assert len(norms_two) == 12 and all(n is not None and n > 0 for n in norms_two)
    torch.testing.assert_close(torch.tensor(norms_two), torch.tensor(norms_one), rtol=1e-5, atol=0)
    # and its peak memory: a CPU process's resident set, a few hundred MiB with torch loaded
    assert all(0.05 < r["peak_mem_gib"] < 16 for r in two[0]["rows"])


def test_gradients_identical_across_ranks(tmp_path: object) -> None:
    cfg = tiny_config(f"{tmp_path}/s", ["training.max_steps_per_epoch=1"])
    out = tmp_path / "g"
    out.mkdir()
    res = run_workers(2, cfg, f"{tmp_path}/s/run", [], str(out), grads=True)
    g0, g1 = res[0]["grads"], res[1]["grads"]
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=0, atol=0)
    assert any(float(g.abs().sum()) > 0 for g in g0.values())


@pytest.mark.slow  # > 10 s on 2 cores: full suite only
def test_grad_accumulation_matches_single_big_batch(tmp_path: object) -> None:
    base = [
        "training.max_steps_per_epoch=4",
        "checkpoint.every_epochs=0",
        "task_args.optimizer=sgd",
        "task_args.lr=0.1",
    ]
    plain = run_workers(
        2, tiny_config(f"{tmp_path}/p", base), f"{tmp_path}/p/r", [(0, 0)], str(_mk(tmp_path, "p1"))
    )
    accum = run_workers(
        2,
        tiny_config(f"{tmp_path}/q", [*base, "training.grad_accum_steps=2"]),
        f"{tmp_path}/q/r",
        [(0, 0)],
        str(_mk(tmp_path, "q1")),
    )
    for name, value in plain[0]["params"].items():
        torch.testing.assert_close(accum[0]["params"][name], value, rtol=1e-5, atol=1e-6)


def _mk(tmp_path: object, name: str) -> object:
    path = tmp_path / name  # type: ignore[operator]
    path.mkdir()
    return path
