"""The paged-attention reference equals dense attention over the same tokens."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention_reference
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
