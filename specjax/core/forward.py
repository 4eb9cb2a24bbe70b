"""The paged forward: a model's layers over each row's run, K/V written into and read from the
pool through the row's block table. Target and drafter heads share `PagedAttention`, so their
pools line up block for block."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.paged_attention import paged_attention, paged_attention_chunks
from specjax.core.batch import StepBatch
from specjax.core.kv import NULL_BLOCK, KVPool, ring_tables
from specjax.core.sharding import HEADS, POOL, TP, heads_local
from specjax.core.tree import TreeLayout
from specjax.models.llama import NO_WINDOW, Llama, layer_windows


def kv_destinations(batch: StepBatch, tokens_per_block: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where the runs' K/V go in a request's own numbering, each `[B, T]`: the block of its
    sequence (position // tokens_per_block), the offset in it, and whether the row is real
    (padding is not)."""
    T = batch.tokens.shape[1]
    positions = batch.start_pos[:, None] + jnp.arange(T)
    valid = jnp.arange(T) < batch.query_lens[:, None]
    return positions // tokens_per_block, positions % tokens_per_block, valid


# Attention over the pool reads the block table this many tokens at a time, only as many chunks
# as the batch's longest context needs (`paged_attention_chunks`): the cost follows the
# context, not max_model_len, and the compiled step holds one attention body.
CONTEXT_CHUNK_TOKENS = 128


def chunk_blocks(tokens_per_block: int) -> int:
    """Blocks per chunk of a table read (`CONTEXT_CHUNK_TOKENS`)."""
    return max(1, CONTEXT_CHUNK_TOKENS // tokens_per_block)


class PagedAttention:
    """Paged attention for runs laid out as in `batch`: `write` puts a run's K/V into a pool
    layer (padding into the null block), `read` attends each row's queries over its blocks up
    to its context length, `attend` does both (the `AttendFn` the layer loop calls)."""

    def __init__(self, batch: StepBatch, tokens_per_block: int, windows: jax.Array | None = None,
                 tree: TreeLayout | None = None):
        T = batch.tokens.shape[1]
        self.batch, self.windows = batch, windows
        # Row i's K/V go to slot start + i; a tree row's position is start + its depth.
        depths = jnp.arange(T)[None, :] if tree is None else tree.depths
        self.positions = batch.start_pos[:, None] + depths           # [B, T]
        self.tree_mask = None if tree is None else tree.ancestors
        # Padded rows (whose slot start may be anything) see nothing, and add no chunks.
        self.context_lens = jnp.where(batch.query_lens > 0, batch.start_pos + batch.query_lens,
                                      0)                               # [B]
        self.tokens_per_block = tokens_per_block
        self.logical, self.offsets, self.valid = kv_destinations(batch, tokens_per_block)
        # The pool's blocks from the table; padding goes to the null block.
        blocks = jnp.take_along_axis(batch.block_tables, jnp.where(self.valid, self.logical, 0),
                                     axis=1)
        self.blocks = jnp.where(self.valid, blocks, NULL_BLOCK)

    def _place(self, layer, pool: KVPool) -> tuple[bool, object]:
        """(whether attention layer `layer` lives in the pool's ring, its index there)."""
        if pool.places is None:
            return False, layer
        if not isinstance(layer, int):
            raise ValueError("a pool with local-layer rings needs the layers unrolled "
                             "(scan_layers=False)")
        return pool.places[layer]

    def _ring_destinations(self, pool: KVPool) -> jax.Array:
        """`[B, T]` ring blocks of the runs' K/V; padding goes to the spare's ring."""
        spare = pool.ring_k.shape[1] - pool.ring_blocks
        ring = self.batch.slots[:, None] * pool.ring_blocks + self.logical % pool.ring_blocks
        return jnp.where(self.valid, ring, spare)

    def write(self, k: jax.Array, v: jax.Array, layer, pool: KVPool) -> KVPool:
        # Index arrays split by the heads' slice put their dims first: the update is k's
        # own `[B, T, KV, hd]`.
        in_ring, index = self._place(layer, pool)
        if in_ring:
            where = (index, self._ring_destinations(pool), slice(None), self.offsets)
            return pool.replace(ring_k=pool.ring_k.at[where].set(k.astype(pool.ring_k.dtype)),
                                ring_v=pool.ring_v.at[where].set(v.astype(pool.ring_v.dtype)))
        where = (index, self.blocks, slice(None), self.offsets)
        return pool.replace(k=pool.k.at[where].set(k.astype(pool.k.dtype)),
                            v=pool.v.at[where].set(v.astype(pool.v.dtype)))

    def read(self, q: jax.Array, layer, pool: KVPool) -> jax.Array:
        window = NO_WINDOW if self.windows is None else self.windows[layer]
        in_ring, index = self._place(layer, pool)
        # The window and the tree mask are the same on every device: closed over, replicated.
        attend = heads_local(
            lambda q, k, v, tables, positions, lens: paged_attention(
                q, k, v, index, tables, positions, lens, window, self.tree_mask,
                chunk_blocks=chunk_blocks(self.tokens_per_block)),
            pool.mesh, (HEADS, POOL, POOL, P(), P(), P()), HEADS)
        if in_ring:
            # The window's blocks of the slot's ring; a table entry before the window names
            # a ring block a later position took, which the window's mask hides.
            tables = ring_tables(pool, self.batch.slots, self.batch.block_tables.shape[1])
            out = attend(q, pool.ring_k, pool.ring_v, tables, self.positions,
                         self.context_lens)
        else:
            out = attend(q, pool.k, pool.v, self.batch.block_tables, self.positions,
                         self.context_lens)
        # Padding rows attend to nothing of use: zero, with the zeroed embedding below, they
        # keep a zero residual stream through every layer, rows the CPU kernel skips.
        return jnp.where(self.valid[:, :, None, None], out, 0).astype(q.dtype)

    def attend(self, q, k, v, layer, pool: KVPool) -> tuple[jax.Array, KVPool]:
        pool = self.write(k, v, layer, pool)
        return self.read(q, layer, pool), pool


def context_attention(q: jax.Array, pool: KVPool, layer, block_tables: jax.Array,
                      q_positions: jax.Array, context_lens: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
    """Queries `[B, T, H, hd]` at `q_positions` `[B, T]` over one pool layer's context
    (positions < `context_lens` `[B]`; 0 for padded rows) -> (out `[B, T, H, hd]`, lse
    `[B, T, H]`), read a chunk of blocks at a time as far as the context goes. For rows whose
    own K/V stay local: `merge_attention` adds attention over those."""
    read = heads_local(
        lambda q, k, v, tables, positions, lens: paged_attention_chunks(
            q, k, v, layer, tables, positions, lens,
            chunk_blocks=chunk_blocks(pool.tokens_per_block)),
        pool.mesh, (HEADS, POOL, POOL, P(), P(), P()), (HEADS, P(None, None, TP)))
    return read(q, pool.k, pool.v, block_tables, q_positions, context_lens)


def paged_forward(model: Llama, kv: KVPool, batch: StepBatch,
                  capture_layers: Sequence[int] = (), tree: TreeLayout | None = None,
                  aux: Mapping[str, Any] | None = None) -> tuple[KVPool, jax.Array, jax.Array]:
    """Run each row's tokens through the model, writing their K/V into the pool first. With
    `tree`, each row is a draft tree (`specjax.core.tree`): positions from its depths,
    attention over the context, its ancestors and itself. `aux`: the runs of the step's
    auxiliary state (`specjax.core.aux_state.begin`), e.g. a hybrid's `recurrence`.

    Returns (kv, hidden `[B, T, D]` after the last layer, captured `[C, B, T, D]`: the residual
    streams after `capture_layers`, for hidden-state drafters; rows past query_lens are padding).
    """
    paged = PagedAttention(batch, kv.tokens_per_block, layer_windows(model.config), tree)
    extra = {"recurrence": aux["recurrent"]} if aux and "recurrent" in aux else {}
    x = jnp.where(paged.valid[:, :, None], model.embed_tokens(batch.tokens), 0)
    hidden, captured, kv = model.run_layers(x, paged.positions, paged.attend, kv,
                                            capture_layers, **extra)
    return kv, hidden, captured


def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x `[B, T, ...]` -> `[B, ...]`: row b's entry at `index[b]`."""
    return jnp.take_along_axis(x, index.reshape(-1, *([1] * (x.ndim - 1))), axis=1)[:, 0]


def last_rows(hidden: jax.Array, query_lens: jax.Array) -> jax.Array:
    """hidden `[B, T, D]` -> `[B, D]` at each row's last real token."""
    return take_rows(hidden, jnp.maximum(query_lens - 1, 0))
