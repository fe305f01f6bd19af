"""How long does the embedded Ray take to start, and does the raylet wait a full second for its object store?

    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.diag_start [--starts 6] [--load] [--modes ...]

Starts and stops a local Ray ``--starts`` times per mode, the modes interleaved:

  product       ``cluster.local_ray.start`` as shipped
  ray-connect   the same, but with Ray's own socket-connect retry (1000 ms, 10 attempts)
  plain         ``ray.init(address="local", num_cpus=2, include_dashboard=False)``, nothing else

and prints for each start the seconds until ``ray.init`` returned, until two 1-CPU actors answered a call
(``ready``), and, from the raylet's log, between creating the object store and starting the object manager
(the raylet's first connection to its store; ~0.002 s when the store is already listening, one retry
interval when it is not). ``--load`` keeps one core busy with a spin loop meanwhile, as a test suite or a
second job would: that is when that race is lost.

Each start runs in a fresh Python process. Not a timed test: it prints what it sees.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys

from benchmarks.bench_ddp import REPO

_MARKS = ("create_and_mmap_buffer", "ObjectManager server started")


MODES = ("product", "ray-connect", "plain")


def child(mode: str) -> None:
    import time

    import ray
    import ray._private.worker as ray_worker

    from cluster import local_ray

    if mode == "ray-connect":
        for key in ("raylet_client_connect_timeout_milliseconds", "raylet_client_num_connect_attempts"):
            local_ray._SYSTEM_CONFIG.pop(key, None)
    t0 = time.perf_counter()
    if mode == "plain":
        ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    else:
        local_ray.start(2)
    init_s = time.perf_counter() - t0

    @ray.remote(num_cpus=1)
    class Echo:
        def ping(self) -> int:
            return 1

    actors = [Echo.remote() for _ in range(2)]  # type: ignore[attr-defined]
    ray.get([a.ping.remote() for a in actors], timeout=60)
    ready_s = time.perf_counter() - t0

    session = ray_worker._global_node.get_session_dir_path()
    seen: dict[str, float] = {}
    for path in glob.glob(os.path.join(session, "logs", "raylet.out")):
        with open(path) as fh:
            for line in fh:
                for mark in _MARKS:
                    if mark in line and mark not in seen:
                        stamp = datetime.datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")
                        seen[mark] = stamp.timestamp()
    local_ray.shutdown()
    gap = seen[_MARKS[1]] - seen[_MARKS[0]] if len(seen) == 2 else None
    print(json.dumps({"mode": mode, "init_s": init_s, "ready_s": ready_s, "store_connect_s": gap}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.diag_start", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--starts", type=int, default=6, help="starts per mode")
    p.add_argument("--load", action="store_true", help="keep one core busy meanwhile")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.load else None
    rows: list[dict[str, float | str | None]] = []
    try:
        modes = args.modes.split(",")
        for i in range(args.starts * len(modes)):
            mode = modes[i % len(modes)]
            out = subprocess.run([sys.executable, "-m", "benchmarks.diag_start", "--child", mode], cwd=REPO,
                                 capture_output=True, text=True, timeout=120)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if not lines:
                print(f"{mode}: no result (rc {out.returncode}): {out.stderr[-500:]}", file=sys.stderr)
                continue
            row = json.loads(lines[-1])
            rows.append(row)
            gap = row["store_connect_s"]
            print(f"{mode:12s} ray.init {row['init_s']:.2f} s, ready {row['ready_s']:.2f} s, "
                  f"store connect {'?' if gap is None else f'{gap:.3f}'} s")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        gaps = [float(r["store_connect_s"]) for r in mine if r["store_connect_s"] is not None]
        inits = [float(r["init_s"]) for r in mine]  # type: ignore[arg-type]
        ready = [float(r["ready_s"]) for r in mine]  # type: ignore[arg-type]
        print(f"{mode:12s} n={len(mine)}: ray.init median {statistics.median(inits):.2f} s, ready median "
              f"{statistics.median(ready):.2f} s (range {min(ready):.2f}-{max(ready):.2f}); store connect >= 0.5 s "
              f"in {sum(g >= 0.5 for g in gaps)} of {len(gaps)} (max {max(gaps, default=0):.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
