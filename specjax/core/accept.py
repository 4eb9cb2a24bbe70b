"""Acceptance: pure functions over fixed-shape arrays, used inside the jitted step.

Strict acceptance (every greedy row; sampled rows unless rejection sampling is on): the
target's token at every verified position is drawn with the request's own key for that
position (argmax for greedy rows), exactly as plain decoding would draw it. A draft is
accepted while it equals the target's token, so the emitted sequence is token for token what
plain decoding emits -- greedy or seeded-sampled.

Rejection sampling (sampled rows, when the drafter supplies its distributions): accept draft i
with probability min(1, p/q), correct from max(0, p - q); the output follows the target
distribution and accepts more than strict matching, but not token for token what seeded plain
sampling draws.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.rejection_sampling import chain_speculative_sampling
from specjax.core.sampling import filter_logits, sample, sampling_keys


def target_tokens(logits: jax.Array, positions: jax.Array, temperature: jax.Array,
                  top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                  seeds: jax.Array) -> jax.Array:
    """logits `[B, W, V]` of the rows at `positions` `[B, W]` -> the target's token after each
    row `[B, W]` (each keyed by the position it will occupy: the row's + 1)."""
    B, W, V = logits.shape
    rep = lambda x: jnp.repeat(x, W)
    keys = sampling_keys(rep(seeds), (positions + 1).reshape(-1))
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


def target_distributions(logits: jax.Array, batch) -> jax.Array:
    """logits `[B, W, V]` -> the target's distributions `[B, W, V]` filtered with each row's
    parameters (`filter_logits`), exactly as the draft side's: what rejection sampling
    compares the drafts' distributions with."""
    B, W, V = logits.shape
    rep = lambda x: jnp.repeat(x, W)  # noqa: E731
    filtered = filter_logits(logits.reshape(B * W, V), rep(batch.temperature), rep(batch.top_k),
                             rep(batch.top_p), rep(batch.min_p))
    return jax.nn.softmax(filtered, axis=-1).reshape(B, W, V)


def rejection_accept(logits: jax.Array, batch, drafts: jax.Array, draft_lens: jax.Array,
                     draft_probs: jax.Array, strict_tokens: jax.Array,
                     strict_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling for sampled rows, strict results kept for greedy ones.

    logits `[B, D+1, V]` at the newest token and the D drafts; drafts `[B, D]`; draft_probs
    `[B, D, V]`; strict_tokens `[B, D+1]`, strict_lens `[B]` from `strict_accept`.
    Target probabilities come from `filter_logits` with the request's parameters, exactly as
    the draft side's. Batches without a sampled row never run the kernel.
    """
    B, W, V = logits.shape
    sampled = batch.temperature > 0

    def accept():
        tokens, emitted = chain_speculative_sampling(
            draft_probs, drafts, target_distributions(logits, batch), batch.seeds,
            batch.start_pos + 1, draft_lens)
        return (jnp.where(sampled[:, None], jnp.maximum(tokens, 0), strict_tokens),
                jnp.where(sampled, emitted, strict_lens))

    return jax.lax.cond(jnp.any(sampled), accept, lambda: (strict_tokens, strict_lens))
