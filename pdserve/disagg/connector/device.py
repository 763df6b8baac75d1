"""KV rows on a GPU: ordering between the step loop and the transfer thread, and host staging.

On the CPU a layer's rows are in the cache when its hook runs, and a copy is done when it
returns. On a GPU neither holds: the hook runs when the layer's kernels are queued, and a copy
returns when it is queued. So the sender records an event on the step loop's stream in each
layer hook (`LayerOrder.mark`), and the transfer thread runs that layer's copies on a stream of
its own after the event, and waits for them before it counts the layer done
(`LayerOrder.ordered`): the rows it reads are written, and once the step loop is told a
transfer is flushed nothing of it is in flight, so its blocks may be reused at once and the
decode worker may read what was written into its cache. Rows that leave as bytes (on a `tcp`
stream, or into a shared-memory file on the CPU) are copied to pinned host memory first
(`to_host`): one DMA, no bounce through pageable memory.

Everything here is a no-op for CPU tensors, so the CPU paths are unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory: itself on the CPU, else a pinned copy (synchronous)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out


def host_buffer(n: int, device: torch.device) -> np.ndarray:
    """`n` bytes to receive rows into, for a cache on `device` (pinned for a GPU's; the array
    keeps its tensor alive)."""
    if device.type != "cuda":
        return np.empty(n, dtype=np.uint8)
    return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


class LayerOrder:
    """The transfer thread's copies of a device cache, ordered after the layers that wrote it."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def mark(self):
        """In the step loop, after a layer's kernels are queued: what its copies wait for."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record()  # on the step loop's current stream
        return event

    @contextlib.contextmanager
    def ordered(self, mark) -> Iterator[None]:
        """In the transfer thread: the copies made inside run after `mark` (from `mark`, never
        None here), and are complete when the block ends."""
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(mark)
            yield
        self.stream.synchronize()
