"""Memory on transparent huge pages for what the kernels stream: the weights, the KV cache, the
roofline's read buffer.

A batch-1 decode step reads every weight once, front to back. On 4 KiB pages that is a new page
every 4 KiB, each needing its translation: llama-125m's 494 MiB are 126,000 pages a step, far
more than any TLB holds. On 2 MiB pages they are 247. Linux gives an anonymous mapping huge pages
when it is asked to (`madvise(MADV_HUGEPAGE)`, the mode of `transparent_hugepage/enabled` most
distributions ship) or always; torch's allocator does not ask. Measured on a Zen 5 (2 cores): a
decode batch of 16 at 1,000 tokens of context 1.15x as fast with the weights and the KV cache on
huge pages, batch-1 decode 1.04x, a plain streaming read 1.07x (docs/PERFORMANCE.md, "Weights
and KV cache on huge pages").

`arena(tensors)` copies tensors into one private anonymous mapping, 2 MiB-aligned and advised
before the first write, so that its pages fault in huge where the kernel has them (and 4 KiB
where it does not: nothing fails, it is only slower). `huge_bytes(t)` says how much of the
mapping holding `t` is on huge pages (`/proc/self/smaps`). `PDSERVE_HUGE_PAGES=0` in the
environment keeps everything in torch's memory.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor's start in an arena: a cache line, what the vector loads want
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ENV_VAR = "PDSERVE_HUGE_PAGES"


def thp_mode() -> str:
    """The transparent huge pages mode: "always", "madvise", "never", or "" (none here)."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else ""


def supported() -> bool:
    """Whether an advised mapping can get huge pages on this machine."""
    return thp_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


def available() -> bool:
    """Whether the engine puts its weights and KV cache on huge pages: where `supported()`,
    unless `PDSERVE_HUGE_PAGES=0` keeps them in torch's memory."""
    return supported() and os.environ.get(ENV_VAR, "1") != "0"


def empty(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed uint8 memory starting on a 2 MiB boundary, advised for huge pages and
    not touched yet (its pages fault in at the first write). Its own mapping, unmapped when
    the last tensor viewing it is freed."""
    if not supported():
        raise RuntimeError(f"no transparent huge pages here (mode {thp_mode()!r})")
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(m, dtype=torch.uint8)  # holds `m` for as long as a view lives
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """torch.zeros(shape, dtype, device), on huge pages for a CPU tensor where they are
    available, else as torch makes it. Written once, as torch.zeros is: its memory is resident
    from now on, and no step pays for faulting it in."""
    if torch.device(device).type != "cpu" or not available():
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= n
    return empty(numel * dtype.itemsize).view(dtype).view(shape).zero_()


def arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of `tensors` (CPU), side by side in that order in one mapping on huge
    pages, each starting on a cache line."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    base = empty(total)
    copies = []
    for t, off in zip(tensors, offsets):
        copy = base[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    return copies


def huge_bytes(t: torch.Tensor) -> int:
    """Bytes of the mapping that holds `t`'s first byte which sit on huge pages (0 where that
    cannot be read)."""
    address = t.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0
