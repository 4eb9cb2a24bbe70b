"""Plain-jnp paged KV relocation and page gather: the oracles for the kv_gather kernels."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def relocate_kv_reference(k_pool: jax.Array, v_pool: jax.Array, src_blocks: jax.Array,
                          src_offsets: jax.Array, dst_blocks: jax.Array, dst_offsets: jax.Array,
                          num_moves: jax.Array, *,
                          interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Move K/V rows (every layer) of accepted positions to their final slots.

    k_pool/v_pool `[L, num_blocks, KV, tokens_per_block, hd]`; src_blocks/src_offsets and
    dst_blocks/dst_offsets `[B, R]` (pool block id and row within it); num_moves `[B]`: row b
    performs its first num_moves[b] moves, the rest of its entries are ignored (any values).
    Every source is read before any destination is written, so chains and swaps (a slot that
    is both a destination and another move's source) are safe. Destinations of the performed
    moves must be distinct (which of two writes to one slot survives is unspecified).
    Returns the updated (k_pool, v_pool); callers donate the pools to update them in place.
    `interpret` is accepted for signature parity with the kernel and ignored.
    """
    del interpret
    k_pool, v_pool = jnp.asarray(k_pool), jnp.asarray(v_pool)
    R = src_blocks.shape[1]
    num_blocks = k_pool.shape[1]
    valid = jnp.arange(R) < num_moves[:, None]
    dst = jnp.where(valid, dst_blocks, num_blocks)  # out of range: the write is dropped

    def move(pool: jax.Array) -> jax.Array:
        # Advanced indices split by a slice put their dims first: rows are [B, R, L, KV, hd].
        rows = pool[:, src_blocks, :, src_offsets]  # all read first
        return pool.at[:, dst, :, dst_offsets].set(rows, mode="drop")

    return move(k_pool), move(v_pool)


def gather_kv_pages_reference(pool: jax.Array, layer: jax.Array | int, block_tables: jax.Array,
                              *, interpret: bool | None = None) -> jax.Array:
    """pool `[L, num_blocks, KV, tokens_per_block, hd]`, block_tables `[B, M]` ->
    `[B, KV, M, tokens_per_block, hd]`: each request's pages at `layer`, head by head, in
    table order (padded entries read the null block 0)."""
    del interpret
    KV = pool.shape[2]
    # Indexing heads beside blocks gathers each (request, head, page) run straight to its
    # head-major place: no transpose after the gather.
    return jnp.asarray(pool)[layer, block_tables[:, None, :], jnp.arange(KV)[:, None]]
