"""Pallas chain speculative sampling: one program per request, the vocabulary in chunks.

Same contract as `chain_speculative_sampling_reference` (see its docstring). Per request:

1. accept/reject the drafts in order from scalar loads of p and q at the draft ids, with the
   reference's `counter_uniform` (bit-identical uniforms) and the same test `u * q < p`;
2. pass 1 over the vocabulary, `chunk` entries at a time (masked past V): the residual
   max(0, p - q) at the first rejected position (plain p for the bonus), its mass, the mass of
   p (the fallback when the residual has none) and the last positive id of each;
3. pass 2: inverse CDF, `count(cdf <= u * total)` as in the reference, clamped to the last
   positive id; it stops at the first chunk whose running prefix passes the target (every
   later CDF value is larger, so the count is unchanged).

Exactness: uniforms, acceptances, the number accepted, the residual-has-mass test and the
last-positive clamp are bit-identical to the reference. The sampled correction/bonus token is
identical too unless `u * total` falls within float32 rounding of a CDF boundary: the
reference's `jnp.cumsum` and this chunked sum add in different orders, so totals and CDF values
can differ in the last bits. Either token is then a correct draw. The chance per row is
about 2 x (CDF discrepancy, ~1e-7..1e-6) x (number of tokens with non-negligible mass):
negligible for peaked distributions, possibly a few percent for near-flat ones at V = 128k.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # a JAX without the Pallas Triton API: dispatch then runs the references
    plgpu = None

from pallas_kernels.backend import gpu_compiler_params
from pallas_kernels.rejection_sampling.reference import (ACCEPT_STREAM, RESIDUAL_STREAM,
                                                          counter_uniform)

DEFAULT_CHUNK = 1024


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _sampling_kernel(dp_ref, ids_ref, tp_ref, seed_ref, off_ref, dl_ref, out_ref, *,
                     D: int, V: int, C: int, n_chunks: int, W: int):
    b = pl.program_id(0)
    seed = seed_ref[b]
    off = off_ref[b]
    dl = dl_ref[b]

    # 1. Acceptance, draft by draft (D is small and static).
    alive = jnp.bool_(True)
    num_accepted = jnp.int32(0)
    for i in range(D):
        tok = ids_ref[b, i]
        tok = jnp.where(tok < 0, tok + V, tok)  # the reference's gather wraps negative ids once
        in_vocab = (tok >= 0) & (tok < V)      # ... and reads NaN (a rejection) past V
        tok = jnp.clip(tok, 0, V - 1)
        p_at = tp_ref[b, i, tok]
        q_at = dp_ref[b, i, tok]
        u = counter_uniform(seed, off + i, ACCEPT_STREAM)
        accept = (u * q_at < p_at) & in_vocab & (i < dl)
        alive = alive & accept
        num_accepted = num_accepted + alive.astype(jnp.int32)

    row = num_accepted                        # p row: the first rejection or the bonus
    use_q = (num_accepted < dl) & (num_accepted < D)  # a rejection: subtract q
    q_row = jnp.minimum(row, D - 1)
    lanes = jnp.arange(C, dtype=jnp.int32)

    def load(ref, r, start, mask=None):
        valid = lanes + start < V
        if mask is not None:
            valid = valid & mask
        x = plgpu.load(ref.at[b, r, pl.ds(start, C)], mask=valid, other=0)
        return x.astype(jnp.float32)

    # 2. Masses and last positive ids of the residual and of p.
    def pass1(k, carry):
        tot_r, tot_p, last_r, last_p = carry
        start = k * C
        p = load(tp_ref, row, start)
        q = load(dp_ref, q_row, start, use_q)
        res = jnp.maximum(p - q, 0.0)
        ids = lanes + start
        tot_r = tot_r + jnp.sum(res)
        tot_p = tot_p + jnp.sum(p)
        last_r = jnp.maximum(last_r, jnp.max(jnp.where(res > 0, ids, 0)))
        last_p = jnp.maximum(last_p, jnp.max(jnp.where(p > 0, ids, 0)))
        return tot_r, tot_p, last_r, last_p

    zero_f, zero_i = jnp.float32(0.0), jnp.int32(0)
    tot_r, tot_p, last_r, last_p = jax.lax.fori_loop(0, n_chunks, pass1,
                                                     (zero_f, zero_f, zero_i, zero_i))
    has_mass = tot_r > 0  # a sum of non-negative floats is > 0 iff some term is
    total = jnp.where(has_mass, tot_r, tot_p)
    last_positive = jnp.where(has_mass, last_r, last_p)
    target = counter_uniform(seed, off + num_accepted, RESIDUAL_STREAM) * total

    # 3. Inverse CDF: count(cdf <= target), as sample_inverse_cdf does.
    def cond(carry):
        k, prefix, _ = carry
        return (k < n_chunks) & (prefix <= target)

    def pass2(carry):
        k, prefix, count = carry
        start = k * C
        p = load(tp_ref, row, start)
        q = load(dp_ref, q_row, start, use_q & has_mass)
        w = jnp.where(has_mass, jnp.maximum(p - q, 0.0), p)
        cdf = prefix + jnp.cumsum(w)
        hit = (cdf <= target) & (lanes + start < V)
        return k + 1, prefix + jnp.sum(w), count + jnp.sum(hit.astype(jnp.int32))

    _, _, count = jax.lax.while_loop(cond, pass2, (zero_i, zero_f, zero_i))
    last = jnp.minimum(count, last_positive)

    # Output row: D+1 tokens padded with -1, then num_emitted at column D+1.
    j = jnp.arange(W, dtype=jnp.int32)
    drafts = plgpu.load(ids_ref.at[b, pl.ds(0, W)], mask=j < D, other=0)
    tokens = jnp.where(j < num_accepted, drafts, -1)
    tokens = jnp.where(j == num_accepted, last, tokens)
    tokens = jnp.where(j == D + 1, num_accepted + 1, tokens)
    out_ref[...] = tokens.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("interpret", "chunk", "num_warps"))
def _chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, seeds, offsets,
                                draft_lens, *, interpret: bool, chunk: int, num_warps: int):
    B, D, V = draft_probs.shape
    C = min(_next_pow2(chunk), _next_pow2(V))
    W = _next_pow2(D + 2)
    kernel = functools.partial(_sampling_kernel, D=D, V=V, C=C, n_chunks=pl.cdiv(V, C), W=W)
    out = pl.pallas_call(
        kernel,
        grid=(B,),
        out_specs=pl.BlockSpec((None, W), lambda b: (b, 0)),
        out_shape=jax.ShapeDtypeStruct((B, W), jnp.int32),
        interpret=interpret,
        compiler_params=None if interpret else gpu_compiler_params(num_warps=num_warps,
                                                                   num_stages=2),
        name="chain_speculative_sampling",
    )(draft_probs, draft_token_ids.astype(jnp.int32), target_probs, seeds.astype(jnp.uint32),
      offsets.astype(jnp.int32), draft_lens.astype(jnp.int32))
    return out[:, :D + 1], out[:, D + 1]


def chain_speculative_sampling_kernel(
        draft_probs: jax.Array, draft_token_ids: jax.Array, target_probs: jax.Array,
        seeds: jax.Array, offsets: jax.Array, draft_lens: jax.Array | None = None, *,
        interpret: bool | None = None, chunk: int = DEFAULT_CHUNK,
        num_warps: int = 4) -> tuple[jax.Array, jax.Array]:
    """The Pallas kernel; arguments and results as `chain_speculative_sampling_reference`.

    `chunk`: vocabulary entries per loop step (rounded up to a power of two, capped at V's).
    """
    B, D, V = draft_probs.shape
    if target_probs.shape != (B, D + 1, V):
        raise ValueError(f"target_probs {target_probs.shape} should be {(B, D + 1, V)}")
    if draft_token_ids.shape != (B, D):
        raise ValueError(f"draft_token_ids {draft_token_ids.shape} should be {(B, D)}")
    draft_lens = (jnp.full((B,), D, jnp.int32) if draft_lens is None
                  else jnp.asarray(draft_lens))
    if D == 0:  # no drafts: one masked draft slot gives the bonus from p, as the reference does
        tokens, emitted = _chain_speculative_sampling(
            jnp.zeros((B, 1, V), draft_probs.dtype), jnp.zeros((B, 1), jnp.int32),
            target_probs, seeds, offsets, jnp.zeros((B,), jnp.int32),
            interpret=bool(interpret), chunk=chunk, num_warps=num_warps)
        return tokens[:, :1], emitted
    return _chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, seeds,
                                       offsets, draft_lens, interpret=bool(interpret),
                                       chunk=chunk, num_warps=num_warps)
