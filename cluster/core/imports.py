"""Heavy imports with Python's cyclic garbage collector paused.

Importing torch, and torch._dynamo after it (DistributedDataParallel's constructor reads
``torch._dynamo.utils``), creates about half a million objects and almost no garbage, yet on Python 3.11 the
collector runs ~650 times while they are made, the later passes over everything made so far. Paused, a
rank's imports take 7-10 % less CPU (benchmarks/LOG.md, 2026-12-08): paid by every rank at its start, and by
a replacement rank on a recovery's path. The collector is paused for the import only, through ``gc``'s
public switch, and left as it was found: a process that turned it off keeps it off.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block with the cyclic garbage collector off, then turn it back on if it was on. Reference
    counting still frees what it can; the next collection after the block finds any cycle left."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
