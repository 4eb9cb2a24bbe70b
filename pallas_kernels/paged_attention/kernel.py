"""Pallas paged attention for verify/decode/prefill runs: flash-decoding over the block table.

Same contract as `paged_attention_reference`. Grid (request, kv head, row block, split): the
request's T query tokens times the G query heads sharing a kv head make T*G rows, cut into
blocks of `rows_per_block` (a power of two, 16..64 by default). A program walks
`pages_per_step` pages of the block table at a time, only between the first page the sliding
window lets its rows see and the last page they can see (causal, and below `context_lens`:
never the whole table), gathering those pages' K/V rows for its kv head straight from the pool
at `layer`, and keeps an online softmax (running max, running sum, unnormalised output) in
float32. With `num_splits` > 1 the pages are split among programs and the partial results are
merged afterwards (log-sum-exp weights), which keeps a GPU busy when batch x kv heads is small.
Masks: causal on positions, sliding window (`window`, traced or static), keys below the
request's context length; rows that see no key give zeros.

Draft trees (`tree_mask`, see `paged_attention_reference`): a static switch, so the compiled
program without a tree is unchanged. With a tree each row also carries its int32 bitmask of
visible run slots (blocked like the positions) and each request its run start (the root's
position = slot): keys at slots >= run_start are seen by the bits (ancestors and self), keys
before it by the causal/window test. A row block's key range then runs to `context_lens` (tree
rows' positions are below their slots) and starts no later than run_start.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.backend import gpu_compiler_params
from pallas_kernels.paged_attention.reference import NO_WINDOW

_M_INIT = -1e30  # finite, so exp(m_old - m_new) never sees inf - inf
_TARGET_PROGRAMS = 264  # about two per SM on an H100/H200
# float32 pools multiply in float32 (Triton's default for DEFAULT precision is TF32, 10-bit
# mantissas: 1e-3 off the reference, measured on an H200); bfloat16 is unaffected.
_PRECISION = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _attention_kernel(q_ref, pos_ref, tree_ref, k_ref, v_ref, bt_ref, lo_ref, hi_ref, layer_ref,
                      window_ref, rs_ref, acc_ref, m_ref, l_ref, *, bs: int, P: int,
                      groups_per_split: int, n_groups: int, scale: float):
    """tree_ref/rs_ref: the rows' tree bitmasks [BR] and the run starts [B], or None (no
    tree: the plain causal kernel)."""
    b, h, rb, s = (pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3))
    KB = P * bs
    q = q_ref[...]                      # [BR, hd]: this block's query rows
    pos = pos_ref[...]                  # [BR] (padding rows: -1, they see nothing)
    layer = layer_ref[0]
    window = window_ref[0]
    if tree_ref is not None:
        tree_rows = tree_ref[...]       # [BR] int32 bitmasks (padding rows: 0)
        run_start = rs_ref[b]
    # Keys in [lo, hi) are all some row of this block may see: hi = min(context, last
    # position + 1) (causal; with a tree: context), lo = first position + 1 - window (with a
    # tree: at most run_start). Pages outside are skipped.
    lo = lo_ref[b, rb]
    hi = hi_ref[b, rb]
    R, hd = q.shape

    g_lo = jnp.maximum(s * groups_per_split, lo // KB)
    g_hi = jnp.minimum(jnp.minimum((s + 1) * groups_per_split, n_groups), (hi + KB - 1) // KB)

    def body(g, carry):
        acc, m, l = carry
        pages = bt_ref[b, pl.ds(g * P, P)]                     # [P]
        k = k_ref[layer, pages, h, :, :].reshape(KB, hd)      # [KB, hd]
        v = v_ref[layer, pages, h, :, :].reshape(KB, hd)
        dt = jnp.result_type(q.dtype, k.dtype)
        scores = jax.lax.dot_general(q.astype(dt), k.astype(dt), (((1,), (1,)), ((), ())),
                                     precision=_PRECISION,
                                     preferred_element_type=jnp.float32) * scale  # [R, KB]
        kpos = g * KB + jnp.arange(KB, dtype=jnp.int32)
        # Keys a step loads but no row may see (past the context: stale rows, padding
        # entries' null block; before the window) are masked, and their V rows zeroed so
        # that whatever those rows hold (even NaN) cannot reach the output through 0 * v.
        key_ok = (kpos >= lo) & (kpos < hi)
        v = jnp.where(key_ok[:, None], v, jnp.zeros_like(v))
        dist = pos[:, None] - kpos[None, :]
        if tree_ref is None:
            mask = (dist >= 0) & (dist < window) & key_ok[None, :]
        else:
            # Run slots (j >= 0): the row's bit j (ancestors and self, j < 32); context slots:
            # causal and window on positions.
            j = kpos - run_start
            bit = (tree_rows[:, None] >> jnp.clip(j, 0, 31)[None, :]) & 1
            in_tree = (bit == 1) & (j < 32)[None, :]
            mask = (jnp.where((j >= 0)[None, :], in_tree, (dist >= 0) & (dist < window))
                    & key_ok[None, :])
        scores = jnp.where(mask, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(scores - m_new[:, None])                   # masked: exp(-inf) = 0
        l = alpha * l + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=_PRECISION, preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_new, l

    init = (jnp.zeros((R, hd), jnp.float32), jnp.full((R,), _M_INIT, jnp.float32),
            jnp.zeros((R,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(g_lo, jnp.maximum(g_lo, g_hi), body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def default_pages_per_step(tokens_per_block: int, max_blocks: int) -> int:
    """Pages gathered per loop step: about 64 keys, at least 16 (the smallest GPU dot)."""
    return max(1, min(64 // tokens_per_block, _next_pow2(max_blocks)))


def default_rows_per_block(rows: int) -> int:
    """Query rows (tokens x heads per kv head) per program: a power of two in [16, 64]."""
    return min(64, max(16, _next_pow2(rows)))


def compiled_supported(q_shape, pool_shape, pages_per_step: int | None = None) -> bool:
    """Whether the compiled (Triton) kernel handles these static shapes."""
    _, _, H, hd = q_shape
    _, _, KV, bs, hd_pool = pool_shape
    P = pages_per_step or default_pages_per_step(bs, 1 << 30)
    return (hd == hd_pool and H % KV == 0 and _is_pow2(bs) and _is_pow2(hd) and hd >= 16
            and _is_pow2(P) and P * bs >= 16)


@functools.partial(jax.jit, static_argnames=("tree", "interpret", "pages_per_step", "num_splits",
                                             "rows_per_block", "num_warps", "num_stages"))
def _paged_attention(q, k_pool, v_pool, layer, block_tables, q_positions, context_lens,
                     window, tree_mask, *, tree: bool, interpret: bool, pages_per_step: int,
                     num_splits: int, rows_per_block: int, num_warps: int, num_stages: int):
    """tree: whether `tree_mask` is given (static: without a tree the program is the plain
    causal one, `tree_mask` unused)."""
    B, T, H, hd = q.shape
    _, _, KV, bs, _ = k_pool.shape
    G = H // KV
    M = block_tables.shape[1]
    P = pages_per_step
    n_groups = pl.cdiv(M, P)
    groups_per_split = pl.cdiv(n_groups, num_splits)
    S = pl.cdiv(n_groups, groups_per_split)
    BR = rows_per_block
    RB = pl.cdiv(T * G, BR)
    R = RB * BR

    # Heads-major rows t*G + g per kv head, as dense_attention orders them.
    qh = q.reshape(B, T, KV, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, KV, T * G, hd)
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, R - T * G), (0, 0)))
    pos = jnp.repeat(q_positions.astype(jnp.int32), G, axis=1)
    pos = jnp.pad(pos, ((0, 0), (0, R - T * G)), constant_values=-1)
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, n_groups * P - M)))
    window = jnp.asarray(window, jnp.int32).reshape(1)
    # Per row block: the key positions [lo, hi) any of its rows can see.
    real = (jnp.arange(R) < T * G).reshape(RB, BR)
    blocks = pos.reshape(B, RB, BR)
    first = jnp.min(jnp.where(real, blocks, jnp.iinfo(jnp.int32).max), axis=2)
    last = jnp.max(jnp.where(real, blocks, -1), axis=2)
    if not tree:
        lo = jnp.maximum(first - window[0] + 1, 0)
        hi = jnp.minimum(context_lens.astype(jnp.int32)[:, None], last + 1)
    else:
        # Tree rows' positions (run_start + depth) are below their slots (run_start + i): the
        # range runs to the context's end, and from no later than the root's slot (run keys
        # get no window test).
        run_start = q_positions[:, 0].astype(jnp.int32)
        lo = jnp.maximum(jnp.minimum(first - window[0] + 1, run_start[:, None]), 0)
        hi = jnp.broadcast_to(context_lens.astype(jnp.int32)[:, None], (B, RB))
        tree_rows = jnp.repeat(tree_mask.astype(jnp.int32), G, axis=1)
        tree_rows = jnp.pad(tree_rows, ((0, 0), (0, R - T * G)))
    layer = jnp.asarray(layer, jnp.int32).reshape(1)

    kernel = functools.partial(_attention_kernel, bs=bs, P=P, groups_per_split=groups_per_split,
                               n_groups=n_groups, scale=hd ** -0.5)
    whole = pl.BlockSpec()
    rows_spec = pl.BlockSpec((None, BR), lambda b, h, r, s: (b, r))
    if tree:
        body = kernel
        inputs = (qh, pos, tree_rows, k_pool, v_pool, tables, lo, hi, layer, window, run_start)
        extra_specs = [rows_spec]
    else:
        def body(q_ref, pos_ref, *refs):
            return kernel(q_ref, pos_ref, None, *refs[:7], None, *refs[7:])
        inputs = (qh, pos, k_pool, v_pool, tables, lo, hi, layer, window)
        extra_specs = []
    acc, m, l = pl.pallas_call(
        body,
        grid=(B, KV, RB, S),
        in_specs=[pl.BlockSpec((None, None, BR, hd), lambda b, h, r, s: (b, h, r, 0)),
                  rows_spec, *extra_specs, whole, whole, whole, whole, whole, whole, whole,
                  *([whole] if tree else [])],
        out_specs=[pl.BlockSpec((None, None, None, BR, hd), lambda b, h, r, s: (b, h, s, r, 0)),
                   pl.BlockSpec((None, None, None, BR), lambda b, h, r, s: (b, h, s, r)),
                   pl.BlockSpec((None, None, None, BR), lambda b, h, r, s: (b, h, s, r))],
        out_shape=[jax.ShapeDtypeStruct((B, KV, S, R, hd), jnp.float32),
                   jax.ShapeDtypeStruct((B, KV, S, R), jnp.float32),
                   jax.ShapeDtypeStruct((B, KV, S, R), jnp.float32)],
        interpret=interpret,
        compiler_params=None if interpret else gpu_compiler_params(num_warps, num_stages),
        name="paged_attention",
    )(*inputs)

    # Merge the splits: weights exp(m_s - max m); rows that saw nothing have l = 0 -> zeros.
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)
    l_all = jnp.sum(w * l, axis=2)
    out = jnp.sum(w[..., None] * acc, axis=2) / jnp.maximum(l_all, 1e-30)[..., None]
    out = out[:, :, :T * G].reshape(B, KV, T, G, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, H, hd).astype(v_pool.dtype)


def paged_attention_kernel(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           layer: jax.Array | int, block_tables: jax.Array,
                           q_positions: jax.Array, context_lens: jax.Array,
                           window: jax.Array | int = NO_WINDOW,
                           tree_mask: jax.Array | None = None, *, interpret: bool | None = None,
                           pages_per_step: int | None = None, num_splits: int | None = None,
                           rows_per_block: int | None = None, num_warps: int = 4,
                           num_stages: int = 2) -> jax.Array:
    """The Pallas kernel; arguments and result as `paged_attention_reference`.

    `pages_per_step`: block-table pages per loop step (a power of two; default about 64 keys).
    `num_splits`: programs sharing one (request, kv head, row block)'s pages (default: enough
    programs for a GPU when compiled, 1 in interpret mode). `rows_per_block`: query rows
    (tokens x query heads of one kv head) per program (a power of two; default 16..64).
    `tree_mask`: the draft-tree mask (see the reference); None compiles the plain causal kernel.
    """
    B, T, H, hd = q.shape
    _, _, KV, bs, hd_pool = k_pool.shape
    if hd != hd_pool or H % KV:
        raise ValueError(f"q {q.shape} does not fit pools {k_pool.shape}")
    M = block_tables.shape[1]
    if B == 0 or T == 0 or M == 0:
        return jnp.zeros(q.shape, v_pool.dtype)
    P = pages_per_step or default_pages_per_step(bs, M)
    BR = rows_per_block or default_rows_per_block(T * (H // KV))
    if not (_is_pow2(P) and _is_pow2(BR)):
        raise ValueError(f"pages_per_step ({P}) and rows_per_block ({BR}) must be powers of 2")
    if num_splits is None:
        programs = B * KV * pl.cdiv(T * (H // KV), BR)
        num_splits = 1 if interpret else max(1, _TARGET_PROGRAMS // programs)
    num_splits = max(1, min(num_splits, pl.cdiv(M, P)))
    return _paged_attention(q, k_pool, v_pool, layer, block_tables, q_positions, context_lens,
                            window, tree_mask, tree=tree_mask is not None,
                            interpret=bool(interpret), pages_per_step=P,
                            num_splits=num_splits, rows_per_block=BR, num_warps=num_warps,
                            num_stages=num_stages)
