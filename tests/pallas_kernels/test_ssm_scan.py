"""Mamba-2 selective scan: the sequential reference against a float64 numpy loop, the
per-position states, dt == 0 padding, the chunked (SSD) form, and the Pallas kernel
(interpret mode) against the reference."""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ssm_scan import (compiled_supported, ssm_scan, ssm_scan_chunked_reference,
                                     ssm_scan_kernel, ssm_scan_reference, ssm_scan_sequential,
                                     ssm_scan_states_reference)

B, H, P, N = 2, 4, 8, 16


def inputs(T, G=2, seed=0, P=P, dt_max=1.0, a_range=(0.2, 2.0)):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.normal(size=s).astype(np.float32)
    dt = rng.uniform(0.0, dt_max, size=(B, T, H)).astype(np.float32)
    A = -rng.uniform(*a_range, size=H).astype(np.float32)
    return f(B, T, H, P), dt, A, f(B, T, G, N), f(B, T, G, N), f(B, H, P, N)


def numpy_scan(x, dt, A, b, c, h0):
    """The recurrence, one (row, head, position) at a time, in float64."""
    x, dt, A, b, c, h0 = (np.asarray(v, np.float64) for v in (x, dt, A, b, c, h0))
    Bn, T, Hn, _ = x.shape
    per_group = Hn // b.shape[2]
    y = np.zeros(x.shape)
    h_final = h0.copy()
    for i in range(Bn):
        for h in range(Hn):
            g = h // per_group
            state = h0[i, h].copy()
            for t in range(T):
                state = (np.exp(dt[i, t, h] * A[h]) * state
                         + dt[i, t, h] * np.outer(x[i, t, h], b[i, t, g]))
                y[i, t, h] = state @ c[i, t, g]
            h_final[i, h] = state
    return y, h_final


reference = jax.jit(ssm_scan_reference)
sequential = jax.jit(ssm_scan_sequential)
states_reference = jax.jit(ssm_scan_states_reference)


def close(got, want, tol):
    for g, w in zip(got, want):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


@pytest.mark.parametrize("T", [1, 5, 37])
@pytest.mark.parametrize("G", [1, 2])
def test_reference_matches_numpy_loop(T, G):
    args = inputs(T, G, seed=T + G)
    close(sequential(*args), numpy_scan(*args), 1e-5)
    close(reference(*args), numpy_scan(*args), 1e-5)


def test_states_reference_is_the_state_after_every_position():
    T = 7
    args = inputs(T, G=2, seed=3)
    y_ref, h_ref = reference(*args)
    y, states = states_reference(*args)
    assert states.shape == (B, T, H, P, N)
    close((y, states[:, -1]), (y_ref, h_ref), 1e-5)
    # States differ from position to position (no constant answer passes the prefix check).
    assert np.abs(np.asarray(states[:, 1] - states[:, 0])).max() > 1e-2
    for t in range(T):
        prefix = [a[:, :t + 1] if a.ndim >= 3 else a for a in args[:5]] + [args[5]]
        close((states[:, t],), (sequential(*prefix)[1],), 1e-5)


def pad_with_dt_zero(args, extra, seed=9):
    """Append `extra` positions with dt = 0 and random (nonzero) x, b, c."""
    x, dt, A, b, c, h0 = args
    rng = np.random.default_rng(seed)
    more = lambda v: np.concatenate(
        [v, rng.normal(size=(v.shape[0], extra, *v.shape[2:])).astype(np.float32)], axis=1)
    dt = np.concatenate([dt, np.zeros((B, extra, H), np.float32)], axis=1)
    return more(x), dt, A, more(b), more(c), h0


SCANS = {
    "sequential": sequential,
    "reference": reference,
    "chunked": jax.jit(lambda *a: ssm_scan_chunked_reference(*a, chunk=4)),
    "kernel": lambda *a: ssm_scan_kernel(*a, interpret=True, chunk=16),
}


@pytest.mark.parametrize("name", list(SCANS))
def test_dt_zero_positions_leave_the_state_unchanged(name):
    scan = SCANS[name]
    args = inputs(5, G=2, seed=4)
    padded = pad_with_dt_zero(args, 14)       # 19 positions: across chunk boundaries
    y, h = scan(*args)
    y_pad, h_pad = scan(*padded)
    if name == "sequential":                  # exp(0) = 1 and 0 * outer = 0: exactly
        np.testing.assert_array_equal(np.asarray(h_pad), np.asarray(h))
    close((h_pad, y_pad[:, :5]), (h, y), 1e-5)
    # A dt = 0 position in the middle: the state after it is the state before it.
    x, dt, A, b, c, h0 = inputs(6, G=2, seed=5)
    dt[:, 3] = 0.0
    _, states = states_reference(x, dt, A, b, c, h0)
    close((states[:, 3],), (states[:, 2],), 1e-6)


@pytest.mark.parametrize("T,chunk", [(37, 16), (37, 1), (37, 64), (5, 2)])
def test_chunked_matches_sequential(T, chunk):
    args = inputs(T, G=2, seed=chunk)
    close(ssm_scan_chunked_reference(*args, chunk=chunk), sequential(*args), 1e-5)


def test_chunked_strong_decay_stays_finite():
    """A = -8, dt up to 2: the cumulative decay over a 64-chunk reaches exp(-1000); only
    exponents of differences of cumulative sums keep that finite."""
    args = inputs(70, G=1, seed=6, dt_max=2.0, a_range=(8.0, 8.0))
    close(ssm_scan_chunked_reference(*args, chunk=64), sequential(*args), 1e-5)


@pytest.mark.parametrize("T,G,chunk,block_p,p", [(37, 2, 16, None, P), (37, 1, None, None, P),
                                                 (1, 2, 16, None, P), (21, 4, 16, 16, 32)])
def test_kernel_matches_reference(T, G, chunk, block_p, p):
    """Interpret mode: T not a multiple of the chunk, G > 1, the default chunk, and P = 32
    in two blocks of 16 state rows."""
    args = inputs(T, G, seed=T + G, P=p)
    got = ssm_scan_kernel(*args, interpret=True, chunk=chunk, block_p=block_p)
    close(got, sequential(*args), 1e-4)


def test_kernel_strong_decay():
    """As for the chunked reference: finite, and as tight as it (segment sums taken as
    differences of cumulative sums would be ~1.5e-4 off here)."""
    args = inputs(70, G=2, seed=7, dt_max=2.0, a_range=(8.0, 8.0))
    close(ssm_scan_kernel(*args, interpret=True, chunk=64), sequential(*args), 1e-5)


def test_public_name_dispatch():
    args = inputs(9, G=2, seed=8)
    ref = reference(*args)
    close(ssm_scan(*args, interpret=True), ref, 1e-4)
    if jax.default_backend() != "gpu":
        for got, want in zip(jax.jit(ssm_scan)(*args), ref):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (list(inspect.signature(ssm_scan).parameters)
            == list(inspect.signature(ssm_scan_reference).parameters))


def test_compiled_support_rules():
    assert compiled_supported((2, 100, 8, 64), (2, 100, 1, 128))
    assert compiled_supported((2, 1, 4, 8), (2, 1, 2, 16))
    assert not compiled_supported((2, 100, 6, 64), (2, 100, 4, 128))    # H % G
    assert not compiled_supported((2, 100, 8, 64), (2, 100, 1, 1024))   # state too big
    assert not compiled_supported((2, 100, 8, 64), (2, 100, 1, 128), chunk=8)
    with pytest.raises(ValueError):
        ssm_scan_reference(*inputs(3, G=2)[:3], np.zeros((B, 3, 3, N), np.float32),
                           np.zeros((B, 3, 3, N), np.float32), np.zeros((B, H, P, N)))


def test_kernel_lowers_for_gpu():
    """Pallas -> Triton IR for a Mamba-2-like head (P = 64, N = 128) and a padded odd shape
    (no GPU needed, nothing run)."""
    S = jax.ShapeDtypeStruct
    for (Bn, T, Hn, Pn, G, Nn) in [(2, 100, 8, 64, 1, 128), (1, 37, 4, 8, 2, 20)]:
        f32 = lambda *s: S(s, jnp.float32)
        text = jax.jit(lambda *a: ssm_scan_kernel(*a, interpret=False)).trace(
            f32(Bn, T, Hn, Pn), f32(Bn, T, Hn), f32(Hn), f32(Bn, T, G, Nn), f32(Bn, T, G, Nn),
            f32(Bn, Hn, Pn, Nn)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
