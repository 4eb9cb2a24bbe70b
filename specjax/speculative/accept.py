"""Strict acceptance: pure functions over fixed-shape arrays, used inside the jitted step.

The target's token at every verified position is drawn with the request's own key for that
position (argmax for greedy rows), exactly as plain decoding would draw it. A draft is
accepted while it equals the target's token, so the emitted sequence is token for token what
plain decoding emits -- greedy or seeded-sampled.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.engine.sampling import sample, sampling_keys


def target_tokens(logits: jax.Array, start_pos: jax.Array, temperature: jax.Array,
                  top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                  seeds: jax.Array) -> jax.Array:
    """logits `[B, W, V]` at positions start_pos + 0..W-1 -> the target's tokens `[B, W]` for
    positions start_pos + 1..W (each keyed by the position it will occupy)."""
    B, W, V = logits.shape
    rep = lambda x: jnp.repeat(x, W)
    positions = (start_pos[:, None] + 1 + jnp.arange(W)).reshape(-1)
    keys = sampling_keys(rep(seeds), positions)
    tokens = sample(logits.reshape(B * W, V), rep(temperature), rep(top_k), rep(top_p),
                    rep(min_p), keys)
    return tokens.reshape(B, W)


def strict_accept(drafts: jax.Array, draft_lens: jax.Array,
                  targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """drafts `[B, D]`, draft_lens `[B]`, targets `[B, D+1]` ->
    (new_tokens `[B, D+1]`, new_tokens_lens `[B]` = accepted + 1)."""
    D = drafts.shape[1]
    match = (drafts == targets[:, :D]) & (jnp.arange(D) < draft_lens[:, None])
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    return targets, accepted + 1
