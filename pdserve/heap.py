"""The garbage collector in long-running processes: what exists before the work starts is
frozen out of the collector's walks.

CPython's full (generation 2) collection walks every tracked object. A served process holds
about 300,000 of them once it has started (transformers, FastAPI and the tokenizer in the
frontend; torch and the engine in a worker), and a full collection of that heap takes 100-250
ms on a 2-core machine; the interpreter starts one whenever the objects promoted since the last
exceed a quarter of the heap, which under load every request's short-lived objects do. In the
frontend that stopped the event loop, and so every stream, for up to 210 ms six or seven times
in 30 s; in `pdserve bench`'s client it delayed the token timestamps it measures by up to 130
ms (docs/PERFORMANCE.md, "The garbage collector under load"). Frozen objects sit in a permanent
generation that no collection walks; what the work creates is collected as before, and full
collections walk only that.

A server also collects its youngest generation less often (`YOUNG_THRESHOLD` net new container
objects instead of CPython's 700): requests' objects are freed by their reference counts, so
the frequent young collections walked mostly live in-flight state, 420-490 ms of the frontend's
CPU per 30 s of load; at 50,000 that load takes one, of 19-35 ms.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 50_000  # generation 0's collection threshold in a server process


def freeze_startup_heap() -> int:
    """Collect, then freeze every surviving object for the rest of the process, and collect the
    youngest generation every `YOUNG_THRESHOLD` objects; returns how many were frozen. For a
    server process once it has started (the frontend, an engine worker, a tensor-parallel
    rank), never for library code: both settings are process-wide."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    return gc.get_freeze_count()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Within the block, collections walk only the objects created in it; after it, everything
    is collected as before (the frozen objects return to the oldest generation). In a process
    whose heap is already frozen (a server's, an enclosing block's) what was frozen stays so."""
    already = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        yield
    finally:
        if not already:
            gc.unfreeze()
