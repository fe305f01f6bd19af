"""Who takes CPU from the workers while they train? Per-process CPU ticks over a window of steady training.

    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.diag.background [--arm product|bare]
        [--delay 25] [--window 40] [--epochs 30] [--set KEY=VALUE ...]

Runs the ``bench_ddp`` workload (2 CPU workers, 48 steps an epoch) for ``--epochs`` epochs in a child
process, waits ``--delay`` seconds (past startup and the first epoch), then reads every thread's user+system
ticks (``/proc/PID/task/TID/stat``, 10 ms each) at the start and the end of a ``--window``-second window and
prints the difference per process, largest first, with the busiest threads of each (up to 8 for a worker).

On a machine whose cores the workers fill, every tick another process takes stalls all ranks: the rank
that was preempted arrives late at the next all-reduce and the others wait for it. The sum of the ticks
that are not the workers' is therefore the number to keep small; it is measured, not timed, so it is far
less noisy than an epoch-time ratio on a shared VM. Kernel threads and the machine's own agents are in the
sum too; run ``--arm bare`` for the floor they make. ``--set`` passes config overrides to the product arm
(e.g. ``--set failures.hot_spare=true``); Ray's own settings can be tried through the environment.

It also prints, per worker, how long its training thread was runnable but not running in the window (the
second field of ``/proc/PID/task/TID/schedstat``, in ms per second): the stall itself, whoever caused it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks.bench_ddp import REPO, TASK_ARGS, _steps_per_epoch, _sweep, read_events

Ticks = dict[tuple[int, int], tuple[str, str, int, int]]


def _name(pid: str) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        parts = fh.read().split(b"\0")
    scripts = [p.decode(errors="replace") for p in parts if p.endswith(b".py")]
    if scripts:
        return scripts[0].split("site-packages/")[-1]
    return os.path.basename(parts[0].decode(errors="replace")) or "?"


def snapshot() -> Ticks:
    out: Ticks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            name = _name(pid)
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                    stat = fh.read()
                fields = stat[stat.rindex(")") + 2 :].split()
                comm = stat[stat.index("(") + 1 : stat.rindex(")")]
                with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                    wait_ns = int(fh.read().split()[1])  # time spent runnable but waiting for a core
                out[(int(pid), int(tid))] = (name, comm, int(fields[11]) + int(fields[12]), wait_ns)
        except (OSError, ValueError):
            continue  # gone between listing and reading
    return out


def child(arm: str, epochs: int, overrides: list[str], work: str) -> None:
    if arm == "product":
        from cluster import load_config, train

        cfg = load_config(
            os.path.join(REPO, "jobs/configs/tiny_cpu.yaml"),
            [
                "name=bg",
                f"storage={work}",
                f"training.epochs={epochs}",
                "training.global_batch_size=64",
                "training.seed=0",
                "training.log_every_steps=1",
                "checkpoint.every_steps=25",
                "checkpoint.every_epochs=1",
                "scaling.num_workers=2",
                "scaling.cpus_per_worker=1",
                *overrides,
            ],
            data={"task": "jobs.tasks.charlm:CharLMTask", "task_args": TASK_ARGS},
        )
        print(train(cfg).status, flush=True)
    else:
        from benchmarks.bench_ddp import child_bare

        spec = {
            "task": "jobs.tasks.charlm:CharLMTask",
            "task_args": dict(TASK_ARGS),
            "seed": 0,
            "global_batch": 64,
            "epochs": epochs,
            "ckpt_every_steps": 25,
            "steps_per_epoch": _steps_per_epoch(TASK_ARGS, 64),
            "storage": os.path.join(work, "runs"),
            "ckpt_dir": os.path.join(work, "ckpt"),
            "steplog": os.path.join(work, "steps.log"),
            "kill_step": 0,
            "kill_file": "",
        }
        print(child_bare(spec)["status"], flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.diag.background",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--arm", choices=("product", "bare"), default="product")
    p.add_argument("--delay", type=float, default=25.0, help="seconds after the start before the window")
    p.add_argument("--window", type=float, default=40.0, help="seconds of sampling")
    p.add_argument("--epochs", type=int, default=30, help="long enough to cover delay + window")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="product config override")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.arm, args.epochs, args.set, args.work)
        return 0
    work = tempfile.mkdtemp(prefix="bgdiag", dir="/tmp")  # short: Ray's socket paths live under it
    ray_tmp = os.path.join(work, "r")
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.diag.background",
        "--child",
        "--arm",
        args.arm,
        "--work",
        work,
        "--epochs",
        str(args.epochs),
        *(f"--set={s}" for s in args.set),
    ]
    env = dict(
        os.environ,
        RAY_TMPDIR=ray_tmp,
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONPATH=os.pathsep.join(q for q in [REPO, os.environ.get("PYTHONPATH", "")] if q),
    )
    env.pop("RAY_ADDRESS", None)  # an embedded Ray of its own
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        time.sleep(args.delay)
        if proc.poll() is not None:
            print("the run ended before the window; raise --epochs", file=sys.stderr)
            return 1
        before, t0 = snapshot(), time.monotonic()
        time.sleep(args.window)
        after, seconds = snapshot(), time.monotonic() - t0
        covered = proc.poll() is None
        lines = proc.communicate(timeout=600)[0].strip().splitlines()
        out = lines[-1] if lines else ""
        events = read_events(os.path.join(work, "bg"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _sweep(ray_tmp):  # what the killed run's embedded Ray left behind (named by its temp dir)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
    per_proc: collections.Counter[tuple[int, str]] = collections.Counter()
    per_thread: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    waited: collections.Counter[int] = collections.Counter()  # per process: its busiest thread's wait, ns
    busiest: dict[int, int] = {}
    for key, (name, comm, ticks, wait_ns) in after.items():
        delta = ticks - before.get(key, (name, comm, 0, 0))[2]
        if delta > busiest.get(key[0], 0):
            busiest[key[0]] = delta
            waited[key[0]] = wait_ns - before.get(key, (name, comm, 0, wait_ns))[3]
        if delta > 0 and key[0] != os.getpid():
            name = "driver (the job's own process)" if key[0] == proc.pid else name
            per_proc[(key[0], name)] += delta
            per_thread[key[0]][comm] += delta
    if args.arm == "product":  # the ranks' PIDs, as the run's own event log records them
        workers = {pid for e in events if e["event"] == "group_started" for pid in e.get("pids", [])}
    else:  # the two spawned ranks are the two busiest processes
        workers = {pid for (pid, _), _ in per_proc.most_common(2)}
    print(
        f"arm {args.arm}, window {seconds:.1f} s ({round(seconds) * 100} ticks per core), run {out or '?'}"
        + ("" if covered else " (the run ended inside the window)")
    )
    print(f"{'ticks':>6} {'pid':>7}  process")
    for (pid, name), ticks in per_proc.most_common():
        tag = "  [worker]" if pid in workers else ""
        threads = ", ".join(
            f"{c} {n}" for c, n in per_thread[pid].most_common(3 if pid not in workers else 8)
        )
        print(f"{ticks:6d} {pid:7d}  {name}{tag}" + (f"   ({threads})" if threads and ticks >= 5 else ""))
    own = sum(t for (pid, _), t in per_proc.items() if pid not in workers)
    print(
        f"not the workers: {own} ticks in {seconds:.0f} s ({own / seconds:.2f} ticks/s); workers: "
        f"{sum(t for (pid, _), t in per_proc.items() if pid in workers)}"
    )
    waits = [waited[pid] / 1e6 / seconds for pid in sorted(workers)]
    print(
        "workers' training threads runnable but not running (waiting for a core): "
        + ", ".join(f"{w:.1f}" for w in waits)
        + " ms/s"
    )
    return 0 if covered else 1


if __name__ == "__main__":
    sys.exit(main())
