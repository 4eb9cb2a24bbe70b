"""Plain-jnp chain speculative sampling: the oracle the Pallas kernel is checked against.

Randomness is counter-based: the uniform for (seed, position, stream) is a hash of those three
integers, computed with uint32 arithmetic that a kernel can run too, so kernel and reference
draw bit-identical uniforms. A request's draws depend only on its own seed and positions, never
on what else is in the batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

ACCEPT_STREAM = 0    # the uniform compared with p/q for the draft at a position
RESIDUAL_STREAM = 1  # the uniform that picks the correction (or bonus) token at a position
# Streams 2 and 3 are the samplers' (`specjax.core.sampling`): a position's target and draft
# draws. A stream is one of STREAMS counters per position, so no two streams ever share one.
STREAMS = 4


def mix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection with full avalanche."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def counter_bits(seeds: jax.Array, positions: jax.Array, stream: int) -> jax.Array:
    """32 random bits (uint32) from (seed, position, stream); shapes broadcast."""
    seeds = jnp.asarray(seeds).astype(jnp.uint32)
    counter = (jnp.asarray(positions).astype(jnp.uint32) * jnp.uint32(STREAMS)
               + jnp.uint32(stream))
    return mix32(mix32(seeds ^ jnp.uint32(0x9E3779B9)) ^ mix32(counter + jnp.uint32(0x7F4A7C15)))


def bits_to_uniform(bits: jax.Array) -> jax.Array:
    """uint32 bits -> float32 uniforms in [0, 1) (their top 24 bits)."""
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def counter_uniform(seeds: jax.Array, positions: jax.Array, stream: int) -> jax.Array:
    """Uniforms in [0, 1) from (seed, position, stream); shapes broadcast. float32."""
    return bits_to_uniform(counter_bits(seeds, positions, stream))


def sample_inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """weights `[..., V]` >= 0 (unnormalised), u `[...]` in [0, 1) -> ids `[...]` int32.

    Never returns a zero-weight id while some weight is positive (rounding in the cumulative
    sum could otherwise step past the last positive entry); all-zero weights give id 0.
    """
    V = weights.shape[-1]
    cdf = jnp.cumsum(weights, axis=-1)
    target = u * cdf[..., -1]
    idx = jnp.sum((cdf <= target[..., None]).astype(jnp.int32), axis=-1)
    last_positive = jnp.max(jnp.where(weights > 0, jnp.arange(V), 0), axis=-1)
    return jnp.minimum(idx, last_positive).astype(jnp.int32)


def chain_speculative_sampling_reference(
        draft_probs: jax.Array, draft_token_ids: jax.Array, target_probs: jax.Array,
        seeds: jax.Array, offsets: jax.Array, draft_lens: jax.Array | None = None, *,
        interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Accept or reject a chain of drafts so that emitted tokens follow the target distribution.

    draft_probs `[B, D, V]` (q: the distributions the drafts were drawn from), draft_token_ids
    `[B, D]`, target_probs `[B, D+1, V]` (p, at the D draft positions and the bonus position),
    seeds `[B]` uint32, offsets `[B]` int32 (the position of draft 0; draft i sits at offset + i),
    draft_lens `[B]` (real drafts per row, default D; padded rows may pass 0).
    Draft i is accepted with probability min(1, p/q) while all before it were; at the first
    rejection the token comes from normalize(max(0, p - q)) (from p if that has no mass); if all
    real drafts are accepted the bonus comes from p at the next position.
    Returns (tokens `[B, D+1]` int32 padded with -1, num_emitted `[B]` = accepted + 1).
    `interpret` is accepted for signature parity with the kernel and ignored.
    """
    del interpret
    B, D, V = draft_probs.shape
    draft_lens = jnp.full((B,), D, jnp.int32) if draft_lens is None else draft_lens
    ids = draft_token_ids.astype(jnp.int32)
    p_at = jnp.take_along_axis(target_probs[:, :D], ids[..., None], axis=-1)[..., 0]  # [B, D]
    q_at = jnp.take_along_axis(draft_probs, ids[..., None], axis=-1)[..., 0]
    positions = offsets[:, None] + jnp.arange(D)
    u = counter_uniform(seeds[:, None], positions, ACCEPT_STREAM)
    # u < p/q without dividing: q = 0 (a draft its own distribution forbids) accepts iff p > 0.
    accept = (u * q_at < p_at) & (jnp.arange(D) < draft_lens[:, None])
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [B]

    p_row = jnp.take_along_axis(target_probs, num_accepted[:, None, None], axis=1)[:, 0]
    q_padded = jnp.concatenate([draft_probs, jnp.zeros((B, 1, V), draft_probs.dtype)], axis=1)
    q_row = jnp.take_along_axis(q_padded, num_accepted[:, None, None], axis=1)[:, 0]
    q_row = jnp.where((num_accepted < draft_lens)[:, None], q_row, 0.0)  # bonus: plain p
    residual = jnp.maximum(p_row.astype(jnp.float32) - q_row.astype(jnp.float32), 0.0)
    has_mass = jnp.sum(residual, axis=-1, keepdims=True) > 0
    residual = jnp.where(has_mass, residual, p_row.astype(jnp.float32))
    u_res = counter_uniform(seeds, offsets + num_accepted, RESIDUAL_STREAM)
    last = sample_inverse_cdf(residual, u_res)

    index = jnp.arange(D + 1)
    drafts = jnp.concatenate([ids, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(index < num_accepted[:, None], drafts, -1)
    tokens = jnp.where(index == num_accepted[:, None], last[:, None], tokens)
    return tokens.astype(jnp.int32), (num_accepted + 1).astype(jnp.int32)
