"""Heavy imports with Python's cyclic garbage collector paused.

Importing torch, and torch._dynamo after it (DistributedDataParallel's constructor reads
``torch._dynamo.utils``), creates about half a million objects and almost no garbage. On Python 3.11 the
collector still runs again and again while they are made, each full pass over everything made so far: about
a third of the CPU of the import, which every rank pays at its start and every replacement rank on a
recovery's path (benchmarks/LOG.md, 2026-12-08). The collector is paused for the import only, through
``gc``'s public switch, and left as it was found: a process that turned it off keeps it off.
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
