"""Several Ray nodes on one machine (ray.cluster_utils.Cluster, fast health checks): lose a node mid-run.

With spare capacity the job recovers at full size; without it, it continues at min_workers and grows back
when a node is added. An id audit shows every sample of each epoch trained exactly once."""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from cluster import load_config, train
from tests.cluster.conftest import events, wait_for
from tests.support.tasks import audit

pytestmark = pytest.mark.timeout(300)

B, SAMPLES, EPOCHS = 32, 512, 3
STEPS = SAMPLES // B


def add_trainer_node(cluster: Any) -> Any:
    return cluster.add_node(num_cpus=2, resources={"trainer": 1})


def job(tmp: str, name: str, *extra: str) -> list[str]:
    return [
        f"storage={tmp}/runs",
        f"name={name}",
        "task=tests.support.tasks:AuditTask",
        f"task_args={{audit_dir: {tmp}/audit, samples: {SAMPLES}, step_sleep_s: 0.06}}",
        "scaling.num_workers=2",
        "scaling.resources_per_worker={trainer: 1}",
        "scaling.resource_wait_s=4",
        f"training.global_batch_size={B}",
        f"training.epochs={EPOCHS}",
        "checkpoint.every_steps=4",
        "failures.backoff_s=0.1",
        "failures.hang_timeout_floor_s=60",
        *extra,
    ]


def when(cond: Callable[[], bool], action: Callable[[], None]) -> threading.Thread:
    """Run ``action`` in a background thread once ``cond`` holds."""

    def go() -> None:
        wait_for(cond)
        action()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def remove_node_of_rank(cluster: Any, run_url: str, rank: int) -> None:
    node_id = events(run_url, "group_started")[-1]["nodes"][rank]
    (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
    cluster.remove_node(node, allow_graceful=False)


def test_lost_node_with_spare_capacity_recovers_at_full_size(ray_cluster: Any, tmp_path: object) -> None:
    for _ in range(3):
        add_trainer_node(ray_cluster)
    tmp = str(tmp_path)
    os.makedirs(f"{tmp}/audit")
    run_url = f"{tmp}/runs/spare"
    ckpt = f"{run_url}/checkpoints/step_{STEPS + 4:09d}/manifest.json"  # mid epoch 2
    killer = when(lambda: os.path.exists(ckpt), lambda: remove_node_of_rank(ray_cluster, run_url, 1))
    result = train(load_config("jobs/configs/tiny_cpu.yaml", job(tmp, "spare")), out=io.StringIO())
    killer.join(1)
    assert result.status == "finished" and result.world_size == 2
    failure = events(run_url, "failure")[0]
    assert failure["kind"] == "node_lost", failure
    # rank 0's node survived: it keeps its process and sends its state to the new rank 1
    (rec,) = events(run_url, "recovered")
    assert rec["source"] == "peers" and rec["lost_steps"] <= 1 and rec["storage_reads"] == 0, rec
    first, second = events(run_url, "group_started")
    assert second["pids"][0] == first["pids"][0] and second["nodes"][1] != first["nodes"][1]
    assert not events(run_url, "resize")
    sizes = audit(f"{tmp}/audit", STEPS, B, EPOCHS)
    assert sizes == {2: EPOCHS * STEPS}


def test_a_node_with_4_of_8_ranks_lost_is_one_incident_recovered_from_peers_exactly(
    ray_cluster: Any, tmp_path: object
) -> None:
    """8 ranks packed 4 + 4 on two nodes, a third node free. The node of ranks 4-7 is removed (its raylet
    and every process on it, at once): one failure, one recovery, the 4 survivors keep their processes and
    send the state; the final weights equal a run without the failure, bit for bit."""
    import torch

    from cluster import load_checkpoint

    for _ in range(3):
        ray_cluster.add_node(num_cpus=2, resources={"trainer": 4})
    tmp = str(tmp_path)
    os.makedirs(f"{tmp}/audit")
    eight = ["scaling.num_workers=8", "scaling.cpus_per_worker=0.5", "scaling.placement_strategy=PACK"]
    ref = train(
        load_config("jobs/configs/tiny_cpu.yaml", [*job(tmp, "ref"), *eight, "failures.hot_spare=false"]),
        out=io.StringIO(),
    )
    assert ref.status == "finished"
    for name in os.listdir(f"{tmp}/audit"):
        os.remove(f"{tmp}/audit/{name}")
    run_url = f"{tmp}/runs/node8"
    ckpt = f"{run_url}/checkpoints/step_{STEPS + 4:09d}/manifest.json"
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = train(
                load_config("jobs/configs/tiny_cpu.yaml", [*job(tmp, "node8"), *eight]), out=io.StringIO()
            )
        except BaseException as exc:
            box["error"] = exc

    trainer = threading.Thread(target=run, daemon=True)  # nodes are removed from the main thread
    trainer.start()
    wait_for(lambda: os.path.exists(ckpt))
    nodes = events(run_url, "group_started")[-1]["nodes"]
    assert len(set(nodes)) == 2 and nodes[:4] == [nodes[0]] * 4, nodes  # packed 4 + 4
    remove_node_of_rank(ray_cluster, run_url, 4)
    trainer.join(240)
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.status == "finished" and result.world_size == 8 and len(result.failures) == 1
    (failure,) = events(run_url, "failure")
    assert failure["kind"] == "node_lost", failure
    assert len(events(run_url, "decision")) == 1
    (rec,) = events(run_url, "recovered")
    assert rec["source"] == "peers" and rec["reused_workers"] == 4 and rec["storage_reads"] == 0, rec
    first, second = events(run_url, "group_started")
    assert second["pids"][:4] == first["pids"][:4]  # the survivors kept their processes
    assert set(second["nodes"][4:]).isdisjoint(first["nodes"])  # the lost ranks moved to the free node
    assert audit(f"{tmp}/audit", STEPS, B, EPOCHS) == {8: EPOCHS * STEPS}
    got, want = load_checkpoint(run_url).model, load_checkpoint(ref.run_url).model
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_without_spare_continues_at_min_workers_then_grows_back(ray_cluster: Any, tmp_path: object) -> None:
    for _ in range(2):
        add_trainer_node(ray_cluster)
    tmp = str(tmp_path)
    os.makedirs(f"{tmp}/audit")
    run_url = f"{tmp}/runs/elastic"
    cfg = load_config("jobs/configs/tiny_cpu.yaml", job(tmp, "elastic", "scaling.min_workers=1"))
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = train(cfg, out=io.StringIO())
        except BaseException as exc:
            box["error"] = exc

    # Ray's Cluster helper must add and remove nodes from the main thread: the job runs in a thread.
    trainer = threading.Thread(target=run, daemon=True)
    trainer.start()
    wait_for(lambda: os.path.exists(f"{run_url}/checkpoints/step_{4:09d}/manifest.json"))
    remove_node_of_rank(ray_cluster, run_url, 1)
    wait_for(lambda: any(e["new"] == 1 for e in events(run_url, "resize")))
    time.sleep(1.0)  # let it train shrunk for a while
    add_trainer_node(ray_cluster)
    trainer.join(240)
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.status == "finished"
    assert result.world_size == 2
    resizes = events(run_url, "resize")
    assert [(e["old"], e["new"]) for e in resizes] == [(2, 1), (1, 2)], resizes
    assert all(e["reason"] for e in resizes)
    sizes = audit(f"{tmp}/audit", STEPS, B, EPOCHS)
    assert sizes.get(1, 0) > 0 and sizes.get(2, 0) > 0  # trained at both sizes ...
    assert sum(sizes.values()) == EPOCHS * STEPS  # ... every step exactly once (audit checked ids)
