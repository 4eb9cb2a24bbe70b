"""Chain speculative sampling: the Pallas kernel (interpret mode) against the jnp reference,
and both against the distributions rejection sampling must produce.

Statistical bounds. With N independent draws over K categories, for every subset A of the
categories Hoeffding gives P(P_hat(A) - P(A) > t) <= exp(-2 N t^2); the total variation
distance is the largest such difference over the 2^K subsets, so by the union bound
P(TVD > t) <= 2^K exp(-2 N t^2) = delta for t = sqrt((K ln 2 + ln(1/delta)) / (2N)).
Every test uses delta = 1e-6 and fixed seeds (the draws are deterministic), so a correct
sampler fails a test with probability below 1e-6 over the choice of seeds, and a wrong one
(a distribution off by more than t in TVD) passes it with probability below 1e-6.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.analysis.distribution import empirical, tvd_bound
from pallas_kernels.rejection_sampling import (chain_speculative_sampling,
                                               chain_speculative_sampling_kernel,
                                               chain_speculative_sampling_reference,
                                               counter_uniform)

DELTA = 1e-6
reference = jax.jit(chain_speculative_sampling_reference)


def kernel(*args, chunk=1024):
    return chain_speculative_sampling_kernel(*args, interpret=True, chunk=chunk)


def draw(rng, probs, size=None):
    w = np.asarray(probs, np.float64)
    return rng.choice(len(w), size=size, p=w / w.sum())


def normalise(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return (x / x.sum()).astype(np.float32)


# (p, q) pairs over V = 6: the target p and the draft distribution q.
PAIRS = {
    "q_equals_p": (normalise([0.1, 0.2, 0.3, 0.15, 0.05, 0.2]),) * 2,
    "disjoint_supports": (normalise([0.5, 0.3, 0.2, 0, 0, 0]), normalise([0, 0, 0, 0.2, 0.3, 0.5])),
    "q_where_p_small": (normalise([0.4, 0.3, 0.2, 0.05, 0.04, 0.01]),
                        normalise([0.01, 0.01, 0.03, 0.05, 0.2, 0.7])),
    "sparse_p_uniform_q": (normalise([0, 0.5, 0, 0.5, 0, 0]), normalise([1] * 6)),
    "random": (normalise(np.random.default_rng(7).dirichlet(np.ones(6))),
               normalise(np.random.default_rng(8).dirichlet(np.ones(6)))),
}


def chain_inputs(p, q, n, d, rng, seed0=0, offset=0):
    """n requests with d drafts each drawn from q; the same p at every position."""
    V = len(p)
    drafts = draw(rng, q, size=(n, d)).astype(np.int32)
    return (np.broadcast_to(q, (n, d, V)).copy(), drafts, np.broadcast_to(p, (n, d + 1, V)).copy(),
            (np.arange(n) + seed0).astype(np.uint32), np.full((n,), offset, np.int32))


def sharp_probs(rng, shape, sharpness=3.0, dtype=np.float32):
    x = rng.normal(size=shape) * sharpness
    e = np.exp(x - x.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(dtype)


def ragged_batch(V=40, D=4, dtype=np.float32):
    """Rows covering every path: full/partial/zero draft_lens, q = p, disjoint supports, an
    all-zero residual (q = 2p, unnormalised), drafts outside q's and p's support, drafts out
    of the vocabulary (V + 3, and -1 which the reference wraps)."""
    rng = np.random.default_rng(1)
    B = 9
    q = sharp_probs(rng, (B, D, V)).astype(np.float32)
    p = sharp_probs(rng, (B, D + 1, V)).astype(np.float32)
    p[1, :D] = q[1]                                   # q = p: everything accepted
    p[2, :, : V // 2] = 0                             # disjoint supports
    q[2, :, V // 2:] = 0
    p[2] /= p[2].sum(-1, keepdims=True)
    q[2] /= q[2].sum(-1, keepdims=True)
    p[3, :, : V // 4] = 0                             # zeros in p (id 0 among them), and
    p[3] /= p[3].sum(-1, keepdims=True)
    q[3] = 2 * p[3, :D]                               # residual max(0, p - q) is all zero
    drafts = np.array([[draw(rng, q[b, i]) for i in range(D)] for b in range(B)], np.int32)
    q[4, 0, drafts[4, 0]] = 0                         # q = p = 0 at the draft: rejected,
    p[4, 0, drafts[4, 0]] = 0                         # then the residual p - q
    drafts[5] = [drafts[5, 0], V + 3, 0, 1]           # out of vocabulary: rejected
    drafts[6, 0] = -1
    draft_lens = np.array([4, 4, 4, 3, 4, 4, 4, 0, 2], np.int32)
    seeds = rng.integers(0, 2**32, size=B, dtype=np.uint64).astype(np.uint32)
    offsets = rng.integers(0, 10_000, size=B).astype(np.int32)
    return q.astype(dtype), drafts, p.astype(dtype), seeds, offsets, draft_lens


def check_contract(tokens, emitted, drafts, draft_lens, V):
    tokens, emitted = np.asarray(tokens), np.asarray(emitted)
    D = drafts.shape[1]
    assert tokens.shape == (drafts.shape[0], D + 1) and tokens.dtype == np.int32
    assert np.all((emitted >= 1) & (emitted <= np.minimum(draft_lens, D) + 1))
    for b in range(len(tokens)):
        n = emitted[b]
        assert np.array_equal(tokens[b, :n - 1], drafts[b, :n - 1])
        assert 0 <= tokens[b, n - 1] < V
        assert np.all(tokens[b, n:] == -1)


@pytest.mark.parametrize("chunk,dtype", [(16, np.float32), (1024, np.float32),
                                         (16, jnp.bfloat16)])
def test_kernel_equals_reference_on_ragged_rows(chunk, dtype):
    """V = 40 in chunks of 16 (a masked tail) or in one chunk, float32 and bfloat16."""
    q, drafts, p, seeds, offsets, draft_lens = ragged_batch(dtype=dtype)
    ref = reference(q, drafts, p, seeds, offsets, draft_lens)
    out = kernel(q, drafts, p, seeds, offsets, draft_lens, chunk=chunk)
    np.testing.assert_array_equal(out[0], ref[0])
    np.testing.assert_array_equal(out[1], ref[1])
    rows = [0, 1, 2, 3, 4, 5, 7, 8]  # row 6's draft -1 (wrapped, like the reference) may be emitted
    check_contract(np.asarray(out[0])[rows], np.asarray(out[1])[rows], drafts[rows],
                   draft_lens[rows], 40)
    emitted = np.asarray(out[1])
    assert emitted[1] == 5           # q = p at every draft: all accepted, plus the bonus
    assert emitted[7] == 1           # draft_lens 0: just the token from p
    assert emitted[4] == 1           # q = p = 0 at the first draft: rejected
    assert emitted[5] <= 2           # the second draft is out of the vocabulary
    # The zero-mass residual row falls back to p: its last token has p > 0 (a quarter of p is
    # zero, id 0 included, which an all-zero inverse-CDF draw would return).
    n = emitted[3]
    assert n <= draft_lens[3], "row 3 must reject a draft to reach its zero-mass residual"
    assert p[3, n - 1, np.asarray(out[0])[3, n - 1]] > 0


def test_kernel_equals_reference_on_many_random_rows():
    """512 rows, ragged draft_lens (0..D, and D+1 which counts as D), random offsets and
    seeds, V = 24 in 3 chunks."""
    rng = np.random.default_rng(2)
    B, D, V = 512, 3, 24
    q = sharp_probs(rng, (B, D, V), sharpness=1.5)
    p = sharp_probs(rng, (B, D + 1, V), sharpness=1.5)
    drafts = np.array([[draw(rng, q[b, i]) for i in range(D)] for b in range(B)], np.int32)
    seeds = rng.integers(0, 2**32, size=B, dtype=np.uint64).astype(np.uint32)
    offsets = rng.integers(0, 2**20, size=B).astype(np.int32)
    draft_lens = rng.integers(0, D + 2, size=B).astype(np.int32)  # D + 1: more than there are
    ref = reference(q, drafts, p, seeds, offsets, draft_lens)
    out = kernel(q, drafts, p, seeds, offsets, draft_lens, chunk=8)
    np.testing.assert_array_equal(out[0], ref[0])
    np.testing.assert_array_equal(out[1], ref[1])
    check_contract(out[0], out[1], drafts, draft_lens, V)
    # Some rows take each path: a rejection, all drafts accepted, draft_lens 0.
    emitted = np.asarray(out[1])
    assert np.any(emitted <= draft_lens) and np.any((emitted == D + 1))
    assert np.any(draft_lens == 0)


def test_no_drafts():
    rng = np.random.default_rng(3)
    B, V = 4, 10
    p = sharp_probs(rng, (B, 1, V))
    args = (np.zeros((B, 0, V), np.float32), np.zeros((B, 0), np.int32), p,
            np.arange(B, dtype=np.uint32), np.arange(B, dtype=np.int32))
    ref = reference(*args)
    out = kernel(*args)
    assert out[0].shape == (B, 1)
    np.testing.assert_array_equal(out[0], ref[0])
    np.testing.assert_array_equal(out[1], np.ones(B))


@pytest.mark.parametrize("name", list(PAIRS))
def test_first_token_follows_p(name):
    """D = 2 drafts from q; the first emitted token must follow p (reference, N = 200k; the
    interpret kernel, N = 50k, token-for-token equal to the reference on the same inputs),
    and so must the second one among rows that accepted the first draft."""
    p, q = PAIRS[name]
    V = len(p)
    n_ref, n_kernel = 200_000, 50_000
    args = chain_inputs(p, q, n_ref, 2, np.random.default_rng(10))
    tokens, emitted = map(np.asarray, reference(*args))
    tvd = 0.5 * np.abs(empirical(tokens[:, 0], V) - p).sum()
    assert tvd < tvd_bound(n_ref, V), (name, tvd, tvd_bound(n_ref, V))
    second = tokens[emitted >= 2, 1]
    if len(second) >= 1000:
        tvd2 = 0.5 * np.abs(empirical(second, V) - p).sum()
        assert tvd2 < tvd_bound(len(second), V), (name, tvd2, tvd_bound(len(second), V))

    kargs = tuple(a[:n_kernel] for a in args)
    ktokens, kemitted = map(np.asarray, kernel(*kargs))
    np.testing.assert_array_equal(ktokens, tokens[:n_kernel])
    np.testing.assert_array_equal(kemitted, emitted[:n_kernel])
    ktvd = 0.5 * np.abs(empirical(ktokens[:, 0], V) - p).sum()
    assert ktvd < tvd_bound(n_kernel, V), (name, ktvd, tvd_bound(n_kernel, V))


# Per-depth (p, q) over V = 6 for a chain of D = 3: every depth has its own target and draft
# distribution, so a bug that judges one depth with another depth's q (or p), reuses one
# uniform across depths, or corrects from p instead of the residual shows at that depth.
DEPTH_P = [normalise(np.random.default_rng(20 + k).dirichlet(np.ones(6) * 0.7)) for k in range(4)]
DEPTH_Q = [normalise(np.random.default_rng(30 + k).dirichlet(np.ones(6) * 0.7)) for k in range(3)]


@pytest.mark.parametrize("impl,n", [("reference", 300_000), ("kernel", 40_000)])
def test_each_depth_and_the_bonus_follow_their_own_p(impl, n):
    """Draft k is drawn from q_k; the token at index k (decided at depth k + 1, among rows that
    emitted it) must follow p_k, for k = 0..2, and the bonus after a full chain p_3. Each
    depth's TVD is held to the Hoeffding bound for its own sample size (module docstring)."""
    D, V = 3, 6
    rng = np.random.default_rng(21)
    q = np.broadcast_to(np.stack(DEPTH_Q), (n, D, V)).copy()
    p = np.broadcast_to(np.stack(DEPTH_P), (n, D + 1, V)).copy()
    drafts = np.stack([draw(rng, DEPTH_Q[k], size=n) for k in range(D)], 1).astype(np.int32)
    args = (q, drafts, p, np.arange(n, dtype=np.uint32) * 7 + 1, np.full((n,), 17, np.int32))
    tokens, emitted = map(np.asarray, (reference if impl == "reference" else kernel)(*args))
    for k in range(D + 1):
        rows = emitted >= k + 1
        got = tokens[rows, k]
        bound = tvd_bound(len(got), V)
        assert len(got) > n * 0.05 and bound < 0.05, (k, len(got))  # enough rows reach depth k
        tvd = 0.5 * np.abs(empirical(got, V) - DEPTH_P[k]).sum()
        assert tvd < bound, (impl, k, tvd, bound)


def test_zero_mass_residual_falls_back_to_p():
    """A draft neither distribution allows (q = p = 0 there) is always rejected, and with q = p
    the residual max(0, p - q) has no mass: the token must then follow p itself -- never one of
    p's zeros (ids 0, 3 and 7 here; an all-zero inverse-CDF draw would give id 0)."""
    n, V = 100_000, 8
    p = normalise([0, 0.3, 0.1, 0, 0.25, 0.05, 0.3, 0])
    q = p.copy()
    args = (np.broadcast_to(q, (n, 1, V)).copy(), np.full((n, 1), 3, np.int32),
            np.broadcast_to(p, (n, 2, V)).copy(), np.arange(n, dtype=np.uint32),
            np.full((n,), 5, np.int32))
    tokens, emitted = map(np.asarray, reference(*args))
    assert np.all(emitted == 1)
    assert not np.isin(tokens[:, 0], [0, 3, 7]).any()
    tvd = 0.5 * np.abs(empirical(tokens[:, 0], V) - p).sum()
    assert tvd < tvd_bound(n, V), tvd
    ktokens, _ = kernel(*(a[:4096] for a in args))
    np.testing.assert_array_equal(np.asarray(ktokens), tokens[:4096])


@pytest.mark.parametrize("name", ["q_where_p_small", "random"])
def test_number_accepted_is_geometric(name):
    """With the same (p, q) at every position, drafts are accepted independently with
    probability alpha = sum(min(p, q)): P(n = j) = alpha^j (1 - alpha) for j < D, alpha^D
    for j = D (N = 200k rows, D = 4, 5 categories)."""
    p, q = PAIRS[name]
    D, n = 4, 200_000
    alpha = float(np.minimum(p, q).sum())
    expected = np.array([alpha**j * (1 - alpha) for j in range(D)] + [alpha**D])
    args = chain_inputs(p, q, n, D, np.random.default_rng(11), seed0=123_456, offset=40)
    _, emitted = reference(*args)
    tvd = 0.5 * np.abs(empirical(np.asarray(emitted) - 1, D + 1) - expected).sum()
    assert tvd < tvd_bound(n, D + 1), (name, tvd, tvd_bound(n, D + 1))


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_one_hot_distributions_give_strict_acceptance(impl):
    """One-hot q and p: a draft is accepted iff it is the target's argmax, and the token after
    the accepted prefix is the target's argmax there (greedy verification), whatever the
    seeds."""
    rng = np.random.default_rng(4)
    B, D, V = 64, 4, 8
    drafts = rng.integers(0, V, size=(B, D)).astype(np.int32)
    target = rng.integers(0, V, size=(B, D + 1)).astype(np.int32)
    agree = rng.random((B, D)) < 0.75
    target[:, :D] = np.where(agree, drafts, target[:, :D])
    q = np.eye(V, dtype=np.float32)[drafts]
    p = np.eye(V, dtype=np.float32)[target]
    draft_lens = rng.integers(0, D + 1, size=B).astype(np.int32)
    args = (q, drafts, p, rng.integers(0, 2**31, size=B).astype(np.uint32),
            rng.integers(0, 1000, size=B).astype(np.int32), draft_lens)
    tokens, emitted = map(np.asarray, (reference if impl == "reference" else kernel)(*args))
    for b in range(B):
        n = 0
        while n < draft_lens[b] and drafts[b, n] == target[b, n]:
            n += 1
        expect = np.full(D + 1, -1)
        expect[:n] = drafts[b, :n]
        expect[n] = target[b, n]
        assert emitted[b] == n + 1
        np.testing.assert_array_equal(tokens[b], expect)


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_draft_lens_past_d_takes_the_bonus_from_p(impl):
    """draft_lens > D counts as D: with every draft accepted the bonus comes from p at
    position D, never from p minus the last draft's q. Here q at the last draft is one-hot on
    token 0 and p at the bonus position is half 0, half 1: subtracting q would never give 0."""
    rng = np.random.default_rng(6)
    B, D, V = 64, 4, 8
    drafts = rng.integers(0, V, size=(B, D)).astype(np.int32)
    drafts[:, -1] = 0
    q = np.eye(V, dtype=np.float32)[drafts]
    p = np.concatenate([q, np.zeros((B, 1, V), np.float32)], axis=1)
    p[:, D, :2] = 0.5
    args = (q, drafts, p, rng.integers(0, 2**31, size=B).astype(np.uint32),
            rng.integers(0, 1000, size=B).astype(np.int32), np.full(B, D + 1, np.int32))
    tokens, emitted = map(np.asarray, (reference if impl == "reference" else kernel)(*args))
    assert np.all(emitted == D + 1)
    np.testing.assert_array_equal(tokens[:, :D], drafts)
    assert set(np.unique(tokens[:, D])) == {0, 1}


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_row_output_does_not_depend_on_other_rows(impl):
    fn = reference if impl == "reference" else kernel
    q, drafts, p, seeds, offsets, draft_lens = ragged_batch(V=16)
    tokens, emitted = map(np.asarray, fn(q, drafts, p, seeds, offsets, draft_lens))
    # The same rows, permuted, inside a bigger batch whose other rows differ.
    rng = np.random.default_rng(5)
    B = len(seeds)
    perm = rng.permutation(B)
    extra = 5
    q2 = np.concatenate([q[perm], sharp_probs(rng, (extra,) + q.shape[1:])])
    p2 = np.concatenate([p[perm], sharp_probs(rng, (extra,) + p.shape[1:])])
    d2 = np.concatenate([drafts[perm], rng.integers(0, 16, size=(extra, drafts.shape[1]))])
    s2 = np.concatenate([seeds[perm], seeds[:extra]])  # even the same seeds elsewhere
    o2 = np.concatenate([offsets[perm], np.arange(extra)])
    l2 = np.concatenate([draft_lens[perm], np.full(extra, drafts.shape[1])])
    tokens2, emitted2 = map(np.asarray, fn(q2, d2.astype(np.int32), p2, s2.astype(np.uint32),
                                           o2.astype(np.int32), l2.astype(np.int32)))
    np.testing.assert_array_equal(tokens2[:B], tokens[perm])
    np.testing.assert_array_equal(emitted2[:B], emitted[perm])


def test_counter_uniform_streams_are_uniform_and_uncorrelated():
    """Uniforms for (seed, position, stream): uniform on [0, 1) (TVD over 16 bins), and
    neighbouring seeds, positions and the two streams uncorrelated (|r| < 6/sqrt(N), a
    >6-sigma event for independent streams)."""
    n = 100_000
    seeds = jnp.arange(n, dtype=jnp.uint32) * 7919 + 3
    u = np.asarray(counter_uniform(seeds, 5, 0))
    assert u.min() >= 0 and u.max() < 1
    tvd = 0.5 * np.abs(empirical(np.floor(u * 16).astype(int), 16) - 1 / 16).sum()
    assert tvd < tvd_bound(n, 16)
    others = {
        "next position": counter_uniform(seeds, 6, 0),
        "other stream": counter_uniform(seeds, 5, 1),
        "next seed": counter_uniform(seeds + 1, 5, 0),
        "position + 2^16": counter_uniform(seeds, 5 + 2**16, 0),
    }
    for name, v in others.items():
        r = np.corrcoef(u, np.asarray(v))[0, 1]
        assert abs(r) < 6 / math.sqrt(n), (name, r)
    # Counter values 2*position + stream never collide: position 5 stream 1 != position 6 stream 0.
    assert not np.array_equal(np.asarray(others["other stream"]), np.asarray(others["next position"]))


def test_different_offsets_give_independent_tokens():
    """Same seeds, p, q and drafts; offsets 0 and 1000 (no shared positions). Independent
    streams agree on the first token with probability sum_x q(x) sum_y P(y|x)^2 (computed
    exactly); a stream that ignored the offset would agree always."""
    p, q = PAIRS["q_where_p_small"]
    V, n = len(p), 100_000
    a = chain_inputs(p, q, n, 1, np.random.default_rng(12))
    b = a[:4] + (np.full((n,), 1000, np.int32),)
    t_a, t_b = (np.asarray(reference(*x)[0][:, 0]) for x in (a, b))
    accept = np.minimum(1, p / q)
    residual = np.maximum(p - q, 0) / np.maximum(p - q, 0).sum()
    cond = accept[:, None] * np.eye(V) + (1 - accept)[:, None] * residual[None, :]  # P(y | x)
    drafts = a[1][:, 0]
    expected = np.mean((cond[drafts] ** 2).sum(1))
    rate = np.mean(t_a == t_b)
    # Hoeffding on the agreement indicator (conditionally on the drafts): two-sided, delta.
    assert abs(rate - expected) < math.sqrt(math.log(2 / DELTA) / (2 * n)), (rate, expected)


def test_public_name_dispatches_to_reference_on_cpu_and_kernel_when_interpreting(monkeypatch):
    import pallas_kernels.rejection_sampling as rs
    q, drafts, p, seeds, offsets, draft_lens = ragged_batch(V=16)
    want = np.asarray(reference(q, drafts, p, seeds, offsets, draft_lens)[0])
    np.testing.assert_array_equal(
        chain_speculative_sampling(q, drafts, p, seeds, offsets, draft_lens, interpret=True)[0],
        want)
    if jax.default_backend() != "gpu":  # the plain call never reaches the kernel on CPU
        monkeypatch.setattr(rs, "chain_speculative_sampling_kernel",
                            lambda *a, **k: pytest.fail("kernel called on CPU"))
        out = jax.jit(rs.chain_speculative_sampling)(q, drafts, p, seeds, offsets, draft_lens)
        np.testing.assert_array_equal(out[0], want)
