"""filter_logits semantics and the sampled distribution."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core.sampling import (DRAFT_STREAM, categorical, filter_logits, gumbel_noise, sample,
                                   sampling_keys)

LOGITS = jnp.log(jnp.asarray([[0.4, 0.3, 0.15, 0.1, 0.05]]))


def kept(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    out = filter_logits(LOGITS, jnp.asarray([temperature]), jnp.asarray([top_k]),
                        jnp.asarray([top_p]), jnp.asarray([min_p]))
    return [i for i in range(5) if np.isfinite(np.asarray(out)[0, i])]


def test_no_filter_keeps_all():
    assert kept() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("k, expected", [(1, [0]), (2, [0, 1]), (4, [0, 1, 2, 3]), (9, [0, 1, 2, 3, 4])])
def test_top_k(k, expected):
    assert kept(top_k=k) == expected


@pytest.mark.parametrize("p, expected", [(0.05, [0]), (0.4, [0]), (0.41, [0, 1]),
                                         (0.7, [0, 1]), (0.71, [0, 1, 2]), (1.0, [0, 1, 2, 3, 4])])
def test_top_p(p, expected):
    assert kept(top_p=p) == expected


def test_top_p_measured_after_top_k():
    # Within the top 2 (0.4, 0.3) renormalised: 0.571, 0.429. top_p=0.5 keeps only the first.
    assert kept(top_k=2, top_p=0.5) == [0]
    assert kept(top_k=2, top_p=0.6) == [0, 1]


@pytest.mark.parametrize("m, expected", [(0.3, [0, 1, 2]), (0.5, [0, 1]), (0.8, [0]), (0.1, [0, 1, 2, 3, 4])])
def test_min_p(m, expected):
    assert kept(min_p=m) == expected


def test_temperature_scales():
    out = filter_logits(LOGITS, jnp.asarray([2.0]), jnp.asarray([0]), jnp.asarray([1.0]),
                        jnp.asarray([0.0]))
    np.testing.assert_allclose(np.asarray(out), np.asarray(LOGITS) / 2, rtol=1e-6)


def test_greedy_rows_take_argmax_whatever_the_key():
    logits = jnp.asarray([[0.1, 2.0, 0.3], [1.0, 0.0, 0.5]])
    for seed in range(5):
        keys = sampling_keys(jnp.asarray([seed, seed + 7], jnp.uint32), jnp.asarray([3, 4]))
        out = sample(logits, jnp.zeros(2), jnp.zeros(2, jnp.int32), jnp.ones(2), jnp.zeros(2), keys)
        assert out.tolist() == [1, 0]


def test_sampled_frequencies_follow_filtered_softmax():
    # 20k draws of a top-k=3, T=0.7 distribution. The max |freq - p| over 5 tokens has standard
    # deviation <= sqrt(0.25 / 20000) = 0.0035 per token; 0.02 is > 5 sigma.
    n = 20000
    logits = jnp.broadcast_to(LOGITS, (n, 5))
    keys = sampling_keys(jnp.full(n, 1234, jnp.uint32), jnp.arange(n))
    t, k = 0.7, 3
    draws = np.asarray(sample(logits, jnp.full(n, t), jnp.full(n, k, jnp.int32), jnp.ones(n),
                              jnp.zeros(n), keys))
    p = np.exp(np.asarray(LOGITS[0]) / t)
    p[3:] = 0
    p /= p.sum()
    freq = np.bincount(draws, minlength=5) / n
    assert np.abs(freq - p).max() < 0.02
    assert freq[3] == freq[4] == 0


def test_keys_depend_on_seed_and_position_only():
    a = sampling_keys(jnp.asarray([5, 6], jnp.uint32), jnp.asarray([10, 10]))
    b = sampling_keys(jnp.asarray([5], jnp.uint32), jnp.asarray([10]))
    assert int(a[0]) == int(b[0])
    assert int(a[0]) != int(a[1])
    # Target and draft draws at one position come from different streams.
    assert int(sampling_keys(jnp.asarray([5], jnp.uint32), jnp.asarray([10]), DRAFT_STREAM)[0]) \
        != int(b[0])


def test_gumbel_noise_is_finite_at_the_extreme_bits():
    # All-ones bits once rounded the uniform to 1.0: noise +inf, a forbidden entry NaN, and
    # argmax picked the forbidden entry (a grammar-masked token was emitted).
    noise = np.asarray(gumbel_noise(jnp.asarray([0, 2**9, 2**31, 2**32 - 1], jnp.uint32)))
    assert np.all(np.isfinite(noise)) and noise[0] < noise[1] < noise[2] < noise[3]


def test_draws_never_pick_a_forbidden_entry():
    logits = jnp.where(jnp.arange(64) % 3 == 0, 0.0, -jnp.inf)
    keys = sampling_keys(jnp.arange(4096, dtype=jnp.uint32), jnp.arange(4096))
    draws = np.asarray(categorical(keys, jnp.broadcast_to(logits, (4096, 64))))
    assert np.all(draws % 3 == 0)
    assert len(set(draws.tolist())) == 22  # every allowed entry is drawn


def _reference_kept(x, top_k, top_p):
    """numpy: the tokens filter_logits keeps (temperature 1, no min_p), by a full sort."""
    order = np.argsort(-x, kind="stable")
    k = len(x) if top_k <= 0 else min(top_k, len(x))
    probs = np.exp(x[order[:k]] - x[order[0]])
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    last = x[order[np.sum(before < top_p) - 1]]
    return set(np.flatnonzero(x >= last).tolist())


@pytest.mark.parametrize("top_k, top_p", [(0, 0.5), (0, 0.999), (10, 1.0), (300, 0.9),
                                          (0, 1.0), (40, 0.7)])
def test_large_vocabularies_cut_where_a_full_sort_does_whatever_the_batch(top_k, top_p):
    """V = 2000 > CANDIDATES: a peaked row's nucleus lies among the top candidates, a flat
    row's (top_p 0.999) or a top_k above them needs the full sort. Each row's kept set equals
    the full sort's, alone or batched with a row that takes the other path."""
    rng = np.random.default_rng(0)
    peaked = rng.normal(size=2000).astype(np.float32) * 4
    flat = rng.normal(size=2000).astype(np.float32) * 0.1
    params = lambda n: (jnp.ones(n), jnp.full(n, top_k), jnp.full(n, top_p), jnp.zeros(n))
    for rows in ([peaked], [flat], [peaked, flat], [flat, peaked]):
        out = np.asarray(filter_logits(jnp.asarray(np.stack(rows)), *params(len(rows))))
        for x, o in zip(rows, out):
            assert set(np.flatnonzero(np.isfinite(o)).tolist()) == _reference_kept(x, top_k, top_p)


@pytest.mark.parametrize("V", [64, 97, 1024, 262144])
def test_vocab_argmax_is_jnp_argmax(V):
    """The two-pass argmax gives jnp.argmax's index on every row: ties (the first wins),
    -inf rows and entries, maxima in the first and last blocks, and with NaN in the batch
    (counted largest, the first wins); vocabularies that split into blocks and ones that do
    not."""
    from specjax.core.sampling import vocab_argmax
    rng = np.random.default_rng(V)
    x = rng.integers(-3, 4, size=(9, 3, V)).astype(np.float32)   # many ties
    x[0, 0] = -np.inf
    x[1, 0, V // 2] = np.nan
    x[1, 1, [3, V - 1]] = np.nan
    x[2, 0, 0] = x[2, 1, V - 1] = 100.0
    x[3] = rng.standard_normal((3, V))
    x[4, :, :] = -np.inf
    x[4, :, V - 2] = 0.0
    clean = np.where(np.isnan(x), 5.0, x)   # no NaN: the two-pass path
    for a in (x, clean):
        got = np.asarray(jax.jit(vocab_argmax)(jnp.asarray(a)))
        np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(a), axis=-1)))
