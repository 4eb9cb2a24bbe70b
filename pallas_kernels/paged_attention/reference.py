"""Plain-jnp attention: the oracle every paged-attention kernel is checked against, and the
dense attention the models' reference forwards use (one home for the masked-softmax math)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_gather.reference import gather_kv_pages_reference

NO_WINDOW = 2**30  # stands for "no sliding window" in a traced per-layer window array


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                    k_positions: jax.Array, window: jax.Array | int = NO_WINDOW,
                    k_valid: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention with a causal (and optional sliding-window) mask on positions.

    q `[B, T, H, hd]`, k/v `[B, S, KV, hd]`, q_positions `[B, T]`, k_positions `[B, S]`,
    k_valid `[B, S]` bool (optional) -> `[B, T, H, hd]`. Softmax runs in float32.
    """
    B, T, H, hd = q.shape
    KV = k.shape[2]
    G = H // KV
    # Heads-major operands make both products plain batched matmuls [B, KV] x [T*G, S]: on
    # XLA:CPU markedly faster than a five-index einsum, and the same on GPU.
    qh = q.reshape(B, T, KV, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, KV, T * G, hd)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, KV, S, hd]
    scores = jnp.matmul(qh, kh.swapaxes(-1, -2)).astype(jnp.float32) * (hd ** -0.5)
    distance = jnp.repeat(q_positions, G, axis=1)[:, :, None] - k_positions[:, None, :]
    mask = (distance >= 0) & (distance < window)  # [B, T*G, S], t-major like qh
    if k_valid is not None:
        mask = mask & k_valid[:, None, :]
    mask = mask[:, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    # Rows with no visible key get zeros, not NaN.
    probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)
    out = jnp.matmul(probs.astype(v.dtype), vh)  # [B, KV, T*G, hd]
    return out.reshape(B, KV, T, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, T, H, hd)


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
    B, M = block_tables.shape
    S = M * k_pool.shape[2]
    k = gather_kv_pages_reference(k_pool, layer, block_tables)
    v = gather_kv_pages_reference(v_pool, layer, block_tables)
    k_positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    k_valid = k_positions < context_lens[:, None]
    return dense_attention(q, k, v, q_positions, k_positions, window, k_valid)
