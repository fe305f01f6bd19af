"""The tiny job across real separate hosts: network namespaces on a bridge, a Ray head in one and a
worker node in each of three others, gloo over the namespaces' interfaces. 8 ranks, packed 4 + 4 on two
nodes; the raylet of the node holding ranks 4-7 is killed (kill -9) mid-run: one incident, one recovery,
the 4 survivors keep their processes and hand their state to 4 new ranks on the spare node.

    sudo pytest tests/cluster/test_multihost.py -m "cluster and slow"     # root: it creates namespaces
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from cluster.inspect import read_events
from cluster.run.checkpoint import CheckpointStore
from cluster.run.storage import Storage
from tests.cluster.netns import IFNAME, Hosts, NetnsUnavailable, kill_all, start_node
from tests.cluster.rayproc import EXCLUDES, RAY, REPO, ray_env
from tests.support.procs import cmdline

pytestmark = pytest.mark.slow

# Fast failure detection: a node whose raylet stops answering is declared dead after ~3 s, not ~30 s.
HEALTH = json.dumps(
    {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
)


def worker_hosts(hosts: Hosts) -> dict[int, list[int]]:
    """namespace index -> pids of the DDP worker actors (process title ray::_WorkerActor...) in it."""
    found: dict[int, list[int]] = {}
    for i in range(len(hosts.names)):
        pids = [p for p in hosts.pids(i) if cmdline(p).startswith("ray::_WorkerActor")]
        if pids:
            found[i] = pids
    return found


@pytest.mark.timeout(420)
def test_job_across_hosts_survives_a_lost_node() -> None:
    hosts = Hosts(4)  # h0: head (runs the job's driver); h1-h3: four trainer slots each, one node spare
    base = tempfile.mkdtemp(prefix="hm", dir="/tmp")
    storage = os.path.join(base, "runs")  # one filesystem: every namespace sees the same folder
    log_path = os.path.join(base, "submit.log")
    submit: subprocess.Popen[bytes] | None = None
    env = ray_env(os.path.join(base, "home"))
    try:
        try:
            hosts.setup()
        except NetnsUnavailable as exc:
            pytest.skip(str(exc))
        start_node(hosts, 0, f"{base}/n0", env, None, "--num-cpus=1", f"--system-config={HEALTH}")
        for i in (1, 2, 3):
            start_node(
                hosts, i, f"{base}/n{i}", env, hosts.addr(0), "--num-cpus=2", '--resources={"trainer": 4}'
            )

        overrides = [
            f"storage={storage}",
            "name=multihost",
            "task_args.max_chars=40000",
            "task_args.d_model=32",
            "task_args.n_layers=1",
            "task_args.context=32",
            "training.global_batch_size=32",
            "training.log_every_steps=1",
            "failures.hang_timeout_floor_s=60",
            "training.epochs=2",  # 39 steps an epoch: the raylet dies at the first checkpoint (step 5)
            "checkpoint.every_steps=5",
            f"scaling.socket_ifname={IFNAME}",
            "scaling.resources_per_worker={trainer: 1}",
            "scaling.num_workers=8",
            "scaling.cpus_per_worker=0.5",
            "scaling.placement_strategy=PACK",
            "scaling.resource_wait_s=60",
        ]
        args = [
            *hosts.exec(0),
            RAY,
            "job",
            "submit",
            "--address",
            f"http://{hosts.addr(0)}:8265",
            "--working-dir",
            REPO,
            "--runtime-env-json",
            json.dumps({"excludes": EXCLUDES}),
            "--",
            "python",
            "-m",
            "jobs.train",
            "--config",
            "jobs/configs/tiny_cpu.yaml",
            *[a for o in overrides for a in ("--set", o)],
        ]
        with open(log_path, "wb") as log:
            submit = subprocess.Popen(
                args, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

        store = CheckpointStore(Storage(os.path.join(storage, "multihost")))
        deadline = time.monotonic() + 180
        while not store.list():
            assert submit.poll() is None, f"job ended before its first checkpoint:\n{tail(log_path)}"
            assert time.monotonic() < deadline, f"no checkpoint within 180 s:\n{tail(log_path)}"
            time.sleep(0.3)
        placed = worker_hosts(hosts)
        assert sorted(len(p) for p in placed.values()) == [4, 4], f"not 4 + 4 workers: {placed}"
        assert 0 not in placed, "a worker landed on the head, which has no trainer slot"
        started = [
            e
            for e in read_events(Storage(os.path.join(storage, "multihost")))
            if e["event"] == "group_started"
        ]
        pids = started[0]["pids"]
        victim = next(i for i, p in placed.items() if pids[4] in p)  # the node of ranks 4-7
        raylets = [p for p in hosts.pids(victim) if "/raylet/raylet" in cmdline(p).split(" ")[0]]
        assert len(raylets) == 1, [cmdline(p) for p in hosts.pids(victim)]
        t_kill = time.time()
        os.kill(raylets[0], signal.SIGKILL)

        rc = submit.wait(timeout=240)
        out = tail(log_path, 12000)
        assert rc == 0, out
        assert "result: status=finished" in out, out

        events = read_events(Storage(os.path.join(storage, "multihost")))
        kinds = [e["event"] for e in events]
        print(
            f"killed the raylet of {hosts.names[victim]}; events:",
            *[json.dumps(e)[:300] for e in events],
            sep="\n",
        )
        failures = [i for i, e in enumerate(events) if e["event"] == "failure"]
        assert len(failures) == 1, kinds  # four ranks died at once: one incident
        first = events[failures[0]]
        assert first["kind"] == "node_lost" and first["time"] >= t_kill, first
        assert kinds.count("recovered") == 1 and kinds.count("decision") == 1, kinds
        rec = next(e for e in events if e["event"] == "recovered")
        assert rec["source"] == "peers" and rec["reused_workers"] == 4 and rec["lost_steps"] <= 1, rec
        restarts = [e for e in events[failures[0] :] if e["event"] == "group_started"]
        assert len(restarts) == 1 and restarts[0]["world_size"] == 8 and restarts[0]["resume_step"] > 0
        assert restarts[0]["pids"][:4] == pids[:4]  # the survivors kept their processes
        assert kinds[-1] == "finished", kinds
        latest = store.load_latest()
        assert latest is not None and latest.info.step == events[-1]["global_step"]
    finally:
        if submit is not None and submit.poll() is None:
            os.killpg(submit.pid, signal.SIGKILL)
            submit.wait(timeout=30)
        survivors = kill_all(hosts, [base])
        left = hosts.teardown()
        shutil.rmtree(base, ignore_errors=True)
        assert not survivors, f"processes survived SIGKILL: {survivors}"
        assert not left, f"network objects left behind: {left}"


def tail(path: str, n: int = 6000) -> str:
    with open(path, errors="replace") as fh:
        return fh.read()[-n:]
