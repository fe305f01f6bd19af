"""Spot preemption on a real multi-node Ray (ray.cluster_utils.Cluster, fast health checks): a node gets a
drain notice through Ray's GCS drain API (what the autoscaler and ``ray drain-node`` call) and is killed at
its deadline. The ranks on it must be gone by then, with nothing lost."""

from __future__ import annotations

import io
import os
import threading
import time
from typing import Any

import pytest

from cluster import load_checkpoint, load_config, train
from cluster.inspect import format_show, report
from cluster.run.storage import Storage
from tests.cluster.conftest import events, wait_for
from tests.support.goodput import account
from tests.support.tasks import audit

pytestmark = pytest.mark.timeout(300)

B, SAMPLES, EPOCHS = 32, 512, 6
STEPS = SAMPLES // B


def add_nodes(cluster: Any, n: int) -> None:
    for _ in range(n):  # one CPU each: one rank per node, no room for a hot spare
        cluster.add_node(num_cpus=1, resources={"trainer": 1})
    cluster.wait_for_nodes()


def job(tmp: str, name: str, *extra: str) -> list[str]:
    return [
        f"storage={tmp}/runs",
        f"name={name}",
        "task=tests.support.tasks:AuditTask",
        f"task_args={{audit_dir: {tmp}/audit-{name}, samples: {SAMPLES}, step_sleep_s: 0.12}}",
        "scaling.num_workers=2",
        "scaling.cpus_per_worker=1",
        "scaling.resources_per_worker={trainer: 1}",
        "scaling.resource_wait_s=30",
        f"training.global_batch_size={B}",
        f"training.epochs={EPOCHS}",
        "checkpoint.every_steps=8",
        "failures.backoff_s=0.1",
        "failures.hang_timeout_floor_s=60",
        *extra,
    ]


def in_background(tmp: str, name: str, *extra: str) -> tuple[threading.Thread, dict[str, Any]]:
    os.makedirs(f"{tmp}/audit-{name}")
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = train(
                load_config("jobs/configs/tiny_cpu.yaml", job(tmp, name, *extra)), io.StringIO()
            )
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)  # nodes are drained and killed from the main thread
    t.start()
    return t, box


def drain(cluster: Any, node_id: str, reason: str, seconds: float | None) -> tuple[bool, str]:
    """What ``ray drain-node`` does: the GCS drain API, with a deadline in ms since the epoch."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=cluster.address)
    deadline_ms = 0 if seconds is None else int((time.time() + seconds) * 1000)
    accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value(reason), "test", deadline_ms)
    return bool(accepted), str(why)


def kill_at(cluster: Any, node_id: str, at: float) -> threading.Thread:
    """The provider takes the node at the deadline (Ray does not kill a drained node by itself)."""

    def go() -> None:
        time.sleep(max(0.0, at - time.time()))
        (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
        cluster.remove_node(node, allow_graceful=False)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def rank_node(run_url: str, rank: int) -> str:
    return str(events(run_url, "group_started")[-1]["nodes"][rank])


def test_preemption_notice_moves_a_rank_before_the_deadline_with_no_step_lost(
    ray_cluster: Any, tmp_path: object
) -> None:
    """Three nodes, ranks on two: the node of rank 1 is drained (PREEMPTION, 20 s) and killed at the
    deadline. The rank moves to the free node between two steps from rank 0's memory, before the kill; no
    failure, no step lost, the final weights equal a run without the drain, bit for bit. An idle-termination
    drain of a node that holds a rank is refused by Ray and changes nothing."""
    import torch

    from cluster.worker_group.placement import draining_nodes

    add_nodes(ray_cluster, 3)
    tmp = str(tmp_path)
    ref_thread, ref_box = in_background(tmp, "ref")
    ref_thread.join(240)
    assert "error" not in ref_box, ref_box.get("error")
    run_url = f"{tmp}/runs/spot"
    trainer, box = in_background(tmp, "spot")
    wait_for(lambda: os.path.exists(f"{run_url}/checkpoints/step_{STEPS + 8:09d}/manifest.json"))
    node = rank_node(run_url, 1)
    accepted, why = drain(ray_cluster, node, "DRAIN_NODE_REASON_IDLE_TERMINATION", None)
    assert not accepted and "idle" in why.lower(), why  # Ray never takes a node with ranks as idle
    assert draining_nodes() == {}
    accepted, why = drain(ray_cluster, node, "DRAIN_NODE_REASON_PREEMPTION", 20)
    assert accepted, why
    deadline = time.time() + 20
    # the one internal read this feature relies on (cluster.worker_group.placement.draining_nodes): fail
    # loudly here if Ray changes it
    seen = draining_nodes()
    assert list(seen) == [node] and abs(seen[node] - deadline) < 2, seen  # type: ignore[operator]
    killer = kill_at(ray_cluster, node, deadline)
    trainer.join(240)
    killer.join(30)
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.status == "finished" and result.world_size == 2 and not result.failures
    (notice,) = events(run_url, "preemption_notice")
    assert notice["node"] == node and notice["ranks"] == [1] and 15 < notice["seconds_left"] <= 20
    (move,) = events(run_url, "preemption_move")
    assert move["ranks"] == [1] and move["source"] == "peers" and move["lost_steps"] == 0, move
    assert move["resume_step"] == move["stop_step"] and move["seconds_before_deadline"] > 0, move
    assert move["to_nodes"][0] != node
    assert not events(run_url, "failure") and not events(run_url, "recovered")
    first, second = events(run_url, "group_started")
    assert second["pids"][0] == first["pids"][0] and second["nodes"][1] != node  # rank 0 kept its process
    assert second["time"] < deadline  # the move finished before the node was taken
    sizes = audit(f"{tmp}/audit-spot", STEPS, B, EPOCHS)
    assert sizes == {2: EPOCHS * STEPS}
    trained = sum(1 for name in os.listdir(f"{tmp}/audit-spot") for _ in open(f"{tmp}/audit-spot/{name}"))
    assert trained == 2 * EPOCHS * STEPS  # every step trained once per rank: nothing lost, nothing redone
    got, want = load_checkpoint(run_url).model, load_checkpoint(ref_box["result"].run_url).model
    assert all(torch.equal(got[k], want[k]) for k in want)
    shown = format_show(report(Storage(run_url)))  # what `python -m cluster show` prints
    assert "preemption notices (1)" in shown and " moved " in shown, shown
    # the goodput account: the move's time is its own class, and nothing was trained twice
    g = account(run_url)
    assert g.seconds["moves"] > 0 and g.steps["recomputed"] == 0 and g.seconds["recovery"] == 0, g.seconds


def test_no_spare_node_shrinks_before_the_deadline_with_exact_samples(
    ray_cluster: Any, tmp_path: object
) -> None:
    """Two nodes only: no replacement can be placed. With ``scaling.min_workers=1`` the group commits a
    checkpoint at a step boundary and continues on one rank before the deadline; every sample of every
    epoch is trained exactly once."""
    add_nodes(ray_cluster, 2)
    tmp = str(tmp_path)
    run_url = f"{tmp}/runs/shrink"
    trainer, box = in_background(
        tmp, "shrink", "scaling.min_workers=1", "failures.preemption_margin_s=14", "scaling.resource_wait_s=4"
    )
    wait_for(lambda: os.path.exists(f"{run_url}/checkpoints/step_{STEPS + 8:09d}/manifest.json"))
    node = rank_node(run_url, 1)
    assert drain(ray_cluster, node, "DRAIN_NODE_REASON_PREEMPTION", 20)[0]
    deadline = time.time() + 20
    killer = kill_at(ray_cluster, node, deadline)
    trainer.join(240)
    killer.join(30)
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.status == "finished" and not result.failures
    (ck,) = events(run_url, "preemption_checkpoint")
    assert ck["committed"] and "no room" in ck["reason"] and ck["seconds_before_deadline"] > 0, ck
    (resize,) = [e for e in events(run_url, "resize") if "preemption" in e["reason"]]
    assert (resize["old"], resize["new"]) == (2, 1) and resize["lost_steps"] == 0, resize
    assert resize["time"] < deadline
    assert not events(run_url, "failure")
    sizes = audit(f"{tmp}/audit-shrink", STEPS, B, EPOCHS)
    assert set(sizes) == {1, 2} and sum(sizes.values()) == EPOCHS * STEPS


def test_a_notice_too_short_for_a_move_commits_a_checkpoint_before_the_deadline(
    ray_cluster: Any, tmp_path: object
) -> None:
    """A 6 s notice, under the 10 s margin: rank 0 commits a checkpoint at a step boundary at once; the
    group goes on (min_workers rules out shrinking) until the node is taken, then recovers from rank 0's
    memory as from any lost node."""
    add_nodes(ray_cluster, 3)
    tmp = str(tmp_path)
    run_url = f"{tmp}/runs/short"
    trainer, box = in_background(tmp, "short")
    wait_for(lambda: os.path.exists(f"{run_url}/checkpoints/step_{STEPS + 8:09d}/manifest.json"))
    node = rank_node(run_url, 1)
    assert drain(ray_cluster, node, "DRAIN_NODE_REASON_PREEMPTION", 6)[0]
    deadline = time.time() + 6
    killer = kill_at(ray_cluster, node, deadline)
    trainer.join(240)
    killer.join(30)
    assert "error" not in box, box.get("error")
    assert box["result"].status == "finished"
    (ck,) = events(run_url, "preemption_checkpoint")
    assert ck["committed"] and "preemption_margin_s" in ck["reason"], ck
    (commit,) = [e for e in events(run_url, "checkpoint") if e["step"] == ck["step"]]
    assert commit["time"] < deadline  # committed before the node went
    (failure,) = events(run_url, "failure")
    assert failure["kind"] == "node_lost"
    assert audit(f"{tmp}/audit-short", STEPS, B, EPOCHS) == {2: EPOCHS * STEPS}


def test_a_smaller_group_grows_back_in_the_middle_of_an_epoch(ray_cluster: Any, tmp_path: object) -> None:
    """One node for two ranks: the job starts with one (scaling.min_workers=1). A node joins in the middle
    of a long epoch: the group stops at the next step boundary with a checkpoint and continues at two ranks
    from it, without waiting for the epoch's end; every sample is trained exactly once."""
    add_nodes(ray_cluster, 1)
    tmp = str(tmp_path)
    run_url = f"{tmp}/runs/grow"
    long_epochs = 4 * SAMPLES  # 64 steps an epoch
    trainer, box = in_background(
        tmp,
        "grow",
        "scaling.min_workers=1",
        "scaling.resource_wait_s=2",
        "training.epochs=2",
        "failures.hang_timeout_floor_s=20",  # heartbeats every second: room is seen within one
        f"task_args={{audit_dir: {tmp}/audit-grow, samples: {long_epochs}, step_sleep_s: 0.08}}",
    )
    wait_for(lambda: os.path.exists(f"{run_url}/checkpoints/step_{8:09d}/manifest.json"))
    add_nodes(ray_cluster, 1)
    trainer.join(240)
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.status == "finished" and result.world_size == 2
    grow = [e for e in events(run_url, "resize") if e["new"] == 2]
    assert len(grow) == 1 and grow[0]["at_step"] % (long_epochs // B) != 0, grow  # mid-epoch
    assert any(e["step"] == grow[0]["at_step"] for e in events(run_url, "checkpoint"))
    sizes = audit(f"{tmp}/audit-grow", long_epochs // B, B, 2)
    assert set(sizes) == {1, 2} and sum(sizes.values()) == 2 * long_epochs // B


def test_a_slow_rank_is_moved_to_another_node_between_two_steps(ray_cluster: Any, tmp_path: object) -> None:
    """``failures.slow_rank_action=move``: rank 1 turns slow (the ``slow`` fault from step 10); the driver
    names it, places a replacement on another node, prepares it while training goes on, and swaps it in
    between two steps with rank 0's state: no failure, no step lost or trained twice. Two nodes of three
    CPUs: PACK puts both ranks on one, which keeps a free CPU, where a placement that did not avoid the slow
    node would put the replacement."""
    for _ in range(2):
        ray_cluster.add_node(num_cpus=3, resources={"trainer": 3})
    ray_cluster.wait_for_nodes()
    tmp = str(tmp_path)
    run_url = f"{tmp}/runs/slow"
    trainer, box = in_background(
        tmp,
        "slow",
        "failures.hot_spare=false",
        "failures.slow_rank_action=move",
        "failures.slow_rank_ratio=1.2",  # 0.12 s of the task's own sleep + the fault's 0.05 s
        "failures.inject=[{rank: 1, step: 10, kind: slow}]",
        "failures.hang_timeout_s=20",  # a heartbeat a second
    )
    trainer.join(240)
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.status == "finished" and result.world_size == 2 and not result.failures
    (slow,) = events(run_url, "slow_rank")
    assert slow["rank"] == 1
    (begun,) = events(run_url, "slow_rank_move")
    (moved,) = events(run_url, "slow_rank_moved")
    assert moved["ranks"] == [1] and moved["source"] == "peers" and moved["lost_steps"] == 0, moved
    first, second = events(run_url, "group_started")
    assert first["nodes"][0] == first["nodes"][1] == begun["node"]  # packed, with a CPU to spare
    assert second["nodes"][1] != begun["node"]  # the replacement went to the other node
    assert second["pids"][0] == first["pids"][0]  # rank 0 kept its process and state
    assert not events(run_url, "failure") and not events(run_url, "recovered")
    sizes = audit(f"{tmp}/audit-slow", STEPS, B, EPOCHS)
    assert sizes == {2: EPOCHS * STEPS}
    trained = sum(1 for name in os.listdir(f"{tmp}/audit-slow") for _ in open(f"{tmp}/audit-slow/{name}"))
    assert trained == 2 * EPOCHS * STEPS  # every step once per rank

    # Ray's scheduler may pick the other node by itself: show that the selector the move uses keeps a
    # bundle off the nodes it names. A bundle of a whole node's trainer slots fits either node, and is
    # placed on the one not avoided; with both avoided, nowhere.
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    from cluster.worker_group import avoid_selector

    slow_node, other = begun["node"], second["nodes"][1]
    pg = placement_group([{"trainer": 3}], bundle_label_selector=avoid_selector([slow_node], 1))
    assert ray.get(pg.ready(), timeout=30)
    assert placement_group_table(pg)["bundles_to_node_id"][0] == other
    remove_placement_group(pg)
    nowhere = placement_group([{"trainer": 3}], bundle_label_selector=avoid_selector([slow_node, other], 1))
    ready, _ = ray.wait([nowhere.ready()], timeout=3)
    assert not ready
    remove_placement_group(nowhere)


def test_a_notice_on_the_only_node_changes_nothing_a_run_without_the_guard_would_not_have(
    ray_cluster: Any, tmp_path: object
) -> None:
    """Never worse, on ONE node with the defaults: the only node that trains gets a drain notice
    (PREEMPTION, 20 s) that its provider never carries out (a soft notice, or one taken back). With nowhere
    to move, the guard may commit a checkpoint, but the same ranks go on: the run finishes with no failure,
    no step recomputed, no rank restarted, and its final weights equal those of the same job with the guard
    off (``failures.preemption=false``), bit for bit."""
    import torch

    ray_cluster.add_node(num_cpus=2, resources={"trainer": 2})
    ray_cluster.wait_for_nodes()
    tmp = str(tmp_path)
    off_thread, off_box = in_background(tmp, "guard_off", "failures.preemption=false", "training.epochs=3")
    off_thread.join(240)
    assert "error" not in off_box, off_box.get("error")
    assert off_box["result"].status == "finished"
    run_url = f"{tmp}/runs/guard_on"
    trainer, box = in_background(tmp, "guard_on", "training.epochs=3")
    wait_for(lambda: os.path.exists(f"{run_url}/checkpoints/step_{8:09d}/manifest.json"))
    node = rank_node(run_url, 1)
    assert rank_node(run_url, 0) == node  # the only node that trains
    assert drain(ray_cluster, node, "DRAIN_NODE_REASON_PREEMPTION", 20)[0]
    trainer.join(240)
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.status == "finished" and result.world_size == 2 and not result.failures
    (notice,) = events(run_url, "preemption_notice")
    assert notice["node"] == node and sorted(notice["ranks"]) == [0, 1], notice
    for kind in ("failure", "recovered", "resize"):
        assert not events(run_url, kind), kind
    assert not events(run_url, "preemption_move"), "a move with nowhere to go"
    for ck in events(run_url, "preemption_checkpoint"):
        assert ck["committed"], ck
    (started,) = events(run_url, "group_started")  # the same processes from start to end
    assert started["nodes"] == [node, node]
    assert audit(f"{tmp}/audit-guard_on", STEPS, B, 3) == {2: 3 * STEPS}
    assert account(run_url).steps["recomputed"] == 0
    got, want = load_checkpoint(run_url).model, load_checkpoint(off_box["result"].run_url).model
    assert all(torch.equal(got[k], want[k]) for k in want)
