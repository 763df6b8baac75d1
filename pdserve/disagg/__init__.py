"""Prefill/decode disaggregation: KV layout handshake, KV transports and the router."""
