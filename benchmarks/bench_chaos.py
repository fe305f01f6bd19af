"""Chaos: one seeded stream of mixed faults, the product vs Ray Train V2 vs torchrun, and where the wall
clock went.

    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.bench_chaos                 # full: ~35-40 min
    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.bench_chaos --smoke --out-dir /tmp/chaos

Workload (every arm): the char-LM (``benchmarks.chaos_task:ChaosCharLM``, tiny_cpu.yaml's model) on
``--ranks`` CPU ranks over gloo, global batch 64, seed 0, checkpoints every ``--ckpt-every`` steps (about two
minutes' worth in full mode) to S3 (a loopback ``moto_server``: the storage outage is real), ``--epochs``
epochs (about 10 minutes of training at 8 ranks on 2 cores).

Arms (each in fresh processes; the Ray arms on their own multi-node Ray, ``ray.cluster_utils.Cluster``: a
head and ``--nodes`` nodes with a ``trainer`` slot per CPU):

  product   python -m jobs.train (its own driver process, RAY_ADDRESS set), failures.max_failures=-1,
            nan_skip_steps=1 (a NaN rolls back and skips that batch), slow_rank_action=move, hang floor
            ``--hang-timeout``, quarantine_after=0 (the faults hit healthy nodes at random); more with
            ``--product-set KEY=VALUE``
  raytrain  TorchTrainer (V2), FailureConfig(max_failures=-1), checkpoints via ray.train.report to the same
            S3, TorchConfig(timeout_s=--hang-timeout); a resubmission resumes from the run's snapshot
  torchrun  python -m torch.distributed.run --standalone --max-restarts 1000 (benchmarks/chaos_loop.py),
            gloo timeout ``--hang-timeout``, checkpoints to the same S3, resume from the latest

The schedule (``--seed``): a fault every ``--every`` s (+-25%) of training, counted from the arm's first
step; each kind once before any repeats. A fault fires once it is due and the arm has trained a step since
the previous one fired (so each fault meets a training arm):

  kill     SIGKILL of a rank's process
  hang     SIGSTOP of a rank's process (it stays stopped: the arm must notice and replace it)
  slow     the rank stopped for 50 ms of every 100 ms for ``--slow-s`` s (its CPU halved: 2x slower)
  drain    the Ray node of a rank gets a drain notice (PREEMPTION, deadline ``--notice`` s, the GCS API the
           autoscaler uses) and is removed at the deadline; a fresh node joins after it (the provider's
           replacement). torchrun gets no notice: the ranks "on that node" are SIGKILLed at the deadline
  nan      a rank's loss is NaN in one step (chaos_task's trigger file)
  storage  S3 refuses every connection for ``--outage`` s
  driver   SIGKILL of the driver's process group (product: jobs.train; raytrain: the process running
           fit(); torchrun: the agent and its ranks), resubmitted ``--driver-down`` s later

Figures per arm (chaos_measure.py has the step-log rules): ETTR (the product's from its goodput ledger,
``cluster.run_goodput``, beside the harness's ETTR from rank 0's step log), steps recomputed, full-group
restarts (a lower bound: the fewest process ids any rank had, less one), resubmissions, per fault the time
to the first step beyond what was trained before it and the steps it cost, and the final weights against the
product's fault-free run (same seed, same skipped batches): bitwise, else the largest difference.
Writes ``chaos_<tag>.json``, ``.md`` and ``.png`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks import chaos_measure as measure

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("product", "raytrain", "torchrun")
KINDS = ("kill", "hang", "slow", "drain", "nan", "storage", "driver")
TASK = "benchmarks.chaos_task:ChaosCharLM"
MODEL = {"context": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "lr": 0.003}


def make_schedule(seed: int, count: int, every: float, kinds: list[str], ranks: int) -> list[dict[str, Any]]:
    """``count`` faults, one every ``every`` s +-25%, each kind once (shuffled) before any repeats."""
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < count:
        batch = list(kinds)
        rng.shuffle(batch)
        order += batch
    t, out = 0.0, []
    for kind in order[:count]:
        t += every * rng.uniform(0.75, 1.25)
        out.append({"at_s": round(t, 1), "kind": kind, "rank": rng.randrange(ranks)})
    return out


# ====================================================================== the place an arm runs in
@dataclass
class Place:
    """S3 (always) and a multi-node Ray (the Ray arms) for one arm, torn down by :meth:`close`."""

    work: str
    s3: Any = None
    cluster: Any = None
    extra_nodes: list[Any] = field(default_factory=list)

    def start(self, ray_nodes: int, cpus_per_node: int) -> None:
        sys.path.insert(0, REPO)
        from tests.support.storage import MotoS3, free_port

        self.s3 = MotoS3(free_port(), log_path=os.path.join(self.work, "moto.log"))
        self.s3.start()
        if not ray_nodes:
            return
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "include_dashboard": False,
                "temp_dir": tempfile.mkdtemp(prefix="r", dir=os.path.dirname(self.work)),
                "_system_config": {
                    "health_check_period_ms": 1000,
                    "health_check_timeout_ms": 1000,
                    "health_check_failure_threshold": 3,
                },
            },
        )
        for _ in range(ray_nodes):
            self.add_node(cpus_per_node)
        self.cluster.wait_for_nodes()

    def add_node(self, cpus: int) -> None:
        self.cluster.add_node(num_cpus=cpus, resources={"trainer": cpus})

    def close(self) -> None:
        if self.cluster is not None:
            try:
                self.cluster.shutdown()
            except Exception as e:  # teardown goes on; said once
                print(f"ray cluster shutdown: {e!r}", file=sys.stderr)
            self.cluster = None
        if self.s3 is not None:
            self.s3.stop()
            self.s3 = None


# ====================================================================== the arms' drivers
def product_cmd(a: argparse.Namespace, place: Place, chaos: str, name: str, skip: list[Any]) -> list[str]:
    opts = json.dumps(place.s3.options)
    args = json.dumps({**MODEL, "max_chars": a.max_chars, "chaos_dir": chaos})
    sets = [
        f"name={name}",
        f"storage.url={place.s3.url('product')}",
        f"storage.options={opts}",
        f"task={TASK}",
        f"task_args={args}",
        f"scaling.num_workers={a.ranks}",
        "scaling.cpus_per_worker=1",
        "scaling.resources_per_worker={trainer: 1}",
        f"training.epochs={a.epochs}",
        "training.global_batch_size=64",
        f"checkpoint.every_steps={a.ckpt_every}",
        "checkpoint.every_epochs=0",
        "failures.max_failures=-1",
        "failures.nan_skip_steps=1",
        "failures.slow_rank_action=move",
        f"failures.hang_timeout_floor_s={a.hang_timeout}",
        "failures.quarantine_after=0",  # the harness's faults hit healthy nodes at random
        *a.product_set,
    ]
    if skip:
        sets.append(f"training.skip_steps={json.dumps(skip)}")
    cmd = [sys.executable, "-m", "jobs.train", "--config", "jobs/configs/tiny_cpu.yaml"]
    for s in sets:
        cmd += ["--set", s]
    return [*cmd, "--result-json", os.path.join(chaos, "result.json")]


def peer_spec(a: argparse.Namespace, place: Place, chaos: str, arm: str) -> str:
    spec = {
        "seed": 0,
        "global_batch": 64,
        "epochs": a.epochs,
        "ckpt_every_steps": a.ckpt_every,
        "task_args": {**MODEL, "max_chars": a.max_chars, "chaos_dir": chaos},
        "storage_options": place.s3.options,
        "ckpt_url": place.s3.url(arm),
        "collective_timeout_s": a.hang_timeout,
        "ranks": a.ranks,
        "endpoint": place.s3.endpoint,
        "ray_address": place.cluster.address if place.cluster is not None else None,
    }
    path = os.path.join(chaos, "spec.json")
    with open(path, "w") as fh:
        json.dump(spec, fh)
    return path


def raytrain_child(spec_path: str) -> int:
    """The Ray Train arm's driver process: fit() on the arm's Ray, resuming the run's snapshot if any."""
    import pyarrow.fs
    import ray
    import ray.train
    import ray.train.torch

    from benchmarks.chaos_loop import raytrain_loop

    with open(spec_path) as fh:
        spec = json.load(fh)
    ray.init(address=spec["ray_address"], runtime_env={"env_vars": {"PYTHONPATH": REPO}}, log_to_driver=False)
    fs = pyarrow.fs.S3FileSystem(
        access_key="testing",
        secret_key="testing",
        endpoint_override=spec["endpoint"].removeprefix("http://"),
        scheme="http",
        region="us-east-1",
    )
    trainer = ray.train.torch.TorchTrainer(
        raytrain_loop,
        train_loop_config=spec,
        torch_config=ray.train.torch.TorchConfig(backend="gloo", timeout_s=int(spec["collective_timeout_s"])),
        scaling_config=ray.train.ScalingConfig(
            num_workers=spec["ranks"], use_gpu=False, resources_per_worker={"CPU": 1, "trainer": 1}
        ),
        run_config=ray.train.RunConfig(
            name="chaos",
            storage_path=spec["ckpt_url"].removeprefix("s3://"),
            storage_filesystem=fs,
            failure_config=ray.train.FailureConfig(max_failures=-1),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    return 1 if result.error else 0


def launch(arm: str, a: argparse.Namespace, place: Place, chaos: str, log: Any, skip: list[Any]) -> Any:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": REPO, "RAY_TRAIN_V2_ENABLED": "1"}
    if arm == "product":
        env["RAY_ADDRESS"] = place.cluster.address
        cmd = product_cmd(a, place, chaos, "chaos", skip)
    elif arm == "raytrain":
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.bench_chaos",
            "--raytrain-child",
            peer_spec(a, place, chaos, arm),
        ]
    else:
        env["OMP_NUM_THREADS"] = "1"
        spec = peer_spec(a, place, chaos, arm)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.ranks}"]
        cmd += ["--max-restarts=1000", "--monitor-interval=0.5", "-m", "benchmarks.chaos_loop", spec]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


# ====================================================================== striking
class Striker:
    """Fires the faults at one arm's processes, nodes and storage; remembers what to undo."""

    def __init__(self, arm: str, a: argparse.Namespace, place: Place, chaos: str) -> None:
        self.arm, self.a, self.place, self.chaos = arm, a, place, chaos
        self.stopped: list[int] = []
        self.timers: list[threading.Thread] = []
        self.nodes_due = 0  # replacement nodes a drain asked for (added by the main thread)
        self.done = threading.Event()
        self.resubmit_at: float | None = None

    def rank_pid(self, rank: int) -> tuple[int, str] | None:
        try:
            with open(os.path.join(self.chaos, f"rank{rank}.pid")) as fh:
                pid, node = fh.read().split()
        except (FileNotFoundError, ValueError):
            return None
        return (int(pid), node) if os.path.exists(f"/proc/{pid}") else None

    def add_due_nodes(self) -> None:
        """Nodes a drain's timer asked for: ``Cluster.add_node`` sets signal handlers, so only the main
        thread may call it."""
        while self.nodes_due > 0:
            self.nodes_due -= 1
            self.place.add_node(self.a.cpus_per_node)

    def later(self, delay: float, fn: Any) -> None:
        def go() -> None:
            if not self.done.wait(delay):
                fn()

        t = threading.Thread(target=go, daemon=True)
        t.start()
        self.timers.append(t)

    def fire(self, f: dict[str, Any], driver: Any) -> bool:
        """Fire fault ``f``; False when its target is not there yet (try again on the next step)."""
        kind, target = f["kind"], self.rank_pid(f["rank"])
        if kind in ("kill", "hang", "slow", "drain") and target is None:
            return False
        f["fired_at"] = time.time()
        if kind == "kill":
            os.kill(target[0], signal.SIGKILL)  # type: ignore[index]
            f["faced"] = "SIGKILL"
        elif kind == "hang":
            os.kill(target[0], signal.SIGSTOP)  # type: ignore[index]
            self.stopped.append(target[0])  # type: ignore[index]
            f["faced"] = "SIGSTOP"
        elif kind == "slow":
            self.slow(target[0])  # type: ignore[index]
            f["faced"] = f"CPU halved for {self.a.slow_s:.0f} s"
        elif kind == "drain":
            f["faced"] = self.drain(target)  # type: ignore[arg-type]
        elif kind == "nan":
            with open(os.path.join(self.chaos, "nan.tmp"), "w") as fh:
                fh.write(str(f["rank"]))
            os.replace(os.path.join(self.chaos, "nan.tmp"), os.path.join(self.chaos, "nan"))
            f["faced"] = "NaN loss in one step" + (
                " (the loop raises on it)" if self.arm != "product" else ""
            )
        elif kind == "storage":
            self.place.s3.pause()
            self.later(self.a.outage, self.place.s3.resume)
            f["faced"] = f"S3 down {self.a.outage:.0f} s"
        elif kind == "driver":
            kill_group(driver.pid)
            self.resubmit_at = time.time() + self.a.driver_down
            f["faced"] = f"driver SIGKILLed, resubmitted after {self.a.driver_down:.0f} s"
        return True

    def slow(self, pid: int) -> None:
        until = time.time() + self.a.slow_s

        def duty() -> None:
            while time.time() < until and not self.done.is_set():
                try:
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(0.05)
                    os.kill(pid, signal.SIGCONT)
                    time.sleep(0.05)
                except ProcessLookupError:
                    return

        threading.Thread(target=duty, daemon=True).start()

    def drain(self, target: tuple[int, str]) -> str:
        pid, node = target
        notice = self.a.notice
        if self.place.cluster is None:  # torchrun: no notice; the node's ranks die at the deadline
            nodes = max(1, self.a.nodes)
            mine = [r for r in range(self.a.ranks) if r % nodes == self.ranks_node(pid, nodes)]
            self.later(notice, lambda: kill_all(self.pids(mine)))
            return f"no drain notice in torchrun: ranks {mine} SIGKILLed at the deadline ({notice:.0f} s)"
        import ray
        from ray.core.generated import autoscaler_pb2

        deadline = time.time() + notice
        gcs = ray._raylet.GcsClient(address=self.place.cluster.address)  # type: ignore[attr-defined]
        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")  # type: ignore[attr-defined]
        ok, why = gcs.drain_node(node, reason, "bench_chaos", int(deadline * 1000))
        if not ok:
            return f"drain refused: {why}"

        def remove() -> None:
            nodes = [n for n in self.place.cluster.worker_nodes if n.node_id == node]
            for n in nodes:
                self.place.cluster.remove_node(n, allow_graceful=False)
            self.nodes_due += 1  # the provider's replacement node: added by the main thread (Ray's rule)

        self.later(notice, remove)
        return f"drain notice, node removed at the deadline ({notice:.0f} s), a fresh node joins"

    def ranks_node(self, pid: int, nodes: int) -> int:
        for r in range(self.a.ranks):
            got = self.rank_pid(r)
            if got and got[0] == pid:
                return r % nodes
        return 0

    def pids(self, ranks: list[int]) -> list[int]:
        return [got[0] for r in ranks if (got := self.rank_pid(r))]

    def close(self) -> None:
        self.done.set()
        for pid in self.stopped:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if self.place.s3 is not None and not self.place.s3.running():
            self.place.s3.resume()


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ====================================================================== one arm
def run_arm(
    arm: str, a: argparse.Namespace, schedule: list[dict[str, Any]], skip: list[Any]
) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix=f"{arm}-", dir=a.tmp_root)
    chaos = os.path.join(work, "chaos")
    os.makedirs(chaos)
    place = Place(work)
    faults = [dict(f) for f in schedule]
    out: dict[str, Any] = {"arm": arm, "work": work}
    striker: Striker | None = None
    driver = log = None
    try:
        place.start(0 if arm == "torchrun" else a.nodes, a.cpus_per_node)
        striker = Striker(arm, a, place, chaos)
        log = open(os.path.join(work, "driver.log"), "ab")
        out["submitted_at"] = t0 = time.time()
        driver = launch(arm, a, place, chaos, log, skip)
        out.update(supervise(arm, a, place, chaos, log, skip, striker, driver, faults))
        out["wall_s"] = round(out["ended_at"] - t0, 2)
        collect(arm, a, place, chaos, out, faults, t0)
    finally:
        if striker is not None:
            striker.close()
        for d in (out.pop("driver", None), driver):
            if d is not None and d.poll() is None:
                kill_group(d.pid)
        if log is not None:
            log.close()
        place.close()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return out


def supervise(
    arm: str,
    a: argparse.Namespace,
    place: Place,
    chaos: str,
    log: Any,
    skip: list[Any],
    striker: Striker,
    driver: Any,
    faults: list[dict[str, Any]],
) -> dict[str, Any]:
    """Fire the schedule at the arm until its driver returns 0 (or ``--timeout``); resubmit a killed driver
    (and one that failed: counted as a manual resubmission)."""
    steps = os.path.join(chaos, "steps.log")
    t0, first, last_fire, pending = time.time(), None, 0.0, list(faults)
    pids: dict[int, set[int]] = {r: set() for r in range(a.ranks)}
    submissions, manual = 1, 0
    limit = a.peer_timeout if arm != "product" and a.peer_timeout else a.timeout
    while time.time() - t0 < limit:
        time.sleep(0.2)
        striker.add_due_nodes()
        for r in range(a.ranks):
            got = striker.rank_pid(r)
            if got:
                pids[r].add(got[0])
        lines = measure.read_steps(steps)
        if lines and first is None:
            first = lines[0].t
        if striker.resubmit_at is not None:
            if time.time() >= striker.resubmit_at:
                driver, striker.resubmit_at, submissions = (
                    launch(arm, a, place, chaos, log, skip),
                    None,
                    submissions + 1,
                )
            continue
        rc = driver.poll()
        if rc == 0:
            break
        if rc is not None:
            if manual >= a.max_manual:
                return {
                    "status": f"failed (rc {rc})",
                    "ended_at": time.time(),
                    "pids": pids,
                    "driver": driver,
                }
            manual += 1
            driver, submissions = launch(arm, a, place, chaos, log, skip), submissions + 1
            continue
        due = bool(pending) and first is not None and time.time() >= first + pending[0]["at_s"]
        if due and lines[-1].t > last_fire and striker.fire(pending[0], driver):
            last_fire = pending.pop(0)["fired_at"]
    else:
        return {"status": "timeout", "ended_at": time.time(), "pids": pids, "driver": driver}
    for f in pending:
        f["faced"] = "not fired: the run ended first"
    return {
        "status": "finished",
        "ended_at": time.time(),
        "pids": pids,
        "resubmissions": submissions - 1,
        "manual_resubmissions": manual,
        "first_step_s": round(first - t0, 2) if first else None,
        "driver": driver,
    }


def collect(
    arm: str,
    a: argparse.Namespace,
    place: Place,
    chaos: str,
    out: dict[str, Any],
    faults: list[dict[str, Any]],
    t0: float,
) -> None:
    import torch

    lines = measure.read_steps(os.path.join(chaos, "steps.log"))
    out.update(measure.summarize(lines, out["wall_s"], faults))
    out["faults"] = faults
    out["timeline"] = [(round(t, 2), n) for t, n in measure.timeline(lines, t0)[:: max(1, len(lines) // 600)]]
    counts = [len(p) for p in out.pop("pids").values()]
    out["full_group_restarts"] = max(0, min(counts) - 1) if counts else None
    if arm == "product":
        run_url = place.s3.url("product") + "/chaos"
        out["goodput"] = ledger(run_url, place.s3.options, out["wall_s"])
        try:
            with open(os.path.join(chaos, "result.json")) as fh:
                out["skipped_steps"] = json.load(fh).get("skipped_steps", [])
        except FileNotFoundError:
            out["skipped_steps"] = []
        from cluster.run.restore import load_checkpoint

        weights: dict[str, Any] | None = dict(load_checkpoint(run_url, None, place.s3.options).model)
    else:
        path = os.path.join(chaos, "final.pt")
        weights = torch.load(path, weights_only=True) if os.path.exists(path) else None
    if weights is not None:
        torch.save(dict(weights), os.path.join(a.scratch, f"{arm}.pt"))


def ledger(run_url: str, options: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The product's goodput ledger, checked against the harness's clock; {} (said) before it exists."""
    import cluster

    run_goodput = getattr(cluster, "run_goodput", None)
    if run_goodput is None:
        print("product: cluster.run_goodput is not there yet: ETTR from the harness's step log only")
        return {}
    g = run_goodput(run_url, storage_options=options)
    total = sum(g.seconds.values())
    return {
        "ettr": g.ettr,
        "wall_s": g.wall_s,
        "seconds": {k: round(v, 2) for k, v in g.seconds.items()},
        "classes_sum_s": round(total, 2),
        "sum_vs_wall_s": round(total - g.wall_s, 2),
        "ledger_wall_vs_harness_s": round(g.wall_s - wall_s, 2),
    }


def compare(scratch: str, arm: str, base: str = "baseline") -> str:
    import torch

    p, q = os.path.join(scratch, f"{arm}.pt"), os.path.join(scratch, f"{base}.pt")
    if not (os.path.exists(p) and os.path.exists(q)):
        return "-"
    x, y = torch.load(p, weights_only=True), torch.load(q, weights_only=True)
    if x.keys() != y.keys():
        return "different parameters"
    if all(torch.equal(x[k], y[k]) for k in x):
        return "bitwise equal"
    diff = max(float((x[k].float() - y[k].float()).abs().max()) for k in x)
    return f"differ (max abs {diff:.3g})"


# ====================================================================== main
def options(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="2 ranks, a kill and a hang, ~1 min per arm")
    p.add_argument("--arms", default=None, help="comma list (default: all; smoke: product,torchrun)")
    p.add_argument("--kinds", default=None, help="fault kinds, comma list (default: all; smoke: kill,hang)")
    p.add_argument("--ranks", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--max-chars", type=int, default=300_000)
    p.add_argument("--ckpt-every", type=int, default=None, help="checkpoint every N steps")
    p.add_argument("--faults", type=int, default=None, help="how many faults")
    p.add_argument("--every", type=float, default=None, help="seconds between faults (mean)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hang-timeout", type=float, default=20.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--notice", type=float, default=30.0)
    p.add_argument("--outage", type=float, default=30.0)
    p.add_argument("--driver-down", type=float, default=5.0)
    p.add_argument("--nodes", type=int, default=None, help="Ray worker nodes for the Ray arms")
    p.add_argument("--max-manual", type=int, default=3, help="resubmissions of a failed arm")
    p.add_argument("--timeout", type=float, default=None, help="seconds per arm run")
    p.add_argument(
        "--peer-timeout",
        type=float,
        default=None,
        help="seconds per Ray Train / torchrun run (else --timeout)",
    )
    p.add_argument("--product-set", action="append", default=[], metavar="KEY=VALUE", help="product override")
    p.add_argument("--no-baseline", action="store_true", help="skip the product's fault-free run")
    p.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--tag", default=None)
    p.add_argument("--keep", action="store_true", help="keep each arm's work folder")
    p.add_argument(
        "--tmp-root",
        default="/tmp/chaos",
        help="work folders and Ray's temp dirs go under it (keep it short)",
    )
    p.add_argument("--raytrain-child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    smoke = a.smoke
    a.arms = (a.arms or ("product,torchrun" if smoke else ",".join(ARMS))).split(",")
    a.kinds = (a.kinds or ("kill,hang" if smoke else ",".join(KINDS))).split(",")
    a.ranks = a.ranks or (2 if smoke else 8)
    a.epochs = a.epochs or (12 if smoke else 70)
    a.ckpt_every = a.ckpt_every or (250 if smoke else 1000)
    a.faults = a.faults or (2 if smoke else 9)
    a.every = a.every or (18.0 if smoke else 60.0)
    a.nodes = a.nodes or (2 if smoke else 3)
    a.cpus_per_node = max(2, -(-a.ranks * 3 // (2 * a.nodes)))  # room for a drained node's ranks elsewhere
    a.timeout = a.timeout or (300.0 if smoke else 1500.0)
    a.tag = a.tag or ("smoke" if smoke else time.strftime("%Y-%m-%d"))
    bad = [k for k in a.kinds if k not in KINDS] + [x for x in a.arms if x not in ARMS]
    if bad:
        p.error(f"unknown fault kinds or arms {bad}: kinds are {', '.join(KINDS)}; arms {', '.join(ARMS)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = options(argv)
    if a.raytrain_child:
        return raytrain_child(a.raytrain_child)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.makedirs(a.out_dir, exist_ok=True)
    os.makedirs(a.tmp_root, exist_ok=True)
    a.scratch = tempfile.mkdtemp(prefix="weights-", dir=a.tmp_root)
    schedule = make_schedule(a.seed, a.faults, a.every, a.kinds, a.ranks)
    settings = {k: v for k, v in vars(a).items() if k not in ("scratch", "raytrain_child")}
    results: dict[str, Any] = {"settings": settings, "schedule": schedule, "arms": {}}
    print(f"schedule: {json.dumps(schedule)}", flush=True)
    try:
        for arm in a.arms:
            r = run_arm(arm, a, schedule, [])
            results["arms"][arm] = r
            print(f"{arm}: {json.dumps(brief(r))}", flush=True)
        if not a.no_baseline and "product" in results["arms"]:
            skip = [f"{w[0]}-{w[1]}" for w in results["arms"]["product"].get("skipped_steps", [])]
            base = run_arm("product", a, [], skip)
            results["baseline"] = {
                **brief(base),
                "ettr": base.get("goodput", {}).get("ettr") or base["ettr_harness"],
            }
            shutil.copy(os.path.join(a.scratch, "product.pt"), os.path.join(a.scratch, "baseline.pt"))
            print(f"baseline (product, no faults): {json.dumps(results['baseline'])}", flush=True)
        report(a, results)
    finally:
        shutil.rmtree(a.scratch, ignore_errors=True)
    return 0


def brief(r: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "status",
        "wall_s",
        "ettr_harness",
        "steps_kept",
        "steps_recomputed",
        "steps_interrupted",
        "full_group_restarts",
        "resubmissions",
        "first_step_s",
    )
    out = {k: r.get(k) for k in keys}
    if r.get("goodput"):
        out["ettr_ledger"] = r["goodput"]["ettr"]
        out["ledger_sum_vs_wall_s"] = r["goodput"]["sum_vs_wall_s"]
    return out


def report(a: argparse.Namespace, results: dict[str, Any]) -> None:
    for arm in results["arms"]:
        results["arms"][arm]["weights_vs_baseline"] = (
            compare(a.scratch, arm) if "baseline" in results else "-"
        )
    text = measure.table(results)
    stem = os.path.join(a.out_dir, f"chaos_{a.tag}")
    with open(stem + ".json", "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    with open(stem + ".md", "w") as fh:
        fh.write(text + "\n")
    arm = "product" if "product" in results["arms"] else next(iter(results["arms"]))
    measure.plot(results, stem + ".png", arm)
    print()
    print(text)
    print(f"\nwritten: {stem}.json, {stem}.md, {stem}.png")
    print(
        "RESULT "
        + json.dumps({arm: brief(r) | {"faults": r.get("faults")} for arm, r in results["arms"].items()})
    )


if __name__ == "__main__":
    sys.exit(main())
