"""How long does the embedded Ray take to start and stop, against a plain ``ray.init()``?

    RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.diag.start [--starts 6] [--load] [--modes ...]

Starts and stops a local Ray ``--starts`` times per mode, the modes interleaved, each start in a fresh
Python process with its own temp dir:

  product   ``cluster.local_ray.start`` / ``shutdown``: the embedded Ray ``train()`` starts when no cluster
            is given, with whatever settings the product ships
  plain     ``ray.init(address="local", num_cpus=2, include_dashboard=False)`` / ``ray.shutdown()``
  product@REF  ``start`` / ``shutdown`` of ``cluster/local_ray.py`` as it was at git revision REF (e.g.
            ``--modes product,product@820cd1f`` compares the embedded Ray before and after a change)

and prints for each start the seconds until the start call returned (``init_s``), until two 1-CPU actors
answered a call (``ready_s``: what a job's first step waits for) and for the stop call (``shutdown_s``).
``--load`` keeps one core busy with a spin loop meanwhile, as a test suite or a second job would.

Only public calls of each (the product's two functions, Ray's ``init``/``shutdown``); nothing is patched.
Not a timed test: it prints what it sees.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.bench_ddp import REPO, _sweep

MODES = ("product", "plain")


def child(mode: str) -> None:
    import importlib.util

    import ray

    from cluster import local_ray

    if "@" in mode:  # an earlier revision's module, written to a file by run_start
        spec = importlib.util.spec_from_file_location("local_ray_at_rev", os.environ["DIAG_LOCAL_RAY_FILE"])
        assert spec is not None and spec.loader is not None
        local_ray = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(local_ray)

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
    t1 = time.perf_counter()
    if mode == "plain":
        ray.shutdown()
    else:
        local_ray.shutdown()
    shutdown_s = time.perf_counter() - t1
    print(
        json.dumps({"mode": mode, "init_s": init_s, "ready_s": ready_s, "shutdown_s": shutdown_s}), flush=True
    )


def run_start(mode: str) -> dict[str, float | str] | None:
    """One start and stop in a fresh process with its own Ray temp dir; None when it gave no result."""
    tmp = tempfile.mkdtemp(prefix="dstart", dir="/tmp")  # short: Ray's socket paths live under it
    env = dict(
        os.environ,
        RAY_TMPDIR=tmp,
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONPATH=os.pathsep.join(q for q in [REPO, os.environ.get("PYTHONPATH", "")] if q),
    )
    env.pop("RAY_ADDRESS", None)
    if "@" in mode:
        source = subprocess.run(
            ["git", "show", f"{mode.split('@', 1)[1]}:cluster/local_ray.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        env["DIAG_LOCAL_RAY_FILE"] = os.path.join(tmp, "local_ray_at_rev.py")
        with open(env["DIAG_LOCAL_RAY_FILE"], "w") as fh:
            fh.write(source)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.diag.start", "--child", mode],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for pid in _sweep(tmp):  # anything that start left running (named by its temp dir)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        print(f"{mode}: no result (rc {out.returncode}): {out.stderr[-500:]}", file=sys.stderr)
        return None
    row: dict[str, float | str] = json.loads(lines[-1])
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.diag.start",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--starts", type=int, default=6, help="starts per mode")
    p.add_argument("--load", action="store_true", help="keep one core busy meanwhile")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES and not m.startswith("product@")]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {MODES}")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.load else None
    rows: list[dict[str, float | str]] = []
    try:
        for i in range(args.starts * len(modes)):
            row = run_start(modes[i % len(modes)])
            if row is None:
                continue
            rows.append(row)
            print(
                f"{row['mode']:16s} start {row['init_s']:.2f} s, ready {row['ready_s']:.2f} s, "
                f"shutdown {row['shutdown_s']:.2f} s",
                flush=True,
            )
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        init, ready, down = ([float(r[k]) for r in mine] for k in ("init_s", "ready_s", "shutdown_s"))
        print(
            f"{mode:16s} n={len(mine)}: start median {statistics.median(init):.2f} s, ready median "
            f"{statistics.median(ready):.2f} s (range {min(ready):.2f}-{max(ready):.2f}), shutdown median "
            f"{statistics.median(down):.2f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
