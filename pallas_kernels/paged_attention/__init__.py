"""Paged attention for decode, verify and prefill runs over the KV pool, optionally with a
draft-tree mask (`tree_mask`: verifying a dynamic draft tree in one step).

`paged_attention` is what callers use: the compiled Pallas kernel on a GPU (for shapes it
supports, see `kernel.compiled_supported`), the jnp reference elsewhere, the kernel in
interpret mode with `interpret=True` (see `pallas_kernels.backend`).
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels.backend import dispatch
from pallas_kernels.paged_attention.kernel import compiled_supported, paged_attention_kernel
from pallas_kernels.paged_attention.reference import (NO_WINDOW, merge_attention,
                                                     paged_attention_chunks,
                                                     paged_attention_reference)


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                    layer: jax.Array | int, block_tables: jax.Array, q_positions: jax.Array,
                    context_lens: jax.Array, window: jax.Array | int = NO_WINDOW,
                    tree_mask: jax.Array | None = None, *, chunk_blocks: int | None = None,
                    interpret: bool | None = None) -> jax.Array:
    """See `paged_attention_reference` for the contract (`tree_mask` included).
    `chunk_blocks` bounds the reference's reads by the context (the kernel's loop already
    stops at `context_lens`)."""
    reference = functools.partial(paged_attention_reference, chunk_blocks=chunk_blocks)
    return dispatch(paged_attention_kernel, reference, q, k_pool, v_pool, layer,
                    block_tables, q_positions, context_lens, window, tree_mask,
                    interpret=interpret, supported=compiled_supported(q.shape, k_pool.shape))


__all__ = ["NO_WINDOW", "merge_attention", "paged_attention", "paged_attention_chunks",
           "paged_attention_kernel", "paged_attention_reference"]
