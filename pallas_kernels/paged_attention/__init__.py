"""Paged attention for decode, verify and prefill runs over the KV pool.

`paged_attention` is what callers use; it picks the implementation for the current backend.
Only the jnp reference exists so far, so every backend runs it.
"""
from pallas_kernels.paged_attention.reference import paged_attention_reference

paged_attention = paged_attention_reference

__all__ = ["paged_attention", "paged_attention_reference"]
