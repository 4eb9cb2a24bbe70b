"""The CPU matmul kernel against its reference: every row count 1..64, awkward K and N, every
instruction set this CPU has, threads, and the fallback when the kernel is off or not built.

Error bound: a float32 dot of length K summed in any order is within gamma_K * (|x| @ |W|)
of the exact product, gamma_K = K * 2^-24 / (1 - K * 2^-24) (Higham, Accuracy and Stability of
Numerical Algorithms, 3.1); the checks use K * 2^-23, twice that, against a float64 product.
"""
import ctypes
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_matmul
from pallas_kernels.cpu_matmul import PANEL, matmul, matmul_reference, pack_weight, unpack_weight

pytestmark = pytest.mark.skipif(cpu_matmul.library_path() is None,
                                reason="the kernel is not built (no compiler at install)")

ISAS = ("avx512vnni", "avx512", "avx2", "portable")
# (K, N): decode shapes in miniature, and the awkward ones: one column, a panel and one, a
# K of one, K not a multiple of the 128-row block.
SHAPES = [(64, 96), (129, 33), (1, 70), (7, 1), (300, 31), (256, 200)]


def _lib():
    lib = ctypes.CDLL(str(cpu_matmul.library_path()))
    lib.specjax_matmul_run.restype = ctypes.c_int
    lib.specjax_matmul_run.argtypes = [ctypes.c_char_p] + [ctypes.c_void_p] * 3 + \
        [ctypes.c_int64] * 3
    return lib


def _run(lib, isa, x, packed, n):
    y = np.full((x.shape[0], n), np.nan, np.float32)
    rc = lib.specjax_matmul_run(isa.encode(), x.ctypes.data, packed.ctypes.data, y.ctypes.data,
                                x.shape[0], x.shape[1], n)
    return None if rc else y


def _within_bound(y, x, w):
    exact = x.astype(np.float64) @ w.astype(np.float64)
    bound = x.shape[1] * 2.0 ** -23 * (np.abs(x).astype(np.float64) @ np.abs(w))
    return np.all(np.abs(y - exact) <= bound + 1e-30)


def test_pack_roundtrip_and_layout():
    w = jnp.arange(5 * 70, dtype=jnp.float32).reshape(5, 70)
    packed = pack_weight(w)
    assert packed.shape == (3, 5, PANEL)
    assert packed[1, 2, 3] == w[2, PANEL + 3]
    assert np.all(np.asarray(packed[2, :, 70 - 2 * PANEL:]) == 0)  # the last panel's padding
    np.testing.assert_array_equal(unpack_weight(packed, 70), w)
    stacked = pack_weight(jnp.stack([w, w + 1]))  # stacked layers keep their leading axis
    assert stacked.shape == (2, 3, 5, PANEL)
    np.testing.assert_array_equal(stacked[1], pack_weight(w + 1))


@pytest.mark.parametrize("isa", ISAS)
def test_every_row_count_and_awkward_shape_within_the_bound(isa):
    lib, rng = _lib(), np.random.default_rng(0)
    for k, n in SHAPES:
        w = rng.standard_normal((k, n)).astype(np.float32)
        packed = np.asarray(pack_weight(jnp.asarray(w)))
        x_all = rng.standard_normal((64, k)).astype(np.float32)
        for m in range(1, 65):
            y = _run(lib, isa, x_all[:m], packed, n)
            if y is None:
                pytest.skip(f"this CPU has no {isa}")
            assert _within_bound(y, x_all[:m], w), (isa, k, n, m)
            # A row's result does not depend on the rows beside it, bit for bit: a verify
            # step's logits equal the plain step's.
            np.testing.assert_array_equal(y, _run(lib, isa, x_all[:m], packed, n)[:m])
            np.testing.assert_array_equal(y[-1], _run(lib, isa, x_all[m - 1:m], packed, n)[0])


@pytest.mark.parametrize("isa", ISAS)
def test_zero_rows_give_zeros_and_leave_the_others_alone(isa):
    """A step's padding rows arrive as zeros and are skipped: their outputs +0 (what the FMA
    chain gives), the rows between them bit-identical to a run without any zero row."""
    lib, rng = _lib(), np.random.default_rng(3)
    k, n = 300, 70
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = np.asarray(pack_weight(jnp.asarray(w)))
    x = rng.standard_normal((20, k)).astype(np.float32)
    dead = np.array([0, 3, 4, 5, 9, 19])
    x[dead] = 0.0
    x[4, ::2] = -0.0
    y = _run(lib, isa, x, packed, n)
    if y is None:
        pytest.skip(f"this CPU has no {isa}")
    live = np.setdiff1d(np.arange(20), dead)
    np.testing.assert_array_equal(y[dead], np.zeros((len(dead), n), np.float32))
    assert not np.signbit(y[dead]).any()
    np.testing.assert_array_equal(y[live], _run(lib, isa, x[live], packed, n))


def test_no_rows_and_no_depth():
    lib = _lib()
    assert _run(lib, "portable", np.zeros((0, 4), np.float32),
                np.zeros((1, 4, PANEL), np.float32), 5).shape == (0, 5)
    y = _run(lib, "portable", np.zeros((3, 0), np.float32), np.zeros((1, 0, PANEL), np.float32), 5)
    np.testing.assert_array_equal(y, np.zeros((3, 5), np.float32))


def test_jitted_custom_call_equals_the_reference_with_threads():
    """Through XLA: large enough for the thread split, rows of any leading shape, and the
    result the reference's up to rounding (the same bound)."""
    assert cpu_matmul.status().startswith("kernel"), cpu_matmul.status()
    rng = np.random.default_rng(1)
    k, n = 256, 64 * PANEL + 5  # 65 panels over the pool's threads; a partial last panel
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = pack_weight(jnp.asarray(w))
    f = jax.jit(matmul, static_argnums=2)
    for lead in [(1,), (2, 3), (5, 1, 8)]:
        x = rng.standard_normal((*lead, k)).astype(np.float32)
        y = np.asarray(f(jnp.asarray(x), packed, n))
        assert y.shape == (*lead, n)
        assert _within_bound(y.reshape(-1, n), x.reshape(-1, k), w)
        ref = np.asarray(jax.jit(matmul_reference, static_argnums=2)(jnp.asarray(x), packed, n))
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-4)
        # rows alone equal rows together through the threaded path too
        np.testing.assert_array_equal(y.reshape(-1, n)[-1],
                                      np.asarray(f(jnp.asarray(x.reshape(-1, k)[-1:]), packed, n))[0])


def test_shapes_that_do_not_match_are_refused():
    packed = pack_weight(jnp.ones((8, 40)))
    with pytest.raises(ValueError, match="do not match"):
        matmul(jnp.ones((2, 9)), packed)
    with pytest.raises(ValueError, match="do not match"):
        matmul(jnp.ones((2, 8)), packed, n=100)


@pytest.mark.parametrize("env, expect", [({"SPECJAX_CPU_MATMUL": "xla"}, "xla (SPECJAX_CPU_MATMUL=xla)"),
                                         ({"SPECJAX_MATMUL_ISA": "portable"}, "kernel (portable)")])
def test_status_follows_the_environment(env, expect):
    code = "from pallas_kernels import cpu_matmul; print(cpu_matmul.status())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == expect


def test_not_built_falls_back_to_the_reference(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "library_path", lambda: None)
    cpu_matmul._load.cache_clear()
    try:
        assert cpu_matmul.status().startswith("xla (not built")
        assert not cpu_matmul.available()
        w = jnp.asarray(np.random.default_rng(2).standard_normal((16, 64)), jnp.float32)
        x = jnp.ones((3, 16))
        lowered = jax.jit(matmul).lower(x, pack_weight(w)).as_text()
        assert "specjax_matmul" not in lowered  # XLA's dot, not the custom call
        np.testing.assert_allclose(matmul(x, pack_weight(w)), x @ w, rtol=1e-6, atol=1e-6)
    finally:
        monkeypatch.undo()
        cpu_matmul._load.cache_clear()
    # (other shapes: jit reuses a function traced before with the same ones)
    assert "specjax_matmul" in jax.jit(matmul).lower(jnp.ones((4, 16)),
                                                      pack_weight(jnp.ones((16, 64)))).as_text()
