"""The paged-attention reference equals dense attention over the same tokens; the Pallas
kernel (interpret mode) equals the reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (NO_WINDOW, paged_attention, paged_attention_kernel,
                                            paged_attention_reference)
from pallas_kernels.paged_attention.kernel import compiled_supported
from pallas_kernels.paged_attention.reference import tree_visibility
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
    k_pool = rng.normal(size=(L, NUM_BLOCKS, KV, BS, HD)).astype(np.float32)  # garbage
    v_pool = rng.normal(size=(L, NUM_BLOCKS, KV, BS, HD)).astype(np.float32)
    tables = np.zeros((len(rows), M), np.int32)
    free = list(rng.permutation(np.arange(1, NUM_BLOCKS)))  # scattered, out-of-order pages
    layer = 1
    for b, (cached, n) in enumerate(rows):
        for j in range(-(-(cached + n) // BS)):
            tables[b, j] = free.pop()
        for p in range(cached + n):
            k_pool[layer, tables[b, p // BS], :, p % BS] = k_full[b, p]
            v_pool[layer, tables[b, p // BS], :, p % BS] = v_full[b, p]
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
    pool = jnp.ones((L, NUM_BLOCKS, KV, BS, HD))
    out = f(q, pool, pool, 0, jnp.ones((1, 2), jnp.int32), jnp.zeros((1, 1), jnp.int32),
            jnp.ones(1, jnp.int32), 2**30)
    np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-6)


# --- the Pallas kernel (interpret mode) against the reference ----------------------------------



def ragged_setup(rows, T, M, dtype=np.float32, seed=0, poison=None):
    """A pool holding each row's `cached + n` positions on scattered pages. `poison`: fill
    the null block 0 and every page no query can see (wholly before the window `poison`) with
    NaN, so a kernel that read them would return NaN."""
    rng = np.random.default_rng(seed)
    k_pool = rng.normal(size=(L, NUM_BLOCKS, KV, BS, HD)).astype(np.float32)
    v_pool = rng.normal(size=(L, NUM_BLOCKS, KV, BS, HD)).astype(np.float32)
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


@pytest.mark.parametrize("num_splits", [5, 16])
def test_splits_share_the_context_not_the_table(kernel_fn, num_splits):
    """A block table four times wider than the longest context, split among more programs
    than some rows have pages (and a count that divides nothing): each program takes an
    equal share of the pages its rows can see, none is read twice or skipped, and the padding
    entries (NaN null block) are never read."""
    window = 6
    q, k, v, tables, positions, context, (k_clean, v_clean) = ragged_setup(
        RAGGED, T=7, M=20, poison=window)
    ref = reference_fn(q, k_clean, v_clean, 1, tables, positions, context, window)
    out = kernel_fn(1, num_splits)(q, k, v, 1, tables, positions, context, window)
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-5)


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
    assert compiled_supported((2, 8, 32, 128), (4, 100, 8, 16, 128))
    assert not compiled_supported((2, 8, 32, 8), (4, 100, 8, 16, 8))       # head_dim < 16
    assert not compiled_supported((2, 8, 32, 96), (4, 100, 8, 16, 96))     # head_dim not 2^k
    assert not compiled_supported((2, 8, 32, 128), (4, 100, 8, 12, 128))   # block size not 2^k


# --- draft-tree masks ------------------------------------------------------------------------

TREE_BLOCKS = 40


def random_tree(n, rng):
    """Parents (parent < child; the root's is -1) and depths of an n-node tree."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    return parents, depths


def ancestors_or_self(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out


def tree_bitmasks(parents, T):
    """int32 [T]: bit a of row i set iff node a is an ancestor of i or i itself (rows past the
    tree: 0). Built as uint32, so bit 31 gives a negative int32."""
    masks = np.zeros(T, np.uint32)
    for i in range(len(parents)):
        for a in ancestors_or_self(parents, i):
            masks[i] |= np.uint32(1 << a)
    return masks.view(np.int32)


def tree_setup(rows, T, M, seed=0, chain=False):
    """rows: (cached context, tree nodes incl. the root, extra written slots past the tree)
    per request. The context fills slots 0..cached-1, node i slot cached + i (position cached +
    depth_i), then `extra` more written slots (e.g. padding rows' K/V) inside context_lens.
    Padding rows (i >= nodes) sit at the root's position with mask 0. Returns jnp q, pools,
    tables, positions, tree masks, context lens, and per request (parents, k_full, v_full)
    with k_full/v_full [slots, KV, HD] as written."""
    rng = np.random.default_rng(seed)
    k_pool = rng.normal(size=(L, TREE_BLOCKS, KV, BS, HD)).astype(np.float32)  # garbage
    v_pool = rng.normal(size=(L, TREE_BLOCKS, KV, BS, HD)).astype(np.float32)
    q = rng.normal(size=(len(rows), T, H, HD)).astype(np.float32)
    tables = np.zeros((len(rows), M), np.int32)
    positions = np.zeros((len(rows), T), np.int32)
    masks = np.zeros((len(rows), T), np.int32)
    context = np.zeros(len(rows), np.int32)
    free = list(rng.permutation(np.arange(1, TREE_BLOCKS)))
    trees = []
    for b, (cached, n, extra) in enumerate(rows):
        if chain:
            parents, depths = list(range(-1, n - 1)), list(range(n))
        else:
            parents, depths = random_tree(n, rng)
        context[b] = cached + n + extra
        for j in range(-(-int(context[b]) // BS)):
            tables[b, j] = free.pop()
        positions[b] = cached
        positions[b, :n] = cached + np.asarray(depths, np.int32)
        masks[b] = tree_bitmasks(parents, T)
        by_slot = lambda pool: pool[1, tables[b]].transpose(0, 2, 1, 3).reshape(M * BS, KV, HD)
        k_full = by_slot(k_pool)[:context[b]].copy()
        v_full = by_slot(v_pool)[:context[b]].copy()
        trees.append((parents, k_full, v_full))
    return (jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(tables),
            jnp.asarray(positions), jnp.asarray(masks), jnp.asarray(context), trees)


def tree_attention_loops(q, positions, window, rows, trees):
    """Softmax attention over exactly the keys each row may see, row by row (float64): context
    slots by causal + window on positions, run slots by walking the row's ancestors."""
    q, positions = np.asarray(q, np.float64), np.asarray(positions)
    out = np.zeros(q.shape)
    G = H // KV
    for b, ((cached, n, extra), (parents, k_full, v_full)) in enumerate(zip(rows, trees)):
        for i in range(q.shape[1]):
            allowed = [s for s in range(cached) if 0 <= positions[b, i] - s < window]
            if i < n:
                allowed += [cached + a for a in ancestors_or_self(parents, i) if a < 32]
            if not allowed:
                continue
            for h in range(H):
                k = k_full[allowed, h // G].astype(np.float64)
                v = v_full[allowed, h // G].astype(np.float64)
                scores = k @ q[b, i, h] * HD ** -0.5
                p = np.exp(scores - scores.max())
                out[b, i, h] = (p / p.sum()) @ v
    return out


# (cached context, tree nodes with the root, written slots past the tree): ragged contexts, a
# lone root (decode), padding rows, slots past the tree (padding rows' K/V), a padded request.
TREE_ROWS = [(9, 5, 0), (0, 6, 0), (13, 1, 2), (5, 7, 0), (0, 0, 0), (2, 3, 1)]


@pytest.mark.parametrize("window", [NO_WINDOW, 4])
def test_tree_reference_matches_loops_over_visible_keys(window):
    """Random trees (parent < child) at slots run_start + i, positions run_start + depth:
    every row sees the context (causal, window < context for several requests) and exactly
    its ancestors and itself among the run's slots; padding rows (mask 0) the context only."""
    T, M = 7, 6
    q, k, v, tables, positions, masks, context, trees = tree_setup(TREE_ROWS, T, M, seed=3)
    out = reference_fn(q, k, v, 1, tables, positions, context, window, masks)
    want = tree_attention_loops(q, positions, window, TREE_ROWS, trees)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6, rtol=1e-5)
    assert np.all(np.asarray(out[4]) == 0)  # context_len 0: zeros


def test_tree_uses_32_bits_and_no_more(kernel_fn):
    """A 32-node tree: bit 31 (a negative int32) addresses node 31; written slots at
    run_start + 32.. (inside context_lens) are never seen, although clip(j, 0, 31) reads bit
    31 for them. Reference against the loops, kernel against the reference."""
    rows = [(3, 32, 3), (6, 4, 0)]
    q, k, v, tables, positions, masks, context, trees = tree_setup(rows, T=32, M=10, seed=4)
    assert (np.asarray(masks) < 0).any()
    out = reference_fn(q, k, v, 1, tables, positions, context, NO_WINDOW, masks)
    want = tree_attention_loops(q, positions, NO_WINDOW, rows, trees)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6, rtol=1e-5)
    kern = kernel_fn(None, None, None)(q, k, v, 1, tables, positions, context, NO_WINDOW, masks)
    np.testing.assert_allclose(np.asarray(kern), np.asarray(out), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("config", [(None, None, None), (1, 3, 4), (2, 2, 16)])
@pytest.mark.parametrize("window", [NO_WINDOW, 3])
def test_tree_kernel_matches_reference(kernel_fn, window, config):
    """The kernel (interpret mode) with a tree mask equals the reference, for one or several
    pages per step, one or several splits, and row blocks whose key ranges differ (window 3
    is narrower than some trees' depth: run keys still ignore it, in both)."""
    T, M = 7, 6
    q, k, v, tables, positions, masks, context, _ = tree_setup(TREE_ROWS, T, M, seed=5)
    out = kernel_fn(*config)(q, k, v, 1, tables, positions, context, window, masks)
    ref = reference_fn(q, k, v, 1, tables, positions, context, window, masks)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-5)
    assert np.all(np.asarray(out[4]) == 0)


@pytest.mark.parametrize("window", [NO_WINDOW, 7])
def test_tree_of_a_chain_is_the_causal_run(kernel_fn, window):
    """A chain written as a tree (parent of node i is i - 1, mask = bits 0..i) gives what the
    causal call without a tree gives: the same visibility exactly, the same outputs up to
    float rounding (XLA fuses the two programs differently) for reference and kernel (whose
    key ranges differ too). Windows at least the run length (run keys get no window test in
    a tree)."""
    rows = [(9, 1, 0), (5, 4, 0), (0, 7, 0), (0, 0, 0), (13, 3, 0)]
    T, M = 7, 6
    q, k, v, tables, positions, masks, context, _ = tree_setup(rows, T, M, seed=6, chain=True)
    # Padding rows continue the chain (as the causal call's positions do).
    positions = jnp.asarray([c for c, _, _ in rows])[:, None] + jnp.arange(T)
    masks = jnp.broadcast_to((2 << jnp.arange(T)) - 1, (len(rows), T)).astype(jnp.int32)
    slots = jnp.arange(M * BS)
    distance = positions[:, :, None] - slots
    in_context = (slots < context[:, None])[:, None, :]
    np.testing.assert_array_equal(
        np.asarray(tree_visibility(positions, slots, window, masks) & in_context),
        np.asarray((distance >= 0) & (distance < window) & in_context))
    tree = reference_fn(q, k, v, 1, tables, positions, context, window, masks)
    causal = reference_fn(q, k, v, 1, tables, positions, context, window)
    np.testing.assert_allclose(np.asarray(tree), np.asarray(causal), atol=1e-6, rtol=1e-6)
    kern = kernel_fn(1, 2, None)
    np.testing.assert_allclose(
        np.asarray(kern(q, k, v, 1, tables, positions, context, window, masks)),
        np.asarray(kern(q, k, v, 1, tables, positions, context, window)), atol=2e-6, rtol=1e-5)


def test_tree_hides_non_ancestors(kernel_fn):
    """Root 0 -> {1, 2}, 1 -> 3, 2 -> 4: node 2's K/V set huge leave rows 0, 1, 3 exactly as
    they were (reference and kernel) and change rows 2 and 4 (which see node 2)."""
    cached, T = 6, 5
    parents = [-1, 0, 0, 1, 2]
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.normal(size=(1, T, H, HD)), jnp.float32)
    k_pool = rng.normal(size=(L, TREE_BLOCKS, KV, BS, HD)).astype(np.float32)
    v_pool = rng.normal(size=(L, TREE_BLOCKS, KV, BS, HD)).astype(np.float32)
    tables = jnp.asarray([[3, 1, 7, 0]], jnp.int32)
    positions = jnp.asarray([[cached + d for d in (0, 1, 1, 2, 2)]], jnp.int32)
    masks = jnp.asarray(tree_bitmasks(parents, T)[None])
    context = jnp.asarray([cached + T], jnp.int32)
    slot = cached + 2  # node 2
    poisoned = [p.copy() for p in (k_pool, v_pool)]
    for p in poisoned:
        p[:, tables[0, slot // BS], :, slot % BS] = 1e4
    for fn in (reference_fn, kernel_fn(1, 2, None)):
        clean = np.asarray(fn(q, jnp.asarray(k_pool), jnp.asarray(v_pool), 1, tables, positions,
                              context, NO_WINDOW, masks))
        dirty = np.asarray(fn(q, *map(jnp.asarray, poisoned), 1, tables, positions, context,
                              NO_WINDOW, masks))
        np.testing.assert_array_equal(dirty[0, [0, 1, 3]], clean[0, [0, 1, 3]])
        assert np.all(np.abs(dirty[0, [2, 4]] - clean[0, [2, 4]]).max(axis=(1, 2)) > 1.0)


def test_public_name_with_a_tree():
    """`paged_attention(..., window, tree_mask)`: the reference on CPU, the kernel with
    interpret=True; both agree."""
    q, k, v, tables, positions, masks, context, _ = tree_setup(TREE_ROWS, 7, 6, seed=8)
    ref = reference_fn(q, k, v, 1, tables, positions, context, 5, masks)
    interp = paged_attention(q, k, v, 1, tables, positions, context, 5, masks, interpret=True)
    np.testing.assert_allclose(np.asarray(interp), np.asarray(ref), atol=2e-6, rtol=1e-5)
    if jax.default_backend() != "gpu":
        plain = jax.jit(lambda *a: paged_attention(*a[:-1], tree_mask=a[-1]))(
            q, k, v, 1, tables, positions, context, 5, masks)
        np.testing.assert_array_equal(np.asarray(plain), np.asarray(ref))


def test_tree_kernel_lowers_for_gpu():
    """With a tree (shifts by a vector of key offsets) the kernel still lowers to Triton IR
    (no GPU needed, nothing run)."""
    S = jax.ShapeDtypeStruct
    B, T, H_, KV_, hd, bs, N, M = 4, 17, 32, 8, 128, 16, 512, 40
    fn = lambda q, k, v, bt, pos, ctx, w, tm: paged_attention_kernel(
        q, k, v, 1, bt, pos, ctx, w, tm, interpret=False)
    pool = S((L, N, KV_, bs, hd), jnp.bfloat16)
    text = jax.jit(fn).trace(
        S((B, T, H_, hd), jnp.bfloat16), pool, pool, S((B, M), jnp.int32), S((B, T), jnp.int32),
        S((B,), jnp.int32), S((), jnp.int32), S((B, T), jnp.int32)
    ).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
