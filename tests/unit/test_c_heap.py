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


# A fresh process with the engine's thresholds fills 64 MiB of heap blocks, keeps a small block
# above them (so no trim at the top can reach them), frees them, and prints its resident MiB
# before and after `release_free_memory`.
RELEASE_PROBE = """
import ctypes
from pdserve.engine import c_heap
assert c_heap.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss_mib():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmRSS"))
    return int(line.split()[1]) // 1024
blocks = [libc.malloc(1 << 20) for _ in range(64)]
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
top = libc.malloc(4096)
ctypes.memset(top, 1, 4096)
for b in blocks:
    libc.free(b)
before = rss_mib()
assert c_heap.release_free_memory()
print(before, rss_mib())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_freed_heap_memory_goes_back_to_the_system():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True,
                         check=True, env=env)  # fmt: skip
    before, after = map(int, out.stdout.split())
    assert before - after >= 48  # of the 64 MiB freed in the middle of the heap
