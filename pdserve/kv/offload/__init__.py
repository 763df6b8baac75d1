"""KV cache tiers beyond the pool: host memory shared by a host's workers, and disk.

A full block evicted from the pool is copied out before the step that reuses it (the only copy on
the step's path) and written to the first tier by a background thread, under its prefix-cache
chain hash; a tier that runs out of room hands its least recently used entries down to the next
tier. A prompt whose prefix continues past the pool's hits into a tier loads those blocks back
into fresh pool blocks instead of recomputing them, when loading is measured to be faster. Every
entry carries its layout fingerprint and a CRC-32 of its payload, and a read that fails any check
is a miss. No torch here: payloads are bytes (numpy uint8 arrays); `runner/kv_offload.py` moves
them between the cache tensors and these tiers.
"""
