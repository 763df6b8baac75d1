"""The engine's malloc settings: a freed block of a step's size is reused without page faults."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# A fresh process allocates, writes and frees a 24 MiB block twice and prints the page faults
# of the second round; with `keep`, after setting the engine's thresholds first.
PROBE = """
import ctypes, resource, sys
from pdserve.engine import c_heap
if sys.argv[1] == "keep":
    assert c_heap.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 24 << 20
for round in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults)
"""
PAGES = (24 << 20) // 4096


def second_round_faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's tunables
    env.pop("GLIBC_TUNABLES", None)
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, env=env)  # fmt: skip
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_a_freed_block_is_reused_without_page_faults():
    assert second_round_faults("default") > PAGES // 2  # glibc's default: written afresh
    assert second_round_faults("keep") < PAGES // 20
