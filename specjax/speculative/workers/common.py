"""Pieces every hidden-state worker (EAGLE-3, MTP-Eagle, MTP) shares.

Row t of a hidden-state drafter pairs the target's hidden state at position t with the token
at t+1 and predicts the token at t+2; its K/V live at position t of the drafter's own pool,
which shares the target's block tables.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.reference import dense_attention, merge_attention
from specjax.core.batch import StepBatch
from specjax.core.forward import PagedAttention, context_attention
from specjax.core.kv import KVPool


def shift_in(tokens: jax.Array, query_lens: jax.Array, following: jax.Array) -> jax.Array:
    """tokens `[B, T]` shifted left by one, with `following` `[B]` at each row's last real
    index (query_lens - 1): the token each row's hidden state is paired with."""
    T = tokens.shape[1]
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    last = jnp.arange(T)[None, :] == (query_lens - 1)[:, None]
    return jnp.where(last, following[:, None], shifted)


def head_pass(layer, kv: KVPool, pool_layer: int, run: StepBatch, target, hidden: jax.Array
              ) -> tuple[KVPool, jax.Array]:
    """One drafter layer over `run` (its tokens are the embedded tokens, `hidden` `[B, T, H]`
    the paired hidden states), K/V written into `kv` layer `pool_layer` for real rows only.
    `layer.run_layer(embeds, hidden, positions, attend, state)` is the head's layer with its
    attention split out (`Eagle3Head`, `MTPModule`). -> (kv, hidden_out `[B, T, H]`)."""
    paged = PagedAttention(run, kv.tokens_per_block)
    out, kv = layer.run_layer(target.embed_tokens(run.tokens), hidden, paged.positions,
                              lambda q, k, v, pool: paged.attend(q, k, v, pool_layer, pool), kv)
    return kv, out


def attend_over_context(kv: KVPool, tables: jax.Array, context_lens: jax.Array,
                        positions: jax.Array, live: jax.Array, bidirectional: bool = False):
    """An `AttendFn` for rows whose K/V stay local (not written to the pool): each query row
    sees pool layer `layer`'s context (positions < `context_lens` `[B]`, through `tables`, as
    narrow as the context allows) and the live rows (`live` `[B, W]`) of its own pass --
    causally on `positions` `[B, W]`, or all of them when `bidirectional`."""
    B, W = positions.shape
    if bidirectional:
        local = jnp.broadcast_to(live[:, None, :], (B, W, W))
    else:
        local = (positions[:, None, :] <= positions[:, :, None]) & live[:, None, :]
    context_lens = jnp.where(live[:, 0], context_lens, 0)

    def attend(q, k, v, layer, state):
        out, _ = merge_attention(
            context_attention(q, kv, layer, tables, positions, context_lens),
            dense_attention(q, k, v, positions, positions, mask=local, with_lse=True))
        return out.astype(q.dtype), state

    return attend
