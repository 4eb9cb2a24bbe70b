"""The paged-attention reference equals dense attention over the same tokens; the Pallas
kernel (interpret mode) equals the reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (NO_WINDOW, paged_attention, paged_attention_kernel,
                                            paged_attention_reference)
from pallas_kernels.paged_attention.kernel import compiled_supported
from specjax.models import dense_attention

L, NUM_BLOCKS, BS, KV, H, HD = 2, 24, 4, 2, 4, 8


@pytest.mark.parametrize("window", [None, 3])
def test_matches_dense_over_ragged_runs(window):
    rng = np.random.default_rng(0)
    # (cached tokens before the run, run length): decode, verify, prefill chunk, padded row.
    rows = [(9, 1), (5, 4), (0, 7), (0, 0)]
    T, M = 7, 5
    total = max(c + n for c, n in rows)
    k_full = rng.normal(size=(len(rows), total, KV, HD)).astype(np.float32)
    v_full = rng.normal(size=(len(rows), total, KV, HD)).astype(np.float32)
    q = rng.normal(size=(len(rows), T, H, HD)).astype(np.float32)
    k_pool = rng.normal(size=(L, NUM_BLOCKS, BS, KV, HD)).astype(np.float32)  # garbage
    v_pool = rng.normal(size=(L, NUM_BLOCKS, BS, KV, HD)).astype(np.float32)
    tables = np.zeros((len(rows), M), np.int32)
    free = list(rng.permutation(np.arange(1, NUM_BLOCKS)))  # scattered, out-of-order pages
    layer = 1
    for b, (cached, n) in enumerate(rows):
        for j in range(-(-(cached + n) // BS)):
            tables[b, j] = free.pop()
        for p in range(cached + n):
            k_pool[layer, tables[b, p // BS], p % BS] = k_full[b, p]
            v_pool[layer, tables[b, p // BS], p % BS] = v_full[b, p]
    start = np.array([c for c, _ in rows], np.int32)
    positions = start[:, None] + np.arange(T)
    context = np.array([c + n for c, n in rows], np.int32)
    w = window or 2**30
    out = paged_attention_reference(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool),
                                    layer, jnp.asarray(tables), jnp.asarray(positions),
                                    jnp.asarray(context), w)
    for b, (cached, n) in enumerate(rows):
        if n == 0:
            assert np.all(np.asarray(out[b]) == 0)
            continue
        ref = dense_attention(jnp.asarray(q[b:b + 1, :n]), jnp.asarray(k_full[b:b + 1, :cached + n]),
                              jnp.asarray(v_full[b:b + 1, :cached + n]),
                              jnp.asarray(positions[b:b + 1, :n]),
                              jnp.arange(cached + n)[None], w)
        np.testing.assert_allclose(np.asarray(out[b, :n]), np.asarray(ref[0]), atol=1e-5)


def test_jits():
    f = jax.jit(paged_attention_reference)
    q = jnp.ones((1, 1, H, HD))
    pool = jnp.ones((L, NUM_BLOCKS, BS, KV, HD))
    out = f(q, pool, pool, 0, jnp.ones((1, 2), jnp.int32), jnp.zeros((1, 1), jnp.int32),
            jnp.ones(1, jnp.int32), 2**30)
    np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-6)


# --- the Pallas kernel (interpret mode) against the reference ----------------------------------



def ragged_setup(rows, T, M, dtype=np.float32, seed=0, poison=None):
    """A pool holding each row's `cached + n` positions on scattered pages. `poison`: fill
    the null block 0 and every page no query can see (wholly before the window `poison`) with
    NaN, so a kernel that read them would return NaN."""
    rng = np.random.default_rng(seed)
    k_pool = rng.normal(size=(L, NUM_BLOCKS, BS, KV, HD)).astype(np.float32)
    v_pool = rng.normal(size=(L, NUM_BLOCKS, BS, KV, HD)).astype(np.float32)
    q = rng.normal(size=(len(rows), T, H, HD)).astype(np.float32)
    tables = np.zeros((len(rows), M), np.int32)
    free = list(rng.permutation(np.arange(1, NUM_BLOCKS)))
    for b, (cached, n) in enumerate(rows):
        for j in range(-(-(cached + n) // BS)):
            tables[b, j] = free.pop()
    start = np.array([c for c, _ in rows], np.int32)
    positions = (start[:, None] + np.arange(T)).astype(np.int32)
    context = np.array([c + n for c, n in rows], np.int32)
    clean = (k_pool.copy(), v_pool.copy())
    if poison is not None:
        for pool in (k_pool, v_pool):
            pool[:, 0] = np.nan
            for b, (cached, n) in enumerate(rows):
                first_visible = max(0, cached - poison + 1)
                for j in range(first_visible // BS):
                    pool[:, tables[b, j]] = np.nan
    cast = lambda x: jnp.asarray(x, dtype)
    return (cast(q), cast(k_pool), cast(v_pool), tables, positions, context,
            tuple(map(cast, clean)))


RAGGED = [(9, 1), (5, 4), (0, 7), (0, 0), (13, 3)]  # decode, verify, prefill, padded, long verify


@pytest.fixture(scope="module")
def kernel_fn():
    """One jitted interpret-mode kernel per (pages_per_step, num_splits); layer and window
    traced, as in the engine's step."""
    cache = {}

    def get(pages_per_step=None, num_splits=None, rows_per_block=None):
        key = (pages_per_step, num_splits, rows_per_block)
        if key not in cache:
            cache[key] = jax.jit(lambda *a: paged_attention_kernel(
                *a, interpret=True, pages_per_step=pages_per_step, num_splits=num_splits,
                rows_per_block=rows_per_block))
        return cache[key]
    return get


reference_fn = jax.jit(paged_attention_reference)


@pytest.mark.parametrize("config", [(None, None, None), (1, 3, None), (2, 2, 4)])
@pytest.mark.parametrize("window", [NO_WINDOW, 3, 6])
def test_kernel_matches_reference(kernel_fn, window, config):
    """Ragged runs (decode, verify, prefill chunk, a context_len 0 row) with GQA (4 query
    heads on 2 kv heads), scattered pages, a block table longer than needed, sliding windows;
    config = (pages_per_step, num_splits, rows_per_block): one or several pages per step, one
    or several programs per (request, kv head) merged afterwards, the 14 query rows in one
    block or in 4 (whose causal/window key ranges differ)."""
    q, k, v, tables, positions, context, _ = ragged_setup(RAGGED, T=7, M=6)
    layer = 1
    out = kernel_fn(*config)(q, k, v, layer, tables, positions, context, window)
    ref = reference_fn(q, k, v, layer, tables, positions, context, window)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-5)
    assert np.all(np.asarray(out[3]) == 0)  # context_len 0: zeros


def test_kernel_reads_only_pages_it_needs(kernel_fn):
    """NaN in the null block (padding entries) and in pages wholly before the sliding window:
    the kernel never loads them (one page per step: the skipped range is exact to the page)
    or masks them out, V included (several pages per step load whole groups), so its output
    is finite and equals the reference's on a clean pool (the reference gathers every table
    entry and returns NaN here)."""
    window = 5
    q, k, v, tables, positions, context, (k_clean, v_clean) = ragged_setup(
        RAGGED, T=7, M=6, poison=window)
    ref = reference_fn(q, k_clean, v_clean, 0, tables, positions, context, window)
    assert np.isnan(np.asarray(reference_fn(q, k, v, 0, tables, positions, context, window))).any()
    for config in [(1, 2), (None, None)]:
        out = kernel_fn(*config)(q, k, v, 0, tables, positions, context, window)
        assert np.all(np.isfinite(np.asarray(out))), config
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-5)


def test_kernel_bfloat16_pool(kernel_fn):
    q, k, v, tables, positions, context, _ = ragged_setup(RAGGED, T=7, M=6, dtype=jnp.bfloat16)
    out = kernel_fn()(q, k, v, 1, tables, positions, context, NO_WINDOW)
    ref = reference_fn(q, k, v, 1, tables, positions, context, NO_WINDOW)
    assert out.dtype == ref.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=3e-2, rtol=3e-2)


def test_public_name_inside_jit_like_the_engine_step():
    """`paged_attention(q, k_pool, v_pool, layer, tables, positions, context_lens, window)`
    with a Python-int layer and a traced window (the engine's call): the reference on CPU,
    the kernel with interpret=True; both agree."""
    q, k, v, tables, positions, context, _ = ragged_setup(RAGGED, T=7, M=6, seed=1)
    windows = jnp.asarray([NO_WINDOW, 4])

    def step(interpret):
        def f(q, k, v, tables, positions, context):
            return [paged_attention(q, k, v, layer, tables, positions, context, windows[layer],
                                    interpret=interpret) for layer in range(L)]
        return jax.jit(f)(q, k, v, tables, positions, context)

    plain, interp = step(None), step(True)
    for layer in range(L):
        ref = reference_fn(q, k, v, layer, tables, positions, context, windows[layer])
        if jax.default_backend() != "gpu":
            np.testing.assert_array_equal(np.asarray(plain[layer]), np.asarray(ref))
        np.testing.assert_allclose(np.asarray(interp[layer]), np.asarray(ref), atol=2e-6,
                                   rtol=1e-5)


def test_compiled_support_rules():
    assert compiled_supported((2, 8, 32, 128), (4, 100, 16, 8, 128))
    assert not compiled_supported((2, 8, 32, 8), (4, 100, 16, 8, 8))       # head_dim < 16
    assert not compiled_supported((2, 8, 32, 96), (4, 100, 16, 8, 96))     # head_dim not 2^k
    assert not compiled_supported((2, 8, 32, 128), (4, 100, 12, 8, 128))   # block size not 2^k
