"""A decode worker's GPU KV cache, mapped by prefill workers on its host through CUDA IPC.

This is what the `shm` transport does on a GPU: where a CPU cache lives in a shared-memory file
that peers map, a GPU cache stays where torch allocated it and its owner exports a CUDA IPC
handle to its memory (`export_cache`); a prefill worker on the same host opens the handle
(`map_cuda_cache`) and copies rows into the decode worker's blocks device to device. The handle
travels in the `PeerEndpoint` as plain fields (bytes and integers, msgspec-encoded like the rest
of the handshake): the ones torch's own tensor sharing carries, without pickle. torch keeps the
exporting process's memory alive while a peer has it open (a reference count in shared memory).
"""

from __future__ import annotations

import torch

from pdserve.disagg.protocol import CudaIpcHandle, KVLayout


def export_cache(cache: torch.Tensor) -> CudaIpcHandle:
    """The handle of the storage behind `cache` (the whole cache: every layer views it)."""
    if cache.device.type != "cuda":
        raise ValueError(f"CUDA IPC exports CUDA memory, not {cache.device}")
    fields = cache.untyped_storage()._share_cuda_()
    device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = fields
    return CudaIpcHandle(int(device), bytes(handle), int(size), int(offset), bytes(rc_handle),
                         int(rc_offset), bytes(ev_handle), bool(ev_sync))  # fmt: skip


def map_cuda_cache(handle: CudaIpcHandle, layout: KVLayout, dtype: torch.dtype,
                   num_heads: int) -> torch.Tensor:  # fmt: skip
    """A decode worker's cache of `num_heads` KV heads, opened in this process. Its slot count
    comes from the allocation's size, as for a shared-memory file (pools size theirs apart)."""
    if not torch.cuda.is_available():
        raise ValueError("the decode worker's cache is on a GPU and this process has no CUDA")
    torch.cuda.init()
    row = layout.num_layers * 2 * num_heads * layout.row_width
    itemsize = torch.empty((), dtype=dtype).element_size()
    if handle.size_bytes == 0 or handle.size_bytes % (row * itemsize):
        raise ValueError(f"a CUDA allocation of {handle.size_bytes} bytes is not a whole KV "
                         f"cache of {layout}")  # fmt: skip
    try:  # torch caches opened handles: a second open in this process maps the same memory
        storage = torch.UntypedStorage._new_shared_cuda(
            handle.device,
            handle.handle,
            handle.size_bytes,
            handle.offset_bytes,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle,
            handle.event_sync_required,
        )
    except RuntimeError as e:  # gone (its worker died), or another GPU not reachable from here
        raise ValueError(f"cannot open the decode worker's GPU cache: {e}") from None
    num_slots = handle.size_bytes // (row * itemsize)
    shape = (layout.num_layers, 2, num_slots, num_heads, layout.row_width)
    out = torch.empty(0, dtype=dtype, device=storage.device)
    return out.set_(storage, 0, shape)
