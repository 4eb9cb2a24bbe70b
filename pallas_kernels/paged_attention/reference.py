"""Plain-jnp paged attention: the oracle every paged-attention kernel is checked against."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# specjax.models.llama.NO_WINDOW (a test checks they agree). Not imported: specjax's engine
# imports this package, so importing specjax here would make `import pallas_kernels...` circular.
NO_WINDOW = 2**30


def paged_attention_reference(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                              layer: jax.Array | int, block_tables: jax.Array,
                              q_positions: jax.Array, context_lens: jax.Array,
                              window: jax.Array | int = NO_WINDOW, *,
                              interpret: bool | None = None) -> jax.Array:
    """Attention of a run of query tokens per request over that request's cached positions.

    q `[B, T, H, hd]`; k_pool/v_pool `[L, num_blocks, tokens_per_block, KV, hd]`, read at
    `layer` (indexing pool and blocks together gathers only the request's pages);
    block_tables `[B, M]` (padded with the null block 0); q_positions `[B, T]`;
    context_lens `[B]` = positions held in the pool for the request (the run's own K/V
    already written). Causal on positions, so a run attends to itself causally and to
    everything before it. Returns `[B, T, H, hd]`; rows with context_len 0 give zeros.
    `interpret` is accepted for signature parity with the kernel and ignored.
    """
    del interpret
    from specjax.models.llama import dense_attention  # lazy: see NO_WINDOW

    B, M = block_tables.shape
    bs = k_pool.shape[2]
    k = k_pool[layer, block_tables].reshape(B, M * bs, *k_pool.shape[3:])
    v = v_pool[layer, block_tables].reshape(B, M * bs, *v_pool.shape[3:])
    k_positions = jnp.broadcast_to(jnp.arange(M * bs), (B, M * bs))
    k_valid = k_positions < context_lens[:, None]
    return dense_attention(q, k, v, q_positions, k_positions, window, k_valid)
