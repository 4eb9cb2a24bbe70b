#!/usr/bin/env python
"""Check every Pallas kernel compiled on the GPU against its jnp reference, then measure the
GPU at real shapes: the attention kernel against its bytes, the engine at Llama-3.2-1B and
Llama-3.1-8B shapes (random bfloat16 weights made on the device: no download), and XLA's
command-buffer (CUDA graph) options. One prepared run, about 8-10 minutes on an H200:

    python scripts/gpu_check.py                      # every default section, in this order:
        checks     kernel == reference (small shapes; exit 1 if any fails)
        attention  the paged-attention kernel alone at 1k / 4k / 16k contexts, batch 1 and 8,
                   T = 1, 5 and a 1 + 16-node tree: us per call (20 calls chained in one
                   program: no host in between) and GB/s of K/V read against the copy
                   bandwidth; the jnp reference at 4k beside it
        8b         `python -m specjax.bench shapes --shape llama-3.1-8b`: the decode step at
                   batch 1 / 8 / 32 against the HBM floor, t(1 + T)/t(1) for T = 1..8 and a
                   16-node tree, speculation at AL = 3 (oracle drafts through a random EAGLE-3
                   head) against plain decoding
        1b         the same at the Llama-3.2-1B shape (decode and verify)
        flags      `python -m specjax.bench xla --shape llama-3.2-1b`: XLA's command-buffer
                   options (child processes), with greedy output checked against the defaults'
    python scripts/gpu_check.py --sections checks,attention    # a subset
    python scripts/gpu_check.py --sections kernels --quick     # the older kernel-vs-reference
                                                               # timing table (all kernels)
    python scripts/gpu_check.py --tiny               # CPU dry run of every section: kernels in
                                                     # interpret mode, tiny shapes

Without a GPU (and without --interpret / --tiny) it prints "no GPU" and exits 0. Exit status 1
and a "FAILED" list when any check or section fails (a wrong result, or a kernel that does not
lower/compile); a failing section does not stop the others.

Checks (small shapes): kernel == reference exactly for the sampling kernel (tokens and counts;
at V = 32k the correction/bonus token may differ only where u * total lies within float32
rounding of a CDF boundary, verified against a float64 CDF) and for the KV relocation/gather
kernels; allclose for paged attention (float32 against a HIGHEST-precision reference, and
bfloat16), causal runs and draft trees (`tree_mask`).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specjax  # noqa: E402,F401 - its XLA flags (specjax/xla_flags.py) before JAX starts
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import backend  # noqa: E402
from pallas_kernels.ssm_scan import ssm_scan_kernel, ssm_scan_reference  # noqa: E402
from pallas_kernels.kv_gather import (gather_kv_pages_kernel, gather_kv_pages_reference,  # noqa: E402
                                      relocate_kv_kernel, relocate_kv_reference)
from pallas_kernels.paged_attention import (NO_WINDOW, paged_attention_kernel,  # noqa: E402
                                            paged_attention_reference)
from pallas_kernels.paged_attention.kernel import compiled_supported  # noqa: E402
from pallas_kernels.rejection_sampling import (chain_speculative_sampling_kernel,  # noqa: E402
                                               chain_speculative_sampling_reference,
                                               counter_uniform)
from pallas_kernels.rejection_sampling.reference import RESIDUAL_STREAM  # noqa: E402

INTERPRET = False  # set by --interpret


class CheckFailed(AssertionError):
    pass


def check(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


# --- inputs ----------------------------------------------------------------------------------

def softmax_probs(key, shape, scale=3.0, dtype=jnp.float32):
    return jax.nn.softmax(jax.random.normal(key, shape) * scale, axis=-1).astype(dtype)


def sampling_inputs(B, D, V, seed=0, scale=3.0, dtype=jnp.float32, ragged=True):
    k = jax.random.split(jax.random.key(seed), 6)
    q = softmax_probs(k[0], (B, D, V), scale, dtype)
    p = softmax_probs(k[1], (B, D + 1, V), scale, dtype)
    drafts = jax.random.categorical(k[2], jnp.log(q.astype(jnp.float32) + 1e-30)).astype(jnp.int32)
    seeds = jax.random.bits(k[3], (B,), jnp.uint32)
    offsets = jax.random.randint(k[4], (B,), 0, 100_000, jnp.int32)
    lens = (jax.random.randint(k[5], (B,), 0, D + 1, jnp.int32) if ragged
            else jnp.full((B,), D, jnp.int32))
    return q, drafts, p, seeds, offsets, lens


def attention_inputs(B, T, H, KV, hd, bs, ctx_lens, M, dtype, seed=0, layers=2):
    """Pages for each row's context scattered over a pool with a NaN null block; positions of
    the run are the last T of each context (T = 1: decode, T > 1: verify)."""
    rng = np.random.default_rng(seed)
    need = [-(-c // bs) for c in ctx_lens]
    N = sum(need) + 1
    pool_shape = (layers, N, KV, bs, hd)
    k_pool = rng.standard_normal(pool_shape, np.float32)
    v_pool = rng.standard_normal(pool_shape, np.float32)
    k_pool[:, 0] = np.nan
    v_pool[:, 0] = np.nan
    tables = np.zeros((B, M), np.int32)
    perm = list(rng.permutation(np.arange(1, N)))
    for b in range(B):
        for j in range(need[b]):
            tables[b, j] = perm.pop()
    ctx = np.asarray(ctx_lens, np.int32)
    positions = np.maximum(ctx[:, None] - T + np.arange(T), 0).astype(np.int32)
    q = rng.standard_normal((B, T, H, hd), np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k_pool, dtype), jnp.asarray(v_pool, dtype),
            jnp.asarray(tables), jnp.asarray(positions), jnp.asarray(ctx))


def tree_attention_inputs(B, T, H, KV, hd, bs, ctx_lens, M, dtype, seed=0, layers=2):
    """`attention_inputs` with each request's last T slots a random draft tree (root + T - 1
    nodes, parent < child): positions run_start + depth, int32 ancestor-or-self bitmasks.
    Requests with a context shorter than T get mask 0 (padding). Returns the six arrays and
    the tree masks [B, T]."""
    q, k, v, tables, _, ctx = attention_inputs(B, T, H, KV, hd, bs, ctx_lens, M, dtype,
                                               seed, layers)
    rng = np.random.default_rng(seed + 100)
    positions = np.zeros((B, T), np.int32)
    masks = np.zeros((B, T), np.int32)
    for b, c in enumerate(ctx_lens):
        if c >= T:
            positions[b], masks[b] = random_tree_rows(T, c, rng)
    return (q, k, v, tables, jnp.asarray(positions), ctx), jnp.asarray(masks)


# --- correctness -----------------------------------------------------------------------------

def _near_boundary(p_row, q_row, use_q, u, tok_a, tok_b, rel_tol=1e-4) -> bool:
    """Both tokens sit at the inverse-CDF boundary the float64 CDF puts u * total at."""
    p_row = p_row.astype(np.float64)
    w = np.maximum(p_row - q_row.astype(np.float64), 0) if use_q else p_row
    if w.sum() <= 0:
        w = p_row
    cdf = np.cumsum(w)
    target = u * cdf[-1]
    lo, hi = sorted((int(tok_a), int(tok_b)))
    # Everything strictly between the two tokens' intervals must be within rel_tol of target.
    start = cdf[lo - 1] if lo > 0 else 0.0
    return (w[lo] > 0 and w[hi] > 0 and abs(cdf[lo] - target) <= rel_tol * cdf[-1]
            and abs(cdf[hi - 1] - target) <= rel_tol * cdf[-1]
            and start <= target + rel_tol * cdf[-1])


def compare_sampling(args, exact: bool, chunk: int | None = None) -> str:
    kw = {} if chunk is None else {"chunk": chunk}
    tok_k, em_k = jax.jit(lambda *a: chain_speculative_sampling_kernel(
        *a, interpret=INTERPRET, **kw))(*args)
    tok_r, em_r = jax.jit(chain_speculative_sampling_reference)(*args)
    tok_k, em_k, tok_r, em_r = map(np.asarray, (tok_k, em_k, tok_r, em_r))
    check(np.array_equal(em_k, em_r), f"num_emitted differs in {np.sum(em_k != em_r)} rows")
    diff = np.nonzero(np.any(tok_k != tok_r, axis=1))[0]
    if exact:
        check(len(diff) == 0, f"tokens differ in rows {diff[:10].tolist()}")
        return "exact"
    q, drafts, p, seeds, offsets, lens = map(np.asarray, args)
    for b in diff:
        n = em_r[b]
        check(np.array_equal(tok_k[b, :n - 1], tok_r[b, :n - 1])
              and np.array_equal(tok_k[b, n:], tok_r[b, n:]),
              f"row {b}: tokens differ before the last emitted one")
        u = float(counter_uniform(seeds[b], offsets[b] + n - 1, RESIDUAL_STREAM))
        use_q = n - 1 < lens[b]
        q_row = q[b, min(n - 1, q.shape[1] - 1)]
        check(_near_boundary(p[b, n - 1], q_row, use_q, u, tok_k[b, n - 1], tok_r[b, n - 1]),
              f"row {b}: last tokens {tok_k[b, n - 1]} vs {tok_r[b, n - 1]} are not a "
              "float-rounding tie at a CDF boundary")
    return f"{len(diff)}/{len(tok_k)} rows differ only at a CDF-boundary tie"


def check_sampling_small():
    B, D, V = 64, 4, 40
    args = list(sampling_inputs(B, D, V, seed=1))
    # q = 2p in row 0 (zero-mass residual); draft out of vocabulary in row 1.
    args[0] = args[0].at[0].set(2 * args[2][0, :D])
    args[1] = args[1].at[1, 0].set(V + 3)
    return compare_sampling(tuple(args), exact=True, chunk=16)


def check_sampling_peaked():
    return compare_sampling(sampling_inputs(32, 5, 1000, seed=2, scale=8.0), exact=True)


def check_sampling_no_drafts():
    B, V = 8, 500
    args = (jnp.zeros((B, 0, V)), jnp.zeros((B, 0), jnp.int32),
            softmax_probs(jax.random.key(3), (B, 1, V)), jnp.arange(B, dtype=jnp.uint32),
            jnp.arange(B, dtype=jnp.int32))
    return compare_sampling(args, exact=True)


def check_sampling_vocab_32k_bf16():
    return compare_sampling(sampling_inputs(16, 5, 32_000, seed=4, dtype=jnp.bfloat16),
                            exact=False)


def _attention(args, window, dtype, tree_mask=None, **kw):
    q, k, v, tables, positions, ctx = args
    out = jax.jit(lambda *a: paged_attention_kernel(*a, interpret=INTERPRET, **kw))(
        q, k, v, 1, tables, positions, ctx, window, tree_mask)
    # The reference gathers every table entry (the NaN null block included): give it a clean
    # pool, and float32 products at full precision (XLA's GPU default may use TF32).
    k_clean, v_clean = k.at[:, 0].set(0), v.at[:, 0].set(0)
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(paged_attention_reference)(q, k_clean, v_clean, 1, tables, positions,
                                                  ctx, window, tree_mask)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    check(np.all(np.isfinite(out)), "non-finite output (read the null block or a NaN page?)")
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    err = float(np.max(np.abs(out - ref)))
    check(err <= tol * max(1.0, float(np.max(np.abs(ref)))), f"max |kernel - ref| = {err:.3g}")
    zero_rows = np.asarray(ctx) == 0
    check(np.all(out[zero_rows] == 0), "context_len 0 rows are not zero")
    return f"max err {err:.2e}"


def check_attention(dtype, window):
    ctx = [37, 100, 0, 16, 65, 1]
    hd = 64 if not INTERPRET else 16
    args = attention_inputs(len(ctx), 7, 8, 2, hd, 16, ctx, M=9, dtype=dtype)
    if not INTERPRET:
        check(compiled_supported(args[0].shape, args[1].shape), "shapes unexpectedly unsupported")
    res = [_attention(args, window, dtype),
           _attention(args, window, dtype, pages_per_step=1, num_splits=3, rows_per_block=16)]
    return "; ".join(res)


def check_attention_tree(dtype, window):
    """Verify of a 1 + 16-node draft tree per request (contexts of a few hundred tokens, a
    tree-only request, a padded request)."""
    ctx = [300, 17, 0, 450, 129]
    hd = 64 if not INTERPRET else 16
    args, tree = tree_attention_inputs(len(ctx), 17, 8, 2, hd, 16, ctx, M=32, dtype=dtype)
    if not INTERPRET:
        check(compiled_supported(args[0].shape, args[1].shape), "shapes unexpectedly unsupported")
    res = [_attention(args, window, dtype, tree),
           _attention(args, window, dtype, tree, pages_per_step=1, num_splits=3,
                      rows_per_block=16)]
    return "; ".join(res)


def check_relocate():
    L, N, KV, bs, hd = 3, 9, 2, 16, 64
    rng = np.random.default_rng(5)
    k = rng.standard_normal((L, N, KV, bs, hd), np.float32)
    v = rng.standard_normal((L, N, KV, bs, hd), np.float32)
    # Row 0: a chain inside block 1; row 1: a cycle in block 2; row 2: nothing (garbage).
    sb = np.array([[1, 1, 3, 0], [2, 2, 2, 0], [-4, 99, 1, 1]], np.int32)
    so = np.array([[5, 6, 0, 0], [0, 1, 2, 0], [0, 77, 0, 0]], np.int32)
    db = np.array([[1, 1, 1, 0], [2, 2, 2, 0], [99, -1, 1, 1]], np.int32)
    do = np.array([[4, 5, 6, 0], [1, 2, 0, 0], [0, 0, 0, 0]], np.int32)
    n = np.array([3, 3, 0], np.int32)
    f = jax.jit(lambda *a: relocate_kv_kernel(*a, interpret=INTERPRET), donate_argnums=(0, 1))
    out = f(jnp.asarray(k), jnp.asarray(v), sb, so, db, do, n)
    ref = relocate_kv_reference(jnp.asarray(k), jnp.asarray(v), sb, so, db, do, n)
    for o, r in zip(out, ref):
        check(np.array_equal(np.asarray(o), np.asarray(r)), "relocated pools differ")
    check(np.array_equal(np.asarray(out[0])[:, 1, :, 4], k[:, 1, :, 5]), "chain move missing")
    return "exact (donated, in place)"


def check_gather():
    rng = np.random.default_rng(6)
    pool = jnp.asarray(rng.standard_normal((2, 9, 3, 16, 40), np.float32), jnp.bfloat16)
    tables = jnp.asarray([[1, 4, 0], [8, 2, 3]], jnp.int32)
    out = jax.jit(lambda *a: gather_kv_pages_kernel(*a, interpret=INTERPRET))(pool, 1, tables)
    check(np.array_equal(np.asarray(out, np.float32),
                         np.asarray(gather_kv_pages_reference(pool, 1, tables), np.float32)),
          "gathered pages differ")
    return "exact"


def ssm_inputs(B, T, H, P, G, N, seed=9, decay=1.0):
    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (B, T, H, P))
    dt = jax.nn.softplus(jax.random.normal(keys[1], (B, T, H)) - 1.0)
    A = -decay * jnp.exp(jax.random.uniform(keys[2], (H,), minval=-1.0, maxval=1.0))
    b = jax.random.normal(keys[3], (B, T, G, N))
    c = jax.random.normal(keys[4], (B, T, G, N))
    h0 = jax.random.normal(keys[5], (B, H, P, N))
    return x, dt, A, b, c, h0


def check_ssm_scan(T, decay):
    args = ssm_inputs(2, T, 8, 64, 2, 128, decay=decay)
    y, h = jax.jit(lambda *a: ssm_scan_kernel(*a, interpret=INTERPRET))(*args)
    y_ref, h_ref = jax.jit(ssm_scan_reference)(*args)
    err = max(float(jnp.max(jnp.abs(y - y_ref))), float(jnp.max(jnp.abs(h - h_ref))))
    scale = max(float(jnp.max(jnp.abs(y_ref))), float(jnp.max(jnp.abs(h_ref))))
    check(err <= 1e-4 * max(scale, 1.0), f"ssm_scan differs by {err:.2e} (scale {scale:.1f})")
    return f"max |diff| {err:.1e}"


CHECKS = [
    ("sampling V=40 ragged, chunked", check_sampling_small),
    ("sampling V=1000 peaked", check_sampling_peaked),
    ("sampling D=0", check_sampling_no_drafts),
    ("sampling V=32k bf16", check_sampling_vocab_32k_bf16),
    ("attention f32 no window", lambda: check_attention(jnp.float32, NO_WINDOW)),
    ("attention f32 window 20", lambda: check_attention(jnp.float32, 20)),
    ("attention bf16 window 50", lambda: check_attention(jnp.bfloat16, 50)),
    ("attention tree f32 no window", lambda: check_attention_tree(jnp.float32, NO_WINDOW)),
    ("attention tree f32 window 100", lambda: check_attention_tree(jnp.float32, 100)),
    ("attention tree bf16 window 100", lambda: check_attention_tree(jnp.bfloat16, 100)),
    ("relocate_kv", check_relocate),
    ("gather_kv_pages", check_gather),
    ("ssm_scan T=300 (chunks + tail)", lambda: check_ssm_scan(300, 1.0)),
    ("ssm_scan T=5 strong decay", lambda: check_ssm_scan(5, 8.0)),
]


# --- timing ----------------------------------------------------------------------------------

def median_us(fn, args, iters, feed_back=False):
    """(compile+first call s, median µs per call). feed_back: outputs replace the first
    len(outputs) args (donated pools)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        if feed_back:
            args = tuple(out) + tuple(args[len(out):])
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times) * 1e6


def timing_cases(quick: bool):
    cases = []
    Bs, Ds = ((1, 64), (4,)) if quick else ((1, 8, 64), (4, 8))
    Vs = (32_000, 128_256)
    for V in Vs:
        for D in Ds:
            for B in Bs:
                cases.append(("sampling", f"B={B} D={D} V={V}", dict(B=B, D=D, V=V)))
    att = (((1, 8), (32, 8)) if quick
           else ((1, 1), (1, 8), (8, 1), (8, 8), (32, 1), (32, 8), (4, 256)))
    for B, T in att:
        cases.append(("attention", f"B={B} T={T} ctx=4096 H=32 KV=8 hd=128 bf16",
                      dict(B=B, T=T)))
    for B in (1, 8, 32):  # verify of a root + 16-node draft tree
        cases.append(("attention tree", f"B={B} T=17 ctx=4096 H=32 KV=8 hd=128 bf16",
                      dict(B=B, T=17)))
    cases.append(("relocate_kv", "L=32 B=64 R=8 KV=8 hd=128 bf16", dict(B=64, R=8)))
    cases.append(("gather_kv_pages", "B=32 ctx=4096 KV=8 hd=128 bf16", dict(B=32, ctx=4096)))
    for B, T in ((1, 2048), (8, 512)):  # a prompt chunk of Bamba-9B's mixer (H=128 P=64 N=128)
        cases.append(("ssm_scan", f"B={B} T={T} H=128 P=64 G=1 N=128 f32", dict(B=B, T=T)))
    return cases


def time_case(kind, params, iters):
    if kind == "sampling":
        args = sampling_inputs(params["B"], params["D"], params["V"], ragged=False)
        kern = jax.jit(lambda *a: chain_speculative_sampling_kernel(*a, interpret=INTERPRET))
        ref = jax.jit(chain_speculative_sampling_reference)
        return median_us(kern, args, iters), median_us(ref, args, iters)
    if kind in ("attention", "attention tree"):
        B, T = params["B"], params["T"]
        shape = (B, T, 32, 8, 128, 16, [4096] * B)
        if kind == "attention":
            args = attention_inputs(*shape, M=256, dtype=jnp.bfloat16, layers=1)
            tree = None
        else:
            args, tree = tree_attention_inputs(*shape, M=256, dtype=jnp.bfloat16, layers=1)
        args = (args[0], args[1].at[:, 0].set(0), args[2].at[:, 0].set(0)) + args[3:]
        q, k, v, tables, pos, ctx = args
        kern = jax.jit(lambda *a: paged_attention_kernel(*a, interpret=INTERPRET))
        ref = jax.jit(paged_attention_reference)
        a = (q, k, v, 0, tables, pos, ctx, NO_WINDOW, tree)
        return median_us(kern, a, iters), median_us(ref, a, iters)
    if kind == "relocate_kv":
        B, R, L, N = params["B"], params["R"], 32, 1024
        shape = (L, N, 8, 16, 128)
        rng = np.random.default_rng(7)
        idx = [jnp.asarray(rng.integers(1, hi, (B, R)), jnp.int32) for hi in (N, 16, N, 16)]
        n = jnp.full((B,), R, jnp.int32)
        res = []
        for fn in (lambda *a: relocate_kv_kernel(*a, interpret=INTERPRET), relocate_kv_reference):
            pools = (jnp.zeros(shape, jnp.bfloat16), jnp.ones(shape, jnp.bfloat16))
            res.append(median_us(jax.jit(fn, donate_argnums=(0, 1)), pools + tuple(idx) + (n,),
                                 iters, feed_back=True))
            del pools
        return tuple(res)
    if kind == "gather_kv_pages":
        B, M = params["B"], params["ctx"] // 16
        pool = jnp.ones((4, B * M + 1, 8, 16, 128), jnp.bfloat16)
        tables = jnp.asarray(np.random.default_rng(8).permutation(B * M).reshape(B, M) + 1,
                             jnp.int32)
        kern = jax.jit(lambda *a: gather_kv_pages_kernel(*a, interpret=INTERPRET))
        ref = jax.jit(gather_kv_pages_reference)
        return (median_us(kern, (pool, 2, tables), iters),
                median_us(ref, (pool, 2, tables), iters))
    if kind == "ssm_scan":
        args = ssm_inputs(params["B"], params["T"], 128, 64, 1, 128)
        kern = jax.jit(lambda *a: ssm_scan_kernel(*a, interpret=INTERPRET))
        return median_us(kern, args, iters), median_us(jax.jit(ssm_scan_reference), args, iters)
    raise ValueError(kind)


# --- the attention kernel alone at real shapes ------------------------------------------------

def random_tree_rows(T, ctx, rng):
    """One request's last T slots as a random draft tree (root + T - 1 nodes, parent < child):
    (positions [T] = run_start + depth, int32 ancestor-or-self bitmasks [T])."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, T)]
    depth = [0] * T
    masks = np.zeros(T, np.uint32)
    for i in range(1, T):
        depth[i] = depth[parents[i]] + 1
        masks[i] = masks[parents[i]]
    masks |= (np.uint32(1) << np.arange(T, dtype=np.uint32))
    return (ctx - T + np.asarray(depth)).astype(np.int32), masks.view(np.int32)


def device_attention_inputs(B, T, ctx, M, H, KV, hd, bs, tree, dtype=jnp.bfloat16, seed=0):
    """Pools made on the device (one layer), each request's ctx tokens on scattered pages of a
    table M pages wide; the run is the last T positions (a random tree when `tree`)."""
    pages = -(-ctx // bs)
    N = B * pages + 1
    keys = jax.random.split(jax.random.key(seed), 3)
    k_pool = jax.random.normal(keys[0], (1, N, KV, bs, hd), dtype)
    v_pool = jax.random.normal(keys[1], (1, N, KV, bs, hd), dtype)
    q = jax.random.normal(keys[2], (B, T, H, hd), dtype)
    rng = np.random.default_rng(seed)
    tables = np.zeros((B, M), np.int32)
    tables[:, :pages] = rng.permutation(np.arange(1, N)).reshape(B, pages)
    if tree:
        rows = [random_tree_rows(T, ctx, rng) for _ in range(B)]
        positions = np.stack([r[0] for r in rows])
        masks = jnp.asarray(np.stack([r[1] for r in rows]))
    else:
        positions = np.broadcast_to(ctx - T + np.arange(T, dtype=np.int32), (B, T))
        masks = None
    return (q, k_pool, v_pool, jnp.asarray(tables), jnp.asarray(positions),
            jnp.full((B,), ctx, jnp.int32), masks)


def chained_us(fn, q, rest, n):
    """Microseconds per call of `fn(q, *rest) -> q'` (same shape), n calls chained inside one
    jitted program (each reads the last's output: none can be skipped or overlapped, and no
    host round trip or dispatch sits between them); best of 5 runs."""
    @jax.jit
    def chained(q, *rest):
        for _ in range(n):
            q = fn(q, *rest)
        return q
    jax.block_until_ready(chained(q, *rest))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(chained(q, *rest))
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def attention_section(tiny: bool) -> None:
    from specjax.analysis.timing import copy_bandwidth
    if tiny:
        contexts, H, KV, hd, bs, n, wide = (64, 128), 8, 2, 16, 16, 2, 256
    else:
        contexts, H, KV, hd, bs, n, wide = (1024, 4096, 16384), 32, 8, 128, 16, 20, 16384
    bandwidth = copy_bandwidth()
    print(f"  copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write); H={H} KV={KV} hd={hd} "
          f"bs={bs} bf16; {n} calls chained per program")
    print(f"  {'case':<40} {'kernel us':>10} {'GB/s':>7} {'% bw':>5} {'ref us':>8}")
    cases = [(ctx, ctx, B, T, T == 17) for ctx in contexts for B in (1, 8) for T in (1, 5, 17)]
    cases += [(contexts[0], wide, 1, T, False) for T in (1, 5)]  # a short context, wide table
    kernel = lambda q, k, v, bt, pos, ctx, tm: paged_attention_kernel(
        q, k, v, 0, bt, pos, ctx, NO_WINDOW, tm, interpret=INTERPRET)
    reference = lambda q, k, v, bt, pos, ctx, tm: paged_attention_reference(
        q, k, v, 0, bt, pos, ctx, NO_WINDOW, tm)
    for ctx, width, B, T, tree in cases:
        q, k, v, tables, pos, ctx_arr, masks = device_attention_inputs(
            B, T, ctx, -(-width // bs), H, KV, hd, bs, tree)
        label = (f"ctx={ctx}" + (f" in {width}" if width != ctx else "") + f" B={B} "
                 + (f"tree 1+{T - 1}" if tree else f"T={T}"))
        kv_bytes = 2 * B * ctx * KV * hd * k.dtype.itemsize
        us = chained_us(kernel, q, (k, v, tables, pos, ctx_arr, masks), n)
        ref = (chained_us(reference, q, (k, v, tables, pos, ctx_arr, masks), n)
               if ctx == contexts[len(contexts) // 2] and width == ctx else float("nan"))
        gbs = kv_bytes / us / 1e3
        print(f"  {label:<40} {us:>10.1f} {gbs:>7.0f} {100 * gbs * 1e9 / bandwidth:>5.0f} "
              f"{ref:>8.1f}", flush=True)
        del q, k, v
    # The kernel's knobs at the middle context, batch 1 (the defaults: about 64 keys a step,
    # about 264 programs): what the next change of defaults would rest on.
    ctx = contexts[len(contexts) // 2]
    print(f"  tuning at ctx={ctx} B=1: us per call for (pages_per_step, num_splits)")
    for T in (1, 5):
        q, k, v, tables, pos, ctx_arr, masks = device_attention_inputs(
            1, T, ctx, -(-ctx // bs), H, KV, hd, bs, False)
        cells = []
        for P, S in ((2, 64), (4, 8), (4, 16), (4, 32), (4, 64), (8, 16), (8, 32)):
            tuned = lambda q, *a, P=P, S=S: paged_attention_kernel(
                q, a[0], a[1], 0, a[2], a[3], a[4], NO_WINDOW, None, interpret=INTERPRET,
                pages_per_step=P, num_splits=S)
            cells.append(f"({P},{S}) {chained_us(tuned, q, (k, v, tables, pos, ctx_arr), n):.1f}")
        print(f"    T={T}: " + "  ".join(cells), flush=True)


# --- the engine at real shapes, and XLA's options ---------------------------------------------

def shapes_section(shape: str, sections: str, tiny: bool) -> None:
    from specjax.bench import shapes
    parser = argparse.ArgumentParser()
    shapes.add_arguments(parser)
    argv = ["--shape", "tiny" if tiny else shape, "--sections", sections]
    if tiny:
        argv += ["--position", "64", "--batch-sizes", "1", "2", "--verify-len", "2",
                 "--tree-nodes", "4", "--max-tokens", "24"]
    shapes.run(parser.parse_args(argv))


def flags_section(tiny: bool) -> None:
    """Each candidate in its own process (XLA reads its flags once), with a fifth of the GPU's
    memory: this process already holds its preallocated share."""
    from specjax.bench import xla
    cmd = [sys.executable, "-m", "specjax.bench", "xla", "--shape",
           "tiny" if tiny else "llama-3.2-1b", "--position", "64" if tiny else "1024",
           "--batch-sizes", "1", "--layouts", "unrolled+fused"]
    for flags in (xla.CPU_CANDIDATES[:2] if tiny else xla.GPU_CANDIDATES[:4]):
        cmd.append(f"--flags={flags}")
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.2")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print(proc.stdout, end="")
    if proc.returncode or "failed:" in proc.stdout or "DIFFERS" in proc.stdout:
        print(proc.stderr[-2000:])
        raise CheckFailed("a candidate failed or changed the greedy output (see above)")


SECTIONS = ("checks", "attention", "8b", "1b", "flags", "kernels")
DEFAULT_SECTIONS = "checks,attention,8b,1b,flags"


# --- main ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    global INTERPRET
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--sections", default=DEFAULT_SECTIONS,
                        help=f"comma-separated, run in this order: {', '.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true",
                        help="kernels section: a few timing shapes only")
    parser.add_argument("--iters", type=int, default=None,
                        help="kernels section: timed calls per shape")
    parser.add_argument("--no-timing", action="store_true",
                        help="correctness checks only (the checks section)")
    parser.add_argument("--interpret", action="store_true",
                        help="run the kernels in interpret mode (a CPU dry run of the checks)")
    parser.add_argument("--tiny", action="store_true",
                        help="a CPU dry run of every section: interpret mode, tiny shapes")
    opts = parser.parse_args(argv)
    sections = [x.strip() for x in opts.sections.split(",") if x.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    if opts.no_timing:
        sections = ["checks"]
    INTERPRET = opts.interpret or opts.tiny
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not INTERPRET:
        print(f"no GPU (jax.default_backend() == {jax.default_backend()!r}): nothing checked")
        return 0
    iters = opts.iters or (5 if INTERPRET else 10 if opts.quick else 20)
    import jaxlib
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, python {platform.python_version()}"
          f", device {dev.device_kind} ({jax.default_backend()}), lowering "
          f"{'interpret' if INTERPRET else backend.GPU_LOWERING}, "
          f"SPECJAX_PALLAS={os.environ.get('SPECJAX_PALLAS', '')!r}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    if on_gpu:
        print(f"dispatch on this machine: {backend.choose(None)} (kernel = compiled Pallas)")
    failures = []
    t_start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in sections:
            t0 = time.perf_counter()
            print(f"\n== {name} ==", flush=True)
            try:
                if name == "checks":
                    failures += run_checks(opts)
                elif name == "attention":
                    attention_section(opts.tiny)
                elif name in ("8b", "1b"):
                    shape = "llama-3.1-8b" if name == "8b" else "llama-3.2-1b"
                    shapes_section(shape, "decode,verify,spec" if name == "8b"
                                   else "decode,verify", opts.tiny)
                elif name == "flags":
                    flags_section(opts.tiny)
                else:
                    failures += kernel_timings(opts, iters)
            except Exception as e:  # noqa: BLE001 - report every failure, then exit 1
                failures.append(name)
                print(f"  FAIL {name}: {type(e).__name__}: {e}", flush=True)
                if not isinstance(e, CheckFailed):
                    traceback.print_exc(limit=-4)
            print(f"   ({name}: {time.perf_counter() - t0:.0f} s, "
                  f"{time.perf_counter() - t_start:.0f} s so far)", flush=True)
    notes = sorted({f"{w.category.__name__}: {w.message}" for w in caught
                    if "pallas" in str(w.message).lower() or "triton" in str(w.message).lower()})
    for note in notes:
        print(f"warning seen: {note}")
    if failures:
        print(f"\nFAILED ({len(failures)}): " + "; ".join(failures))
        return 1
    print("\nall sections passed")
    return 0


def run_checks(opts) -> list[str]:
    failures = []
    for name, fn in CHECKS:
        if INTERPRET and "32k" in name and (opts.quick or opts.tiny):
            print(f"  SKIP {name} (interpret, --quick / --tiny)")
            continue
        t0 = time.perf_counter()
        try:
            detail = fn()
            print(f"  ok   {name}: {detail} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure
            failures.append(name)
            print(f"  FAIL {name}: {type(e).__name__}: {e}", flush=True)
            if not isinstance(e, CheckFailed):
                traceback.print_exc(limit=-3)
    return failures


def kernel_timings(opts, iters) -> list[str]:
    """The kernel-vs-reference table (median wall time per jitted call, dispatch included)."""
    failures = []
    header = (f"  {'kernel':<16} {'shape':<44} {'pallas us':>10} {'ref us':>10} "
              f"{'speedup':>8} {'compile s (k/r)':>16}")
    print(header)
    for kind, label, params in timing_cases(opts.quick):
        if INTERPRET and kind != "sampling":
            continue  # interpret-mode dry run: a single cheap family
        if INTERPRET:
            params = {**params, "V": 257, "B": min(params["B"], 4)}
            label = "B={B} D={D} V={V} (interpret)".format(**params)
        try:
            (kc, kt), (rc, rt) = time_case(kind, params, iters)
            print(f"  {kind:<16} {label:<44} {kt:>10.1f} {rt:>10.1f} {rt / kt:>7.2f}x "
                  f"{kc:>7.1f}/{rc:<7.1f}", flush=True)
        except Exception as e:  # noqa: BLE001
            failures.append(f"timing {kind} {label}")
            print(f"  {kind:<16} {label:<44} FAILED: {type(e).__name__}: {e}", flush=True)
        if INTERPRET:
            break
    return failures


if __name__ == "__main__":
    sys.exit(main())
