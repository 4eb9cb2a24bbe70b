"""Pallas paged attention for verify/decode/prefill runs: flash-decoding over the block table.

Same contract as `paged_attention_reference`. Grid (request, kv head, row block, split): the
request's T query tokens times the G query heads sharing a kv head make T*G rows, cut into
blocks of `rows_per_block` (a power of two, 16..128 by default). A program walks
`pages_per_step` pages of the block table at a time, only between the first page the sliding
window lets its rows see and the last page they can see (causal, and below `context_lens`:
never the whole table), gathering those pages' K/V rows for its kv head straight from the pool
at `layer`, and keeps an online softmax (running max, running sum, unnormalised output) in
float32. With `num_splits` > 1 the pages a row block can see (from its context length and
window, not the table's width) are dealt out evenly among that many programs and the partial
results are merged afterwards (log-sum-exp weights: flash-decoding), which keeps a GPU busy
when batch x kv heads is small, whatever the context.
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


def _attention_kernel(q_ref, qpos_ref, tree_ref, k_ref, v_ref, bt_ref, ctx_ref, layer_ref,
                      window_ref, acc_ref, m_ref, l_ref, *, bs: int, P: int, num_splits: int,
                      n_groups: int, scale: float, T: int, G: int, BR: int):
    """q_ref: the queries `[B, T*H, hd]` (a free reshape of `[B, T, H, hd]`); qpos_ref: their
    positions `[B, T]`; tree_ref: the tree bitmasks `[B, T]`, or None (no tree: the plain
    causal kernel). A program finds its own rows in them: everything a step passes in is a
    view of the caller's arrays, so no XLA op runs before the kernel."""
    b, h, rb, s = (pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3))
    KB = P * bs
    H = q_ref.shape[1] // T
    # Row r of this kv head is query token t = r // G, query head h * G + r % G (heads-major,
    # as dense_attention orders them); rows past T * G pad the block and see nothing.
    r = rb * BR + jnp.arange(BR, dtype=jnp.int32)
    real = r < T * G
    t = jnp.minimum(r // G, T - 1)
    q = q_ref[b, t * H + h * G + r % G, :]            # [BR, hd]
    pos = jnp.where(real, qpos_ref[b, t], -1)          # [BR]
    layer = layer_ref[0]
    window = window_ref[0]
    context = ctx_ref[b]
    # Keys in [lo, hi) are all some row of this block may see: hi = min(context, last
    # position + 1) (causal; with a tree: context), lo = first position + 1 - window (with a
    # tree: at most run_start). Pages outside are skipped.
    first_pos = jnp.min(jnp.where(real, pos, jnp.iinfo(jnp.int32).max))
    last_pos = jnp.max(pos)
    if tree_ref is None:
        lo = jnp.maximum(first_pos - window + 1, 0)
        hi = jnp.minimum(context, last_pos + 1)
    else:
        # Tree rows' positions (run_start + depth) are below their slots (run_start + i): the
        # range runs to the context's end, and from no later than the root's slot (run keys
        # get no window test).
        tree_rows = jnp.where(real, tree_ref[b, t], 0)  # [BR] int32 bitmasks
        run_start = qpos_ref[b, 0]
        lo = jnp.maximum(jnp.minimum(first_pos - window + 1, run_start), 0)
        hi = context
    R, hd = q.shape

    # The groups this block's rows can see, [first, last), are dealt out evenly to the
    # `num_splits` programs: the chunk each program reads follows the request's context, not
    # the table's width (a 1k context in a 16k table keeps every split busy).
    first = lo // KB
    last = jnp.maximum(first, jnp.minimum((hi + KB - 1) // KB, n_groups))
    per = (last - first + num_splits - 1) // num_splits
    g_lo = first + s * per
    g_hi = jnp.minimum(g_lo + per, last)

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
    """Query rows (tokens x heads per kv head) per program: a power of two in [16, 128]. Up
    to 128 rows share one read of their kv head's pages (a 16-node tree's 17 tokens x 4 query
    heads = 68 rows: one block, not two reading every page twice)."""
    return min(128, max(16, _next_pow2(rows)))


def default_num_warps(rows_per_block: int) -> int:
    """8 warps for 128-row blocks (their float32 accumulator alone is 128 x hd values: 64
    registers a thread at hd 128 over 8 warps, 128 over 4), else 4."""
    return 8 if rows_per_block >= 128 else 4


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
    S = num_splits
    BR = rows_per_block
    RB = pl.cdiv(T * G, BR)
    R = RB * BR

    # Only views and scalars go in (a reshape of q, the tables as they are when M is a
    # multiple of P): each program finds its rows, their positions and masks itself.
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, n_groups * P - M)))
    window = jnp.asarray(window, jnp.int32).reshape(1)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    kernel = functools.partial(_attention_kernel, bs=bs, P=P, num_splits=S, n_groups=n_groups,
                               scale=hd ** -0.5, T=T, G=G, BR=BR)
    inputs = [q.reshape(B, T * H, hd), q_positions.astype(jnp.int32)]
    if tree:
        body = kernel
        inputs.append(tree_mask.astype(jnp.int32))
    else:
        def body(q_ref, qpos_ref, *refs):
            return kernel(q_ref, qpos_ref, None, *refs)
    inputs += [k_pool, v_pool, tables, context_lens.astype(jnp.int32), layer, window]
    whole = pl.BlockSpec()
    acc, m, l = pl.pallas_call(
        body,
        grid=(B, KV, RB, S),
        in_specs=[whole] * len(inputs),
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
                           rows_per_block: int | None = None, num_warps: int | None = None,
                           num_stages: int = 2) -> jax.Array:
    """The Pallas kernel; arguments and result as `paged_attention_reference`.

    `pages_per_step`: block-table pages per loop step (a power of two; default about 64 keys).
    `num_splits`: programs sharing one (request, kv head, row block)'s pages, each reading
    an equal share of the pages its rows can see (default: enough programs for a GPU when
    compiled, 1 in interpret mode). `rows_per_block`: query rows (tokens x query heads of one
    kv head) per program (a power of two; default 16..128). `num_warps`: default by the
    block's rows (`default_num_warps`).
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
                            num_splits=num_splits, rows_per_block=BR,
                            num_warps=num_warps or default_num_warps(BR),
                            num_stages=num_stages)
