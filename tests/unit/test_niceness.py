"""scaling.worker_niceness: every thread of a worker process gets the configured niceness.

Ray starts its worker processes at niceness 15; a rank must not stay there. Each case runs in a fresh
interpreter started at niceness 15 with a thread already running, as a Ray worker's are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [
    pytest.mark.multiprocess,  # starts processes
    pytest.mark.timeout(60),
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux"),
]

PROBE = textwrap.dedent("""
    import json, os, sys, threading
    from cluster.rank.process import set_niceness

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)  # made before: inherits 15
    thread.start()
    note = set_niceness(None if sys.argv[1] == "none" else int(sys.argv[1]))
    later = threading.Thread(target=stop.wait)  # made after: inherits the main thread's new value
    later.start()
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    print(json.dumps([note, sorted({os.getpriority(os.PRIO_PROCESS, t) for t in tids})]))
    stop.set()
""")


def _probe(value: str) -> tuple[str, list[int]]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, value],
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
        preexec_fn=lambda: os.nice(15 - os.nice(0)),
    )
    note, levels = json.loads(out.stdout)
    return note, levels


def test_raising_niceness_reaches_every_thread() -> None:
    note, levels = _probe("17")  # allowed to anyone
    assert note == "17" and levels == [17]


def test_normal_priority_or_a_clear_reason() -> None:
    note, levels = _probe("0")
    if os.geteuid() == 0:  # CAP_SYS_NICE: back to normal priority, every thread
        assert note == "0" and levels == [0]
    else:
        assert levels == [15]
        assert "not permitted" in note and "RAY_worker_niceness=0" in note


def test_null_keeps_what_ray_gave() -> None:
    note, levels = _probe("none")
    assert note == "ray's" and levels == [15]
