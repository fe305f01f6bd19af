"""One fixed CPU DDP workload, three ways, side by side: this product, bare PyTorch DDP, Ray Train V2.

    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.bench_ddp [--repeats 3] [--json out.json]
    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.bench_ddp --fault [--repeats 3] [--json out.json]

Workload (identical in every arm): jobs.tasks.charlm:CharLMTask (context 64, d_model 64, 2 layers, 4 heads,
200k chars of stdlib source), 2 CPU workers over gloo (``--workers N``: N ranks sharing the 2 CPUs), global
batch 64, seed 0, AdamW lr 3e-3 with the task's 20-step warmup, 4 epochs of 48 steps, rank 0 checkpoints
every ``--ckpt-every`` steps and at each epoch end, one thread per worker.

  product   cluster.train(cfg) on an embedded local Ray that train() starts and stops itself (variants:
            product_spare with failures.hot_spare=true, product_ckpt with failures.recover_from_peers=false)
  bare      torch.multiprocessing spawn + init_process_group(gloo, env://) + DistributedDataParallel +
            DistributedSampler.set_epoch, rank 0 torch.save each checkpoint; a torchrun-style supervisor
            (0.1 s monitor interval) restarts all ranks from the latest checkpoint after a failure
  raytrain  ray.train.torch.TorchTrainer (Ray Train V2), prepare_model, ray.train.report with a Checkpoint
            from rank 0, FailureConfig(max_failures=1) and ray.train.get_checkpoint() to resume

Each arm runs in a fresh Python process (so nothing is shared or pre-warmed) that has imported torch (and
ray, for the two Ray arms) before the clock starts. Measured per arm:

  total_s       start of the call / spawn -> everything torn down (Ray shut down, processes joined)
  first_step_s  start -> rank 0's first optimizer step done
  epoch_s       median over epochs 2..N of (last step of epoch e) - (last step of epoch e-1) on rank 0:
                includes whatever happens between epochs (checkpoint, driver round trip, set_epoch)
  teardown_s    rank 0's last step done -> the call returns

``--fault``: rank 1 SIGKILLs itself right before the forward pass of global step ``--kill-step`` (the
same hook in all arms: benchmarks/faults.py; it writes the kill time first). Measured: recovery_s (kill ->
rank 0's first step after the restart), lost_steps (steps done since the checkpoint resumed from, redone),
total_s; for the product also the phases of its ``recovered`` event.

The product is timed from outside only (the clock around ``train()``); its step times come from the metrics
Parquet and its breakdown (``product_breakdown``) from the run's event log, which records every phase.
Nothing of ``cluster`` is wrapped or patched.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import importlib.util
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ARMS = ("product", "product_spare", "product_ckpt", "bare", "raytrain")
DEFAULT_ARMS = ("product", "bare", "raytrain")
PRODUCT_VARIANTS = {
    "product": [],  # defaults: recovery from peers on, hot spare auto (off when no CPU share is free)
    "product_spare": ["failures.hot_spare=true"],
    "product_ckpt": ["failures.recover_from_peers=false"],  # the checkpoint path, as before peers
}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_ARGS = {"context": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_chars": 200_000, "lr": 0.003}
TARGETS = {"epoch_s": 1.02, "total_s": 1.25, "first_step_s": 2.0}


# ====================================================================== child side: one arm, one run
def _read_steplog(path: str) -> tuple[list[tuple[int, float, int]], list[tuple[int, float, int]]]:
    """(starts, steps) from a rank-0 step log: starts = (attempt, time, resume_step), steps =
    (attempt, time, global_step)."""
    starts: list[tuple[int, float, int]] = []
    steps: list[tuple[int, float, int]] = []
    if not os.path.exists(path):
        return starts, steps
    with open(path) as fh:
        for line in fh:
            parts = line.split()
            if len(parts) < 4:
                continue
            rec = (int(parts[1]), float(parts[2]), int(parts[3]))
            (starts if parts[0] == "start" else steps).append(rec)
    return starts, steps


def _epoch_stats(step_times: dict[int, float], steps_per_epoch: int, epochs: int) -> dict[str, Any]:
    ends = [step_times.get((e + 1) * steps_per_epoch) for e in range(epochs)]
    per_epoch = [None if a is None or b is None else b - a for a, b in itertools.pairwise(ends)]
    ok = [x for x in per_epoch if x is not None]
    # Where an epoch's time goes: the typical step, and the extra time at each epoch boundary (last step of
    # epoch e -> first step of e+1, minus one typical step): checkpoint, result round trip, next dispatch.
    inside = [
        t - step_times[s - 1]
        for s, t in step_times.items()
        if s - 1 in step_times and (s - 1) % steps_per_epoch
    ]
    step_s = statistics.median(inside) if inside else None
    gaps = [
        step_times[e * steps_per_epoch + 1] - step_times[e * steps_per_epoch]
        for e in range(1, epochs)
        if e * steps_per_epoch in step_times and e * steps_per_epoch + 1 in step_times
    ]
    return {
        "epoch_end_times": ends,
        "epochs_2_to_n_s": per_epoch,
        "epoch_s": statistics.median(ok) if ok else None,
        "step_interval_s": step_s,
        "epoch_boundary_extra_s": statistics.median(gaps) - step_s if gaps and step_s else None,
    }


def _fault_stats(
    kill_file: str, kill_step: int, starts: list[tuple[int, float, int]], steps: list[tuple[int, float, int]]
) -> dict[str, Any]:
    out: dict[str, Any] = {"kill_step": kill_step}
    if not os.path.exists(kill_file):
        out["error"] = "the fault did not fire"
        return out
    with open(kill_file) as fh:
        t_kill = float(fh.read().split()[0])
    after = [t for a, t, _ in steps if a >= 1]
    resumed = [r for a, _, r in starts if a >= 1]
    out["kill_time"] = t_kill
    out["recovery_s"] = (min(after) - t_kill) if after else None
    out["resume_step"] = resumed[0] if resumed else None
    out["lost_steps"] = (kill_step - 1 - resumed[0]) if resumed else None
    restart = [t for a, t, _ in starts if a >= 1]
    out["kill_to_loop_start_s"] = (restart[0] - t_kill) if restart else None
    return out


def read_events(run: str) -> list[dict[str, Any]]:
    """Every record of a run's event log, oldest first (the product's own reader: a legacy
    ``events.jsonl``, then the ``events/*.jsonl`` segments)."""
    from cluster.run.logs import read_event_log
    from cluster.run.storage import Storage

    return read_event_log(Storage(run))


def product_breakdown(
    events: list[dict[str, Any]], t0: float, t_end: float, first_step: float | None, last_step: float
) -> dict[str, Any]:
    """Where the product's wall time goes, from its own event log and the clock around ``train()``:

    call_to_run_start_s             train() called -> ``run_start`` (mostly starting the embedded Ray)
    run_start_to_group_started_s    -> the first group is set up (``group_started``)
    group_start_s                   the driver's own figure for that start (``seconds``: reserve, actors,
                                    setup)
    actors_up_s                     group_start_s less the setup phases: reserve + actor processes up
    setup_<phase>_s                 the slowest rank's seconds per setup phase (``setup_s``)
    group_started_to_first_step_s   -> rank 0's first optimizer step
    last_step_to_finished_s         rank 0's last step -> ``finished`` (checkpoint flush, result round trip)
    finished_to_return_s            ``finished`` -> train() returns (workers and the embedded Ray stopped)
    """
    first_of: dict[str, dict[str, Any]] = {}
    for e in events:
        first_of.setdefault(e["event"], e)
    finished = [e for e in events if e["event"] == "finished"]
    run_start, started = first_of.get("run_start"), first_of.get("group_started")
    bd: dict[str, Any] = {}
    if run_start:
        bd["call_to_run_start_s"] = run_start["time"] - t0
    if started:
        setup = {k: float(v) for k, v in (started.get("setup_s") or {}).items()}
        bd.update({f"setup_{k}_s": v for k, v in setup.items()})
        if run_start:
            bd["run_start_to_group_started_s"] = started["time"] - run_start["time"]
        if "seconds" in started:
            bd["group_start_s"] = float(started["seconds"])
            bd["actors_up_s"] = float(started["seconds"]) - sum(setup.values())
        if first_step is not None:
            bd["group_started_to_first_step_s"] = first_step - started["time"]
    if finished:
        bd["last_step_to_finished_s"] = finished[-1]["time"] - last_step
        bd["finished_to_return_s"] = t_end - finished[-1]["time"]
    return bd


def product_fault(
    events: list[dict[str, Any]], rows: list[dict[str, Any]], kill_file: str, kill_step: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(fault figures, the ``recovered`` event's phases) of a product run with an injected kill."""
    rec: dict[str, Any] = next((e for e in reversed(events) if e["event"] == "recovered"), {})
    phases = {k: v for k, v in rec.items() if k not in ("time", "event")}
    fs = _fault_stats(kill_file, kill_step, [], [])
    if "kill_time" not in fs:
        return fs, phases
    after = [float(r["time"]) for r in rows if r["attempt"] >= 1]
    fs["recovery_s"] = min(after) - fs["kill_time"] if after else None
    fs["resume_step"] = next(
        (e["resume_step"] for e in events if e["event"] == "group_started" and e["attempt"] >= 1), None
    )
    fs["lost_steps"] = kill_step - 1 - fs["resume_step"] if fs["resume_step"] is not None else None
    fs["product_reported_lost_steps"] = rec.get("lost_steps")
    fs["storage_read_bytes"] = rec.get("storage_read_bytes")
    fs["source"] = rec.get("source")
    failure = next((e for e in events if e["event"] == "failure"), None)
    if failure:
        fs["kill_to_detect_s"] = failure["time"] - fs["kill_time"]
    return fs, phases


def child_product(spec: dict[str, Any]) -> dict[str, Any]:
    """cluster.train(cfg), timed from outside; everything inside it is read from the run's own record."""
    import pyarrow.parquet as pq

    from cluster import load_config, train

    name = "bench"
    overrides = [
        f"name={name}",
        f"storage={spec['storage']}",
        f"training.epochs={spec['epochs']}",
        f"training.global_batch_size={spec['global_batch']}",
        f"training.seed={spec['seed']}",
        "training.log_every_steps=1",
        f"checkpoint.every_steps={spec['ckpt_every_steps']}",
        "checkpoint.every_epochs=1",
        f"scaling.num_workers={spec.get('workers', 2)}",
        f"scaling.cpus_per_worker={_cpus_per_worker(spec)}",
        "failures.max_failures=1",
        *spec.get("product_set", []),
        *PRODUCT_VARIANTS[spec.get("variant", "product")],
    ]
    cfg = load_config(
        os.path.join(REPO, "jobs/configs/tiny_cpu.yaml"),
        overrides,
        data={"task": spec["task"], "task_args": spec["task_args"]},
    )
    t0 = time.time()
    result = train(cfg)
    t_end = time.time()
    run = os.path.join(spec["storage"], name)
    table = pq.read_table(os.path.join(run, "metrics")).to_pylist()
    rows = sorted((r for r in table if r["kind"] == "step"), key=lambda r: (r["attempt"], r["time"]))
    events = read_events(run)
    step_times: dict[int, float] = {}
    for r in rows:  # a later attempt's time wins for a re-done step
        step_times[int(r["global_step"])] = float(r["time"])
    spe = int(spec["steps_per_epoch"])
    first = min((float(r["time"]) for r in rows if r["attempt"] == 0 and r["global_step"] == 1), default=None)
    last = max(step_times.values())
    out: dict[str, Any] = {
        "status": result.status,
        "steps": result.global_step,
        "loss": result.metrics.get("loss"),
        "steps_per_epoch": spe,
        "t0": t0,
        "t_end": t_end,
        "total_s": t_end - t0,
        "first_step_s": first - t0 if first else None,
        "teardown_s": t_end - last,
        **_epoch_stats(step_times, spe, spec["epochs"]),
        "breakdown": product_breakdown(events, t0, t_end, first, last),
    }
    if spec.get("kill_step"):
        out["fault"], out["fault_events"] = product_fault(events, rows, spec["kill_file"], spec["kill_step"])
    return out


def child_bare(spec: dict[str, Any]) -> dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    from benchmarks._loop import bare_worker

    os.environ["OMP_NUM_THREADS"] = "1"  # what torchrun sets for nproc_per_node > 1
    world, max_restarts, monitor_s = int(spec.get("workers", 2)), 1, 0.1
    os.makedirs(spec["ckpt_dir"], exist_ok=True)
    t0 = time.time()
    restarts, detected = 0, None
    while True:
        with socket.socket() as s:  # as torchrun's static rendezvous: a free port for this attempt
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.start_processes(
            bare_worker, args=(world, port, spec), nprocs=world, join=False, start_method="spawn"
        )
        try:
            while not ctx.join(timeout=monitor_s):
                pass
            break
        except mp.ProcessExitedException:
            # join() has already terminated and reaped the other ranks.
            detected = detected or time.time()
            restarts += 1
            if restarts > max_restarts:
                raise
    t_end = time.time()
    return _loop_result(spec, t0, t_end, {"restarts": restarts, "detect_time": detected})


def child_raytrain(spec: dict[str, Any]) -> dict[str, Any]:
    import ray
    import ray.train
    import ray.train.torch

    from benchmarks._loop import raytrain_loop

    t0 = time.time()
    if spec.get("ray_address"):  # --ray-cluster: a running head, as with `ray job submit`
        ray.init(address=spec["ray_address"], configure_logging=False)
    else:
        ray.init(
            num_cpus=int(spec.get("cores", 2)),
            include_dashboard=False,
            _temp_dir=spec["ray_tmp"],
            configure_logging=False,
            runtime_env={"env_vars": {"PYTHONPATH": REPO}},
        )
    t_init = time.time()
    trainer = ray.train.torch.TorchTrainer(
        raytrain_loop,
        train_loop_config=spec,
        scaling_config=ray.train.ScalingConfig(
            num_workers=int(spec.get("workers", 2)),
            use_gpu=False,
            resources_per_worker={"CPU": _cpus_per_worker(spec)},
        ),
        run_config=ray.train.RunConfig(
            name="bench",
            storage_path=spec["storage"],
            failure_config=ray.train.FailureConfig(max_failures=1),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=3),
        ),
    )
    result = trainer.fit()
    t_fit = time.time()
    ray.shutdown()
    t_end = time.time()
    return _loop_result(
        spec,
        t0,
        t_end,
        {
            "ray_init_s": t_init - t0,
            "fit_s": t_fit - t_init,
            "ray_shutdown_s": t_end - t_fit,
            "error": repr(result.error) if result.error else None,
        },
    )


def _loop_result(spec: dict[str, Any], t0: float, t_end: float, extra: dict[str, Any]) -> dict[str, Any]:
    starts, steps = _read_steplog(spec["steplog"])
    step_times: dict[int, float] = {}
    for _, t, s in sorted(steps, key=lambda r: (r[0], r[1])):
        step_times[s] = t
    spe = spec["steps_per_epoch"]
    first = min((t for a, t, s in steps if a == 0 and s == 1), default=None)
    last = max(step_times.values()) if step_times else None
    first_start = min((t for a, t, _ in starts if a == 0), default=None)
    out: dict[str, Any] = {
        "status": "finished" if step_times.get(spe * spec["epochs"]) else "incomplete",
        "steps": max(step_times) if step_times else 0,
        "steps_per_epoch": spe,
        "t0": t0,
        "t_end": t_end,
        "total_s": t_end - t0,
        "first_step_s": first - t0 if first else None,
        "teardown_s": t_end - last if last else None,
        **_epoch_stats(step_times, spe, spec["epochs"]),
        "breakdown": {
            "call_to_loop_start_s": first_start - t0 if first_start else None,
            "loop_start_to_first_step_s": first - first_start if first and first_start else None,
            **{k: v for k, v in extra.items() if k != "detect_time"},
        },
    }
    if spec.get("kill_step"):
        out["fault"] = _fault_stats(spec["kill_file"], spec["kill_step"], starts, steps)
        if extra.get("detect_time") and "kill_time" in out["fault"]:
            out["fault"]["kill_to_detect_s"] = extra["detect_time"] - out["fault"]["kill_time"]
        # every rank reads the checkpoint it resumes from: its size times the ranks
        files = glob.glob(os.path.join(spec["ckpt_dir"], "latest.pt")) or sorted(
            glob.glob(os.path.join(spec["storage"], "**", "state.pt"), recursive=True)
        )
        if files:
            out["fault"]["storage_read_bytes"] = os.path.getsize(files[-1]) * int(spec.get("workers", 2))
    return out


def child_main(arm: str, spec_path: str, out_path: str) -> int:
    with open(spec_path) as fh:
        spec = json.load(fh)
    if arm in PRODUCT_VARIANTS:
        result = child_product({**spec, "variant": arm})
    else:
        result = {"bare": child_bare, "raytrain": child_raytrain}[arm](spec)
    result["arm"] = arm
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)  # this process only: the driver / supervisor
    result["driver_cpu_s"] = usage.ru_utime + usage.ru_stime
    result["driver_rss_mb"] = usage.ru_maxrss / 1024
    with open(out_path, "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    return 0


# ====================================================================== parent side
def _cpus_per_worker(spec: dict[str, Any]) -> float:
    """One CPU per rank up to ``cores`` ranks (2 unless told: this machine's); beyond, those CPUs shared."""
    return min(1.0, float(spec.get("cores", 2)) / int(spec.get("workers", 2)))


def _steps_per_epoch(task_args: dict[str, Any], batch: int) -> int:
    from jobs.tasks.charlm import load_corpus

    n = (len(load_corpus(int(task_args["max_chars"]))) - 1) // int(task_args["context"])
    return n // batch


def make_spec(
    work: str,
    *,
    fault: bool = False,
    kill_step: int = 0,
    epochs: int = 4,
    ckpt_every: int = 25,
    steps_per_epoch: int,
    product_set: list[str] | None = None,
    head: Any = None,
    task: str = "jobs.tasks.charlm:CharLMTask",
    task_args: dict[str, Any] | None = None,
    workers: int = 2,
    cores: int = 2,
) -> dict[str, Any]:
    """The spec one arm's child runs: the fixed workload, with its scratch paths under ``work``; ``cores``:
    the CPUs the ranks share (Ray's ``num_cpus``)."""
    spec: dict[str, Any] = {
        "task": "benchmarks.faults:KillableCharLM" if fault else task,
        "task_args": {**TASK_ARGS, **(task_args or {})},
        "seed": 0,
        "global_batch": 64,
        "epochs": epochs,
        "ckpt_every_steps": ckpt_every,
        "steps_per_epoch": steps_per_epoch,
        "storage": os.path.join(work, "runs"),
        "ckpt_dir": os.path.join(work, "ckpt"),
        "steplog": os.path.join(work, "steps.log"),
        "ray_tmp": os.path.join(work, "r"),
        "kill_step": kill_step if fault else 0,
        "kill_file": os.path.join(work, "killed") if fault else "",
        "product_set": list(product_set or []),
        "workers": workers,
        "cores": cores,
        "ray_address": head.address if head else "",
        "ray_head_tmp": head.temp_dir if head else "",
    }
    if fault:
        spec["task_args"].update(kill_step=kill_step, kill_rank=1, kill_file=spec["kill_file"])
    return spec


def _sweep(tag: str) -> list[int]:
    """PIDs of leftover processes whose command line names our private temp dir (ours, by construction)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().decode(errors="replace")
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().split(") ", 1)[1].startswith("Z"):
                    continue
        except OSError:
            continue
        if tag in cmd:
            found.append(int(pid))
    return found


def _child_env(arm: str, spec: dict[str, Any]) -> dict[str, str]:
    env = dict(
        os.environ,
        RAY_AUTH_MODE="disabled",
        RAY_TMPDIR=spec["ray_tmp"],
        RAY_TRAIN_V2_ENABLED="1",
        PYTHONPATH=os.pathsep.join(p for p in [REPO, os.environ.get("PYTHONPATH", "")] if p),
        RAY_USAGE_STATS_ENABLED="0",
        BENCH_TAG=spec["ray_tmp"],
    )
    env.update(spec.get("env") or {})  # an arm variant's own variables (bench_interleaved)
    env.pop("RAY_ADDRESS", None)  # the product arm starts its own embedded Ray...
    if spec.get("ray_address") and arm != "bare":
        env["RAY_ADDRESS"] = spec["ray_address"]  # ...unless --ray-cluster gave it one to connect to
    return env


def launch_arm(arm: str, spec: dict[str, Any], work: str, preexec_fn: Any = None) -> subprocess.Popen[bytes]:
    """Start one arm's child process (its own session, output to ``work/child.log``); it writes
    ``work/result.json`` when it is done. ``preexec_fn`` runs in the child before it execs."""
    with open(os.path.join(work, "spec.json"), "w") as fh:
        json.dump(spec, fh)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_ddp",
        "--child",
        arm,
        "--spec",
        os.path.join(work, "spec.json"),
        "--out",
        os.path.join(work, "result.json"),
    ]
    with open(os.path.join(work, "child.log"), "w") as log:
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env=_child_env(arm, spec),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )


def collect_arm(arm: str, spec: dict[str, Any], work: str, rc: int, wall_s: float) -> dict[str, Any]:
    """After the child exited (or was killed: ``rc`` -9): kill its leftovers, read its result."""
    out_path = os.path.join(work, "result.json")
    leftovers = _sweep(spec["ray_tmp"])
    for pid in leftovers:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if spec.get("ray_address"):
        _wait_workers_gone(spec["ray_head_tmp"])
    if rc != 0 or not os.path.exists(out_path):
        with open(os.path.join(work, "child.log")) as fh:
            tail = fh.read()[-3000:]
        return {
            "arm": arm,
            "error": f"exit {rc} after {wall_s:.0f}s; log tail:\n{tail}",
            "leftover_pids_killed": leftovers,
        }
    with open(out_path) as fh:
        res: dict[str, Any] = json.load(fh)
    res["leftover_pids_killed"] = leftovers
    res["child_wall_s"] = wall_s
    return res


def run_arm(arm: str, spec: dict[str, Any], work: str, timeout_s: float) -> dict[str, Any]:
    t = time.time()
    proc = launch_arm(arm, spec, work)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group we created for this child
        proc.wait()
        rc = -9
    return collect_arm(arm, spec, work, rc, time.time() - t)


class RayHead:
    """--ray-cluster: a real ``ray start --head`` (dashboard included, as on a cluster) that every Ray arm
    connects to, started before and stopped after all runs; its processes are found by its temp dir."""

    def __init__(self, temp_dir: str, num_cpus: int = 2) -> None:
        import shutil
        import socket

        def free_port() -> int:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                return int(sock.getsockname()[1])

        self.temp_dir = temp_dir
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")  # the venv's; else the PATH's
        self.args = [
            ray_cli if os.path.exists(ray_cli) else shutil.which("ray") or ray_cli,
            "start",
            "--head",
            f"--num-cpus={num_cpus}",
            f"--port={self.port}",
            "--node-ip-address=127.0.0.1",
            f"--ray-client-server-port={free_port()}",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ]
        # The dashboard needs ray[default]'s extras; a minimal `pip install ray` has none of them
        if importlib.util.find_spec("aiohttp_cors") is not None:
            self.args += [
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={free_port()}",
                f"--dashboard-agent-listen-port={free_port()}",
            ]
        else:
            self.args.append("--include-dashboard=false")

    def start(self) -> None:
        env = dict(
            os.environ,
            RAY_AUTH_MODE="disabled",
            RAY_USAGE_STATS_ENABLED="0",
            PYTHONPATH=os.pathsep.join(p for p in [REPO, os.environ.get("PYTHONPATH", "")] if p),
        )
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.run(self.args, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start --head failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        time.sleep(3)  # let the head settle (dashboard modules, prestarted workers) before any clock starts

    def stop(self) -> None:
        for _ in range(50):
            left = _sweep(self.temp_dir)
            if not left:
                return
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)


def _wait_workers_gone(head_tmp: str, timeout: float = 20.0) -> None:
    """After a Ray arm on the shared head: wait until the raylet has reaped that job's worker processes,
    so they do not run into the next arm."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmd = fh.read().decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith("ray::") and not cmd.startswith("ray::IDLE"):
                busy.append(pid)
        if not busy:
            return
        time.sleep(0.2)


def _median(values: list[Any]) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def _fmt(v: Any, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def summarize(runs: list[dict[str, Any]], fault: bool) -> dict[str, Any]:
    keys = ["total_s", "first_step_s", "epoch_s", "teardown_s", "step_interval_s", "epoch_boundary_extra_s"]
    fkeys = ["recovery_s", "kill_to_detect_s", "lost_steps", "storage_read_bytes"]
    med: dict[str, dict[str, Any]] = {}
    for arm in ARMS:
        mine = [r for r in runs if r.get("arm") == arm and "error" not in r]
        if not mine:
            continue
        m: dict[str, Any] = {k: _median([r.get(k) for r in mine]) for k in keys}
        m["n"] = len(mine)
        if fault:
            m.update({k: _median([r.get("fault", {}).get(k) for r in mine]) for k in fkeys})
            if arm in PRODUCT_VARIANTS:
                for k in (
                    "detect_to_teardown_s",
                    "reserve_s",
                    "start_and_load_s",
                    "actors_s",
                    "rendezvous_s",
                    "task_s",
                    "ddp_s",
                    "checkpoint_load_s",
                    "transfer_s",
                    "first_step_s",
                    "detect_to_first_step_s",
                    "lost_steps",
                ):
                    m["phase_" + k] = _median([r.get("fault_events", {}).get(k) for r in mine])
        bkeys = sorted({k for r in mine for k in r.get("breakdown", {})})
        m["breakdown"] = {k: _median([r.get("breakdown", {}).get(k) for r in mine]) for k in bkeys}
        med[arm] = m
    ratios: dict[str, dict[str, float | None]] = {}
    base = med.get("bare")
    for arm in [a for a in ARMS if a != "bare"]:
        if base and arm in med:
            ratios[f"{arm}/bare"] = {
                k: (med[arm][k] / base[k]) if med[arm].get(k) and base.get(k) else None
                for k in keys + (["recovery_s"] if fault else [])
            }
    # Paired: the ratio within each repeat (arms run minutes apart at most), then the median over repeats.
    # A shared VM's speed drifts over a benchmark; medians per arm mix fast and slow periods.
    paired: dict[str, dict[str, float | None]] = {}
    by_rep: dict[Any, dict[str, dict[str, Any]]] = {}
    for r in runs:
        if "error" not in r:
            by_rep.setdefault(r.get("repeat"), {})[r["arm"]] = r
    for arm in [a for a in ARMS if a != "bare"]:
        pairs = [rep for rep in by_rep.values() if arm in rep and "bare" in rep]
        if pairs:
            paired[f"{arm}/bare"] = {
                k: _median(
                    [rep[arm][k] / rep["bare"][k] for rep in pairs if rep[arm].get(k) and rep["bare"].get(k)]
                )
                for k in keys + (["recovery_s"] if fault else [])
            }
    return {"median": med, "ratios": ratios, "paired_ratios": paired}


def print_table(summary: dict[str, Any], fault: bool) -> None:
    med, ratios = summary["median"], summary["ratios"]
    if not fault:
        print(f"\n{'arm':10} {'n':>2} {'total_s':>8} {'first_step_s':>12} {'epoch_s':>8} {'teardown_s':>10}")
        for arm, m in med.items():
            print(
                f"{arm:10} {m['n']:>2} {_fmt(m['total_s']):>8} {_fmt(m['first_step_s']):>12} "
                f"{_fmt(m['epoch_s'], 3):>8} {_fmt(m['teardown_s']):>10}   "
                f"step {_fmt(m['step_interval_s'], 4)}s, "
                f"epoch-boundary extra {_fmt(m['epoch_boundary_extra_s'], 3)}s"
            )
        print(f"\n{'ratio':14} {'total':>7} {'first_step':>10} {'epoch':>7} {'teardown':>9}")
        for name, r in ratios.items():
            print(
                f"{name:14} {_fmt(r['total_s']):>7} {_fmt(r['first_step_s']):>10} {_fmt(r['epoch_s'], 3):>7} "
                f"{_fmt(r['teardown_s']):>9}"
            )
        paired = summary.get("paired_ratios", {})
        if paired:
            print(
                f"\n{'paired ratio':14} {'total':>7} {'first_step':>10} {'epoch':>7} {'teardown':>9}"
                "   (median over repeats of the ratio within a repeat)"
            )
            for name, r in paired.items():
                print(
                    f"{name:14} {_fmt(r['total_s']):>7} {_fmt(r['first_step_s']):>10} "
                    f"{_fmt(r['epoch_s'], 3):>7} "
                    f"{_fmt(r['teardown_s']):>9}"
                )
        if "product/bare" in ratios:
            r = paired.get("product/bare") or ratios["product/bare"]
            verdict = ", ".join(
                f"{k} {_fmt(r[k])}x (target <= {t}x: {'ok' if r[k] and r[k] <= t else 'MISSED'})"
                for k, t in TARGETS.items()
            )
            print(f"\nproduct targets ({'paired ratios' if paired else 'ratios of medians'}): {verdict}")
    else:
        print(
            f"\n{'arm':14} {'n':>2} {'total_s':>8} {'recovery_s':>10} {'kill->detect':>12} "
            f"{'lost_steps':>10} {'read_MiB':>9}"
        )
        for arm, m in med.items():
            read = m.get("storage_read_bytes")
            print(
                f"{arm:14} {m['n']:>2} {_fmt(m['total_s']):>8} {_fmt(m['recovery_s']):>10} "
                f"{_fmt(m['kill_to_detect_s']):>12} {_fmt(m['lost_steps'], 0):>10} "
                f"{_fmt(read / 2**20 if read is not None else None):>9}"
            )
        for arm in PRODUCT_VARIANTS:
            if arm in med:
                print(
                    f"\n{arm} recovered-event phases (median): "
                    + ", ".join(f"{k[6:]}={_fmt(v)}" for k, v in med[arm].items() if k.startswith("phase_"))
                )
        for name, r in ratios.items():
            print(f"{name}: total {_fmt(r['total_s'])}x, recovery {_fmt(r['recovery_s'])}x")
    print("\nbreakdown (median seconds):")
    for arm, m in med.items():
        print(
            f"  {arm:9} "
            + ", ".join(f"{k}={_fmt(v)}" for k, v in m["breakdown"].items() if isinstance(v, (int, float)))
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_ddp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="repeat the whole comparison N times; report medians"
    )
    p.add_argument(
        "--arms",
        default=",".join(DEFAULT_ARMS),
        help=f"comma list of {','.join(ARMS)} (product_spare: hot spare on; product_ckpt: recovery from "
        "peers off)",
    )
    p.add_argument("--workers", type=int, default=2, help="ranks per arm (CPU shares of 2 cores beyond 2)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--fault", action="store_true", help="SIGKILL rank 1 mid-epoch and measure recovery")
    p.add_argument("--kill-step", type=int, default=76, help="global step before which rank 1 dies (--fault)")
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=None,
        help="checkpoint every N steps (default 25 as tiny_cpu.yaml; 10 with --fault)",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per arm run before it is killed")
    p.add_argument("--json", help="write all runs, medians and ratios to this file")
    p.add_argument(
        "--product-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for the product arm, e.g. failures.hot_spare=true",
    )
    p.add_argument(
        "--ray-cluster",
        action="store_true",
        help="start a `ray start --head` first and connect the Ray arms to it (the `ray job submit` "
        "setting: Ray is already up) instead of each starting an embedded Ray",
    )
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (storage, logs)")
    p.add_argument(
        "--summarize", metavar="JSON", help="print the tables of an earlier run's --json file and exit"
    )
    p.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args.child, args.spec, args.out)
    if args.summarize:
        with open(args.summarize) as fh:
            doc = json.load(fh)
        fault = "--fault" in doc.get("benchmark", "")
        print(f"{doc.get('command')}  ({doc.get('date')})")
        print_table(summarize(doc["runs"], fault), fault)
        return 0

    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        p.error(f"unknown arm(s) {bad}; choose from {ARMS}")
    every = args.ckpt_every if args.ckpt_every is not None else (10 if args.fault else 25)
    spe = _steps_per_epoch(TASK_ARGS, 64)
    if args.fault and not 1 < args.kill_step <= spe * args.epochs:
        p.error(f"--kill-step must be within 2..{spe * args.epochs}")
    scratch = tempfile.mkdtemp(prefix="bddp", dir="/tmp")  # short: Ray's socket paths live under it
    runs: list[dict[str, Any]] = []
    t_all = time.time()
    head = RayHead(os.path.join(scratch, "head")) if args.ray_cluster else None
    try:
        if head is not None:
            print(f"starting a Ray head for the Ray arms at {head.address} ...", flush=True)
            head.start()
        for rep in range(args.repeats):
            order = arms[rep % len(arms) :] + arms[: rep % len(arms)]  # rotate so noise is not one arm's
            for arm in order:
                work = os.path.join(scratch, f"{rep}{arm}")
                os.makedirs(work)
                spec = make_spec(
                    work,
                    fault=args.fault,
                    kill_step=args.kill_step,
                    epochs=args.epochs,
                    ckpt_every=every,
                    steps_per_epoch=spe,
                    product_set=args.product_set,
                    head=head,
                    workers=args.workers,
                )
                print(f"[repeat {rep + 1}/{args.repeats}] {arm} ...", flush=True)
                res = run_arm(arm, spec, work, args.timeout)
                res["repeat"] = rep
                runs.append(res)
                if "error" in res:
                    print(f"  FAILED: {res['error']}", flush=True)
                else:
                    f = res.get("fault", {})
                    print(
                        f"  total {_fmt(res['total_s'])}s, first step {_fmt(res['first_step_s'])}s, epoch "
                        f"{_fmt(res['epoch_s'], 3)}s, teardown {_fmt(res['teardown_s'])}s"
                        + (
                            f", recovery {_fmt(f.get('recovery_s'))}s, lost {f.get('lost_steps')}"
                            if f
                            else ""
                        )
                        + (
                            f"; killed leftovers {res['leftover_pids_killed']}"
                            if res["leftover_pids_killed"]
                            else ""
                        ),
                        flush=True,
                    )
    finally:
        if head is not None:
            head.stop()
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            print(f"scratch kept in {scratch}")
    summary = summarize(runs, args.fault)
    print_table(summary, args.fault)
    if args.json:
        doc = {
            "benchmark": "bench_ddp"
            + (" --fault" if args.fault else "")
            + (" --ray-cluster" if head else ""),
            "command": " ".join(
                [os.path.basename(sys.executable), "-m", "benchmarks.bench_ddp", *sys.argv[1:]]
            ),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "workload": {
                "task_args": TASK_ARGS,
                "workers": args.workers,
                "global_batch": 64,
                "epochs": args.epochs,
                "steps_per_epoch": spe,
                "ckpt_every_steps": every,
                "kill_step": args.kill_step if args.fault else None,
            },
            "wall_s": time.time() - t_all,
            "runs": runs,
            **summary,
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
        print(f"wrote {args.json}")
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
