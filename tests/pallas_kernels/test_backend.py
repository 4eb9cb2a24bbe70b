"""The kernel-or-reference dispatch, signature parity of the public names, and that every
kernel lowers for a CUDA GPU (Pallas -> Triton IR; no GPU needed, nothing is run)."""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backend
from pallas_kernels.kv_gather import (gather_kv_pages, gather_kv_pages_kernel,
                                      gather_kv_pages_reference, relocate_kv, relocate_kv_kernel,
                                      relocate_kv_reference)
from pallas_kernels.paged_attention import (paged_attention, paged_attention_kernel,
                                            paged_attention_reference)
from pallas_kernels.ssm_scan import ssm_scan, ssm_scan_reference
from pallas_kernels.rejection_sampling import (chain_speculative_sampling,
                                               chain_speculative_sampling_kernel,
                                               chain_speculative_sampling_reference)

PUBLIC = [(chain_speculative_sampling, chain_speculative_sampling_reference),
          (paged_attention, paged_attention_reference),
          (relocate_kv, relocate_kv_reference),
          (gather_kv_pages, gather_kv_pages_reference),
          (ssm_scan, ssm_scan_reference)]


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(backend.jax, "default_backend", lambda: "gpu")


@pytest.fixture(autouse=True)
def no_env_override(monkeypatch):
    monkeypatch.delenv("SPECJAX_PALLAS", raising=False)


def test_choose_on_cpu():
    if jax.default_backend() == "gpu":
        pytest.skip("CPU rules")
    assert backend.choose(None) == "reference"
    assert backend.choose(False) == "reference"
    assert backend.choose(True) == "interpret"
    assert backend.choose(True, supported=False) == "interpret"


def test_choose_on_gpu(on_gpu):
    assert backend.choose(None) == "kernel"
    assert backend.choose(False) == "kernel"
    assert backend.choose(None, supported=False) == "reference"
    assert backend.choose(True) == "interpret"


def test_environment_override(monkeypatch, on_gpu):
    monkeypatch.setenv("SPECJAX_PALLAS", "reference")
    assert backend.choose(None) == "reference"
    monkeypatch.setenv("SPECJAX_PALLAS", "interpret")
    assert backend.choose(None) == "interpret"
    monkeypatch.setenv("SPECJAX_PALLAS", "kernel")
    assert backend.choose(None) == "kernel"
    assert backend.choose(None, supported=False) == "interpret"
    monkeypatch.setenv("SPECJAX_PALLAS", "triton")
    with pytest.raises(ValueError, match="SPECJAX_PALLAS"):
        backend.choose(None)


def test_dispatch_calls_the_chosen_implementation(monkeypatch):
    calls = []
    kernel = lambda x, *, interpret: calls.append(("kernel", interpret)) or x
    reference = lambda x: calls.append(("reference",)) or x
    backend.dispatch(kernel, reference, 1, interpret=True)
    monkeypatch.setattr(backend.jax, "default_backend", lambda: "gpu")
    backend.dispatch(kernel, reference, 1)
    backend.dispatch(kernel, reference, 1, supported=False)
    monkeypatch.setattr(backend.jax, "default_backend", lambda: "cpu")
    backend.dispatch(kernel, reference, 1)
    assert calls == [("kernel", True), ("kernel", False), ("reference",), ("reference",)]


@pytest.mark.parametrize("public,reference", PUBLIC)
def test_public_signature_is_the_reference_signature(public, reference):
    """Same parameters, kinds and defaults as the reference (which has `interpret` too), so
    callers never change when the implementation does."""
    got = inspect.signature(public).parameters
    want = inspect.signature(reference).parameters
    assert list(got) == list(want)
    for name in want:
        assert got[name].kind == want[name].kind and got[name].default == want[name].default
    assert "interpret" in got


def test_public_paged_attention_uses_the_reference_for_unsupported_shapes_on_gpu(
        on_gpu, monkeypatch):
    """head_dim 8 is below the GPU dot minimum: even on a GPU the reference runs."""
    import pallas_kernels.paged_attention as pa
    monkeypatch.setattr(pa, "paged_attention_kernel",
                        lambda *a, **k: pytest.fail("kernel called for unsupported shapes"))
    q = jnp.ones((1, 1, 2, 8))
    pool = jnp.ones((1, 3, 1, 4, 8))
    out = pa.paged_attention(q, pool, pool, 0, jnp.ones((1, 1), jnp.int32),
                             jnp.zeros((1, 1), jnp.int32), jnp.ones(1, jnp.int32))
    np.testing.assert_allclose(np.asarray(out), 1.0)


def _lowers_to_triton(fn, *shapes):
    """Lower `fn` for CUDA without a GPU; the Pallas Triton lowering runs in full."""
    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("__gpu$xla.gpu.triton")


S = jax.ShapeDtypeStruct


def test_sampling_kernel_lowers_for_gpu():
    B, D, V = 4, 5, 32_000  # V not a multiple of the chunk: masked tail
    n = _lowers_to_triton(
        lambda *a: chain_speculative_sampling_kernel(*a, interpret=False),
        S((B, D, V), jnp.bfloat16), S((B, D), jnp.int32), S((B, D + 1, V), jnp.bfloat16),
        S((B,), jnp.uint32), S((B,), jnp.int32), S((B,), jnp.int32))
    assert n == 1


def test_paged_attention_kernel_lowers_for_gpu():
    B, T, H, KV, hd, bs, L, N, M = 4, 6, 32, 8, 128, 16, 2, 512, 40
    n = _lowers_to_triton(
        lambda q, k, v, bt, pos, ctx, w: paged_attention_kernel(q, k, v, 1, bt, pos, ctx, w,
                                                                interpret=False),
        S((B, T, H, hd), jnp.bfloat16), S((L, N, KV, bs, hd), jnp.bfloat16),
        S((L, N, KV, bs, hd), jnp.bfloat16), S((B, M), jnp.int32), S((B, T), jnp.int32),
        S((B,), jnp.int32), S((), jnp.int32))
    assert n == 1


def test_kv_kernels_lower_for_gpu():
    L, N, KV, bs, hd, B, R, M = 4, 64, 3, 16, 96, 3, 5, 7  # a token's [3, 96]: masked tile
    pool = S((L, N, KV, bs, hd), jnp.bfloat16)
    idx = S((B, R), jnp.int32)
    assert _lowers_to_triton(lambda *a: relocate_kv_kernel(*a, interpret=False), pool, pool,
                             idx, idx, idx, idx, S((B,), jnp.int32)) == 2
    assert _lowers_to_triton(lambda p, l, t: gather_kv_pages_kernel(p, l, t, interpret=False),
                             pool, S((), jnp.int32), S((B, M), jnp.int32)) == 1
