"""The C heap of an engine process: freed activation memory stays mapped for the next step.

A step's activations are a few hundred MB of tensors that torch allocates and frees with
glibc's malloc. By default glibc returns the free top of its heap to the kernel once it exceeds
a threshold that adapts to the largest block freed so far, and maps any block over another
adaptive threshold fresh from the kernel; either way the next step's first writes page-fault
again. llama-125m's 2,048-token prefill steps took up to 52,000 page faults and 1.41-1.75 s
each, against none and 1.26-1.36 s with the settings below (docs/PERFORMANCE.md,
"Prefill without page faults"). `keep_freed_memory` fixes both thresholds: blocks up to
`MMAP_THRESHOLD` come from the heap, and the heap is trimmed only when `TRIM_THRESHOLD` of it
lies free at the top. The cost is that the process keeps its peak activation memory mapped.

Loading leaves the opposite problem: the float weights a packed or quantized layer was made
from, and the packed weights the loader then moves onto huge pages, are freed into the middle
of the heap, where no trim reaches them (llama-125m: 440 MiB more resident than the model
needs). `release_free_memory` hands every free page of the heap back (`malloc_trim(0)`), once,
after loading. glibc only: elsewhere (macOS, musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import logging

logger = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit systems
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Set the process's malloc thresholds (once; process-wide); whether they could be set."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - raises AttributeError where it is not glibc
        mallopt = libc.mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.warning("malloc's thresholds could not be set: steps may page-fault more")
    return ok


def release_free_memory() -> bool:
    """Return the heap's free pages to the system (once the model is loaded); whether it could."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (AttributeError, OSError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
