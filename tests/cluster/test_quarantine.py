"""Lemon nodes kept out, on several real Ray nodes (ray.cluster_utils.Cluster): rank 1's process is SIGKILLed
twice on the same node (the ``crash`` fault, on the first start and after the first recovery). The node is
quarantined at the second death: rank 1 is re-placed on the free node, and no rank goes back to it, neither
for the rest of the run nor in a resubmission, which, with no other room, trains smaller instead, or waits
for room and fails naming the node when it may not shrink."""

from __future__ import annotations

import io
import os
from typing import Any

import pytest

from cluster import load_config, train
from cluster.core.errors import ResourcesUnavailableError
from cluster.inspect import format_show, report
from cluster.run.quarantine import read
from cluster.run.storage import Storage
from tests.cluster.conftest import events

pytestmark = pytest.mark.timeout(300)

B, SAMPLES = 32, 256


def job(tmp: str, *extra: str) -> list[str]:
    return [
        f"storage={tmp}/runs",
        "name=lemon",
        "task=tests.support.tasks:AuditTask",
        f"task_args={{audit_dir: {tmp}/audit, samples: {SAMPLES}, step_sleep_s: 0.03}}",
        "scaling.num_workers=2",
        "scaling.resources_per_worker={trainer: 1}",
        "scaling.resource_wait_s=4",
        f"training.global_batch_size={B}",
        "checkpoint.every_steps=4",
        "failures.backoff_s=0.1",
        "failures.hot_spare=false",  # rank 1's replacement starts in its own bundle, on its node
        *extra,
    ]


def test_two_deaths_on_one_node_keep_it_out_for_the_run_and_its_resubmission(
    ray_cluster: Any, tmp_path: object
) -> None:
    for _ in range(3):
        ray_cluster.add_node(num_cpus=2, resources={"trainer": 1})
    tmp = str(tmp_path)
    os.makedirs(f"{tmp}/audit")
    faults = (
        "failures.inject=[{rank: 1, step: 3, kind: crash, attempt: 0}, "
        "{rank: 1, step: 6, kind: crash, attempt: 1}]"
    )
    out = io.StringIO()
    result = train(load_config("jobs/configs/tiny_cpu.yaml", job(tmp, "training.epochs=2", faults)), out=out)
    assert result.status == "finished" and result.world_size == 2
    run_url = result.run_url
    assert [f["kind"] for f in events(run_url, "failure")] == ["worker_died", "worker_died"]
    groups = events(run_url, "group_started")
    lemon = groups[0]["nodes"][1]
    assert groups[1]["nodes"][1] == lemon  # the first death: rank 1 started again in its bundle there
    (q,) = events(run_url, "node_quarantined")
    assert q["node"] == lemon and [i["kind"] for i in q["incidents"]] == ["worker_died", "worker_died"]
    assert "quarantined after" in out.getvalue()
    assert len(groups) == 3 and lemon not in groups[2]["nodes"], groups[2]["nodes"]
    assert groups[2]["pids"][0] == groups[1]["pids"][0]  # rank 0 kept its process (and sent its state)
    assert read(Storage(run_url))[lemon].quarantined
    shown = format_show(report(Storage(run_url)))  # python -m cluster show: the node, its incidents
    assert f"{lemon[:12]}" in shown and "QUARANTINED" in shown and "worker_died at step" in shown, shown

    # A resubmission, with the other free node gone: only the quarantined node has room for a second rank
    (other,) = {n.node_id for n in ray_cluster.worker_nodes} - {lemon, groups[2]["nodes"][0]}
    (node,) = [n for n in ray_cluster.worker_nodes if n.node_id == other]
    ray_cluster.remove_node(node, allow_graceful=False)
    out = io.StringIO()
    cfg = load_config("jobs/configs/tiny_cpu.yaml", job(tmp, "training.epochs=3", "scaling.min_workers=1"))
    again = train(cfg, out=out)
    assert again.status == "finished"
    later = events(run_url, "group_started")[3:]
    assert later and all(lemon not in g["nodes"] for g in later), [g["nodes"] for g in later]
    assert later[0]["nodes"] == [groups[2]["nodes"][0]]  # one rank, on the one node not kept out
    assert f"smaller: quarantined node(s) {lemon[:12]}" in out.getvalue()

    # Without scaling.min_workers to shrink to, it waits for room as for any resources, and says why
    with pytest.raises(ResourcesUnavailableError, match=rf"quarantined node\(s\) {lemon[:12]} are kept out"):
        train(load_config("jobs/configs/tiny_cpu.yaml", job(tmp, "training.epochs=4")), out=io.StringIO())
