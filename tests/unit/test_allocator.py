"""scaling.tune_allocator: glibc keeps freed memory for the next step instead of unmapping and refaulting it.

Each case runs in a fresh interpreter: mallopt settings are process-wide and permanent.
"""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
import textwrap

import pytest

pytestmark = [
    pytest.mark.multiprocess,  # starts processes
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc only"
    ),
]

# Allocate and free a 64 MiB block 20 times; report the minor page faults of the last 10 rounds and whether
# the block came from mmap (mallinfo2's hblkhd counts mmapped bytes in use).
PROBE = textwrap.dedent("""
    import ctypes, resource, sys
    from cluster.rank.process import tune_allocator

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.mallinfo2.restype = MallInfo2
    state = tune_allocator() if sys.argv[1] == "tuned" else "system"
    size = 64 << 20
    mmapped = 0
    for i in range(20):
        if i == 10:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        p = libc.malloc(size)
        libc.memset(p, 1, size)  # touch every page, as a tensor fill does
        mmapped = max(mmapped, libc.mallinfo2().hblkhd)
        libc.free(p)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(state, faults, mmapped)
""")


def _probe(mode: str) -> tuple[str, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=50, check=True
    )
    state, faults, mmapped = out.stdout.split()
    return state, int(faults), int(mmapped)


def test_tuned_allocator_reuses_memory_instead_of_refaulting_it() -> None:
    state, faults, mmapped = _probe("tuned")
    assert state == "tuned"
    assert mmapped < 64 << 20  # the block came from the heap, not a fresh mmap (others may be mapped)
    # 10 rounds x 16384 pages would be 163840 faults if every round refaulted; a reused heap faults none
    assert faults < 1000, faults


def test_system_allocator_refaults_every_round() -> None:
    """The baseline the tuning removes: glibc maps a fresh 64 MiB block and faults every page of it each
    time."""
    state, faults, mmapped = _probe("system")
    assert state == "system"
    assert mmapped >= 64 << 20
    assert faults > 10 * 16384 * 0.9, faults
