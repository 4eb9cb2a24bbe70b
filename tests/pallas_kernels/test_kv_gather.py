"""Paged KV relocation and page gather: Pallas kernels (interpret mode) against the jnp
references and against a plain numpy model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_gather import (gather_kv_pages, gather_kv_pages_kernel,
                                      gather_kv_pages_reference, relocate_kv, relocate_kv_kernel,
                                      relocate_kv_reference)

L, N, KV, BS, HD = 3, 7, 3, 4, 5  # KV = 3, HD = 5 and BS * HD = 20: masked tiles and vectors


def pools(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(L, N, KV, BS, HD)).astype(dtype),
            rng.normal(size=(L, N, KV, BS, HD)).astype(dtype))


def numpy_relocate(pool, sb, so, db, do, n):
    out = pool.copy()
    rows = {(b, r): pool[:, sb[b, r], :, so[b, r]].copy()
            for b in range(len(n)) for r in range(n[b])}  # every source read first
    for (b, r), row in rows.items():
        out[:, db[b, r], :, do[b, r]] = row
    return out


# Row 0: a chain inside block 1 (slot 2 -> 1, 3 -> 2, block 2 slot 0 -> 3): slots 2 and 3 are
# both sources and destinations. Row 1: a cycle (swap-like permutation) of block 3's slots.
# Row 2: no moves, with garbage (out-of-range) indices that must not be touched or read.
# Row 3: one move across blocks, then garbage beyond num_moves.
SRC_BLOCKS = [[1, 1, 2, 0], [3, 3, 3, 3], [-5, 99, 0, 1], [4, -1, 77, 0]]
SRC_OFFS = [[2, 3, 0, 0], [1, 0, 3, 2], [0, 9, -3, 0], [3, 50, 0, 0]]
DST_BLOCKS = [[1, 1, 1, 0], [3, 3, 3, 3], [99, -7, 1, 1], [5, 0, 123, -1]]
DST_OFFS = [[1, 2, 3, 0], [0, 1, 2, 3], [0, 0, 0, 0], [0, 70, 0, -4]]
NUM_MOVES = [3, 4, 0, 1]


@pytest.fixture(scope="module")
def relocate_fns():
    return (jax.jit(relocate_kv_reference),
            jax.jit(lambda *a: relocate_kv_kernel(*a, interpret=True)))


def test_relocate_matches_reference_and_numpy(relocate_fns):
    ref_fn, kernel_fn = relocate_fns
    k, v = pools()
    idx = [np.asarray(x, np.int32) for x in (SRC_BLOCKS, SRC_OFFS, DST_BLOCKS, DST_OFFS,
                                             NUM_MOVES)]
    out_k, out_v = kernel_fn(k, v, *idx)
    ref_k, ref_v = ref_fn(k, v, *idx)
    want_k, want_v = numpy_relocate(k, *idx), numpy_relocate(v, *idx)
    np.testing.assert_array_equal(np.asarray(ref_k), want_k)
    np.testing.assert_array_equal(np.asarray(ref_v), want_v)
    np.testing.assert_array_equal(np.asarray(out_k), want_k)
    np.testing.assert_array_equal(np.asarray(out_v), want_v)
    # The chain really moved data: slot (1, 1) now holds what (1, 2) held, in every layer.
    np.testing.assert_array_equal(np.asarray(out_k)[:, 1, :, 1], k[:, 1, :, 2])
    np.testing.assert_array_equal(np.asarray(out_k)[:, 1, :, 2], k[:, 1, :, 3])
    # Untouched: block 6 entirely, and everything but the moved slots.
    changed = np.any(np.asarray(out_k) != k, axis=(0, 2, 4))
    assert set(zip(*np.nonzero(changed))) <= {(1, 1), (1, 2), (1, 3), (3, 0), (3, 1), (3, 2),
                                              (3, 3), (5, 0)}


def test_relocate_in_place_with_donation(relocate_fns):
    """Under jit with the pools donated (how the engine calls it) the result is the same."""
    k, v = pools(1)
    idx = [jnp.asarray(x, jnp.int32) for x in (SRC_BLOCKS, SRC_OFFS, DST_BLOCKS, DST_OFFS,
                                               NUM_MOVES)]
    want = numpy_relocate(k, *map(np.asarray, idx))
    f = jax.jit(lambda k, v, *i: relocate_kv(k, v, *i, interpret=True), donate_argnums=(0, 1))
    out_k, _ = f(jnp.asarray(k), jnp.asarray(v), *idx)
    np.testing.assert_array_equal(np.asarray(out_k), want)


def test_relocate_nothing_to_move(relocate_fns):
    _, kernel_fn = relocate_fns
    k, v = pools(2)
    zeros = np.zeros((4, 4), np.int32)
    out_k, out_v = kernel_fn(k, v, zeros, zeros, zeros + 1, zeros + 1, np.zeros(4, np.int32))
    np.testing.assert_array_equal(np.asarray(out_k), k)
    np.testing.assert_array_equal(np.asarray(out_v), v)


@pytest.mark.parametrize("chunk", [16, 4096])
def test_gather_pages_matches_reference(chunk):
    pool, _ = pools(3)
    tables = np.array([[1, 4, 0], [6, 2, 3], [0, 0, 0]], np.int32)
    gather = jax.jit(lambda p, l, t: gather_kv_pages_kernel(p, l, t, interpret=True,
                                                            chunk=chunk))
    for layer in (0, 2):
        out = gather(pool, layer, tables)
        ref = gather_kv_pages_reference(jnp.asarray(pool), layer, jnp.asarray(tables))
        want = pool[layer][tables].transpose(0, 2, 1, 3, 4)  # [B, KV, M, BS, HD]
        np.testing.assert_array_equal(np.asarray(ref), want)
        np.testing.assert_array_equal(np.asarray(out), want)


def test_public_names_dispatch():
    pool, v = pools(4)
    tables = np.array([[1, 2]], np.int32)
    want = pool[1][tables].transpose(0, 2, 1, 3, 4)
    np.testing.assert_array_equal(np.asarray(gather_kv_pages(pool, 1, tables)), want)
    np.testing.assert_array_equal(
        np.asarray(gather_kv_pages(pool, 1, tables, interpret=True)), want)
    one = np.ones((1, 1), np.int32)
    out_k, _ = relocate_kv(pool, v, one, one, one + 1, one, np.ones(1, np.int32))
    np.testing.assert_array_equal(np.asarray(out_k)[:, 2, :, 1], pool[:, 1, :, 1])
