"""What a step does with the target's logits besides sampling them: the bias a request adds
(`logit_bias`) and the log-probabilities it asks for.

Log-probabilities are the target model's own: the log-softmax of its logits, before
temperature, filtering or bias (vLLM's default, "raw" log-probabilities), so a request's
figures depend neither on how it samples nor on speculation -- an emitted token's row of
verification logits is the row plain decoding computes for it. Both are computed under a
batch-wide `cond`: a batch where no row asks pays nothing but the check.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

TOP_LOGPROBS = 20      # top-k width of every log-probability output (the most a request asks)
MAX_LOGIT_BIAS = 300   # (token, bias) entries per row: a fixed-width step input


@struct.dataclass
class Logprobs:
    """Log-probabilities at some positions `[...]` (a step's rows, or rows x run positions)."""

    chosen: jax.Array    # [...] float32: of the token emitted there
    top_ids: jax.Array   # [..., TOP_LOGPROBS] int32, most probable first
    top: jax.Array       # [..., TOP_LOGPROBS] float32


def logprobs_of(logits: jax.Array, chosen: jax.Array) -> Logprobs:
    """logits `[..., V]`, chosen `[...]` token ids -> their `Logprobs`."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen_lp = jnp.take_along_axis(lp, chosen[..., None].astype(jnp.int32), axis=-1)[..., 0]
    top, ids = jax.lax.top_k(lp, min(TOP_LOGPROBS, lp.shape[-1]))
    pad = TOP_LOGPROBS - top.shape[-1]  # a vocabulary smaller than the width (tiny models)
    if pad:
        widths = [(0, 0)] * (top.ndim - 1) + [(0, pad)]
        top = jnp.pad(top, widths, constant_values=-jnp.inf)
        ids = jnp.pad(ids, widths, constant_values=-1)
    return Logprobs(chosen_lp, ids.astype(jnp.int32), top)


def maybe_logprobs(wanted: jax.Array | None, logits_fn, chosen: jax.Array) -> Logprobs | None:
    """`Logprobs` of `chosen` under `logits_fn()` when any row of `wanted` `[B]` asks (else
    zeros of the same shapes); None when the batch has no such field. `logits_fn` is called
    only inside the taken branch, so logits nobody needs are never computed."""
    if wanted is None:
        return None
    shape = chosen.shape

    def zeros() -> Logprobs:
        return Logprobs(jnp.zeros(shape, jnp.float32),
                        jnp.full(shape + (TOP_LOGPROBS,), -1, jnp.int32),
                        jnp.zeros(shape + (TOP_LOGPROBS,), jnp.float32))

    return jax.lax.cond(jnp.any(wanted), lambda: logprobs_of(logits_fn(), chosen), zeros)


def apply_bias(logits: jax.Array, bias_ids: jax.Array | None,
               bias_values: jax.Array | None) -> jax.Array:
    """logits `[B, ..., V]` plus each row's bias: bias_ids `[B, L]` (-1: no entry), values
    `[B, L]`. Batches without any entry skip the scatter."""
    if bias_ids is None:
        return logits
    B, V = logits.shape[0], logits.shape[-1]

    def add():
        ids = jnp.where(bias_ids >= 0, bias_ids, V)  # out of range: dropped
        dense = jnp.zeros((B, V), jnp.float32).at[jnp.arange(B)[:, None], ids].add(
            bias_values, mode="drop")
        dense = dense.reshape((B,) + (1,) * (logits.ndim - 2) + (V,))
        return (logits.astype(jnp.float32) + dense).astype(logits.dtype)

    return jax.lax.cond(jnp.any(bias_ids >= 0), add, lambda: logits)


def mask_bits(mask: jax.Array, tokens: jax.Array) -> jax.Array:
    """Whether packed masks `[..., W]` int32 allow `tokens` `[...]`: bit t % 32 of word t // 32."""
    word = jnp.take_along_axis(mask, (tokens // 32)[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return ((word >> (tokens % 32)) & 1) == 1


def apply_token_mask(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    """logits `[B, R, V]` with the tokens each position's packed mask `[B, R, W]` forbids at
    -inf (structured output). All-ones masks (unconstrained rows) change nothing, and a batch
    of them skips the unpacking."""
    if mask is None:
        return logits
    V = logits.shape[-1]

    def masked():
        bits = (mask[..., :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1   # [B, R, W, 32]
        allowed = bits.reshape(mask.shape[:-1] + (-1,))[..., :V] == 1
        return jnp.where(allowed, logits, -jnp.inf).astype(logits.dtype)

    return jax.lax.cond(jnp.any(mask != -1), masked, lambda: logits)
