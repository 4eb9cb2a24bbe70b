"""Quantized weights: GGUF's blocks repacked (`cpu_matmul.quant`), each type at about its file's
size, dequantize to exactly what the `gguf` package makes of them, and the kernel on them, every type x row counts 1..64 x every
instruction set, is within a stated bound of the gguf package's dequantization followed by a
float64 dot (`_quant_bound`), the same bit for bit on every instruction set and whatever rows
share a call.
"""
import ctypes

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from pallas_kernels import cpu_matmul
from pallas_kernels.cpu_matmul import PANEL, quant

ISAS = ("avx512vnni", "avx512", "avx2", "portable")
K = 512  # two K-type super-blocks; four 128-row kernel blocks


def gguf_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """`[n, bytes]` blocks of `qtype`: quantized random weights where the `gguf` package can
    quantize the type, else random bytes with small half-precision scales (how llama.cpp's
    K-quants look to a reader: any bit pattern of the fields is a valid block)."""
    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[qtype]
    if not qtype.endswith("_K"):
        return quantize(rng.standard_normal((n, k)).astype(np.float32), t)
    _, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    scales = (rng.uniform(0.001, 0.02, (n, k // 256, 2)).astype(np.float16)
              .view(np.uint8).reshape(n, k // 256, 4))
    if qtype == "Q6_K":
        raw[..., 208:210] = scales[..., :2]
    else:
        raw[..., 0:4] = scales
    return raw.reshape(n, -1)


def as_float(raw: np.ndarray, qtype: str) -> np.ndarray:
    """The gguf package's dequantization, as our `W [K, N]`."""
    t = gguf.GGMLQuantizationType[qtype]
    return dequantize(raw, t).reshape(raw.shape[0], -1).T.astype(np.float32)


def _lib():
    lib = ctypes.CDLL(str(cpu_matmul.library_path()))
    lib.specjax_matmul_run_quant.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                                             ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int32]
    return lib


@pytest.mark.parametrize("qtype", quant.TYPES)
def test_repacked_blocks_dequantize_to_the_gguf_packages_floats(qtype):
    raw = gguf_blocks(qtype, 64, K)
    packed = quant.pack_gguf(raw, qtype)
    f = quant.FORMATS[qtype]
    assert quant.format_of(packed) == f and packed.shape == (2, K // f.sb, f.row_bytes)
    # the file's bytes, regrouped: the K types' 6-bit sub-block scales take a byte each here
    assert raw.nbytes <= packed.nbytes <= raw.nbytes * (1.03 if qtype in ("Q4_K", "Q5_K") else 1)
    assert quant.weight_shape(packed) == (K, 64)
    w = as_float(raw, qtype)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(jnp.asarray(packed))), w)
    ids = jnp.asarray([[0, 5, 33], [63, 32, 2]])  # a tied embedding's lookup: W's columns
    np.testing.assert_array_equal(np.asarray(quant.take_columns(jnp.asarray(packed), ids)),
                                  w.T[np.asarray(ids)])


def test_a_stack_holds_one_type_and_refuses_a_mix_by_name():
    """A parameter whose layers mix types is not widened to one layout: the loader packs each
    such layer alone (tests/models/test_gguf_checkpoint.py), and a stack of them is refused."""
    tensors = [(gguf_blocks(t, 32, K, seed=i), t) for i, t in enumerate(("Q4_K", "Q6_K"))]
    with pytest.raises(ValueError, match=r"one type, not \['Q4_K', 'Q6_K'\]"):
        quant.pack_gguf_stack(tensors)
    for raw, t in tensors:
        (layer,) = quant.pack_gguf_stack([(raw, t)])
        assert quant.format_of(layer).qtype == t
        np.testing.assert_array_equal(np.asarray(quant.dequantize(jnp.asarray(layer))),
                                      as_float(raw, t))


@pytest.mark.skipif(quant._native_pack() is None, reason="the kernel library is not built")
@pytest.mark.parametrize("qtype", quant.TYPES)
def test_native_pack_makes_the_numpy_paths_bytes(qtype):
    """pack.cc (the loader's one pass over a file) against the numpy path, byte for byte, with
    GGUF's edge cases in the blocks: zero and negative scales, subnormal halves, every value."""
    raw = gguf_blocks(qtype, 2 * PANEL, K, seed=3)
    blocks = raw.reshape(2 * PANEL, -1, quant.BLOCK_BYTES[qtype])
    halves = np.array([0, 0x8000, 0x0001, 0x03FF, 0xBC00], np.uint16).view(np.uint8)
    at = 208 if qtype == "Q6_K" else 0
    for i in range(5):  # block 0 of rows 0..4: d = +0, -0, two subnormals, -1
        blocks[i, 0, at:at + 2] = halves[2 * i:2 * i + 2]
    native = quant.pack_gguf(raw, qtype)
    np.testing.assert_array_equal(native, quant.pack_numpy(raw, qtype))
    assert native.ctypes.data % 4096 == 0  # device_put shares it, no copy
    np.testing.assert_array_equal(np.asarray(quant.dequantize(jnp.asarray(native))),
                                  as_float(raw, qtype))
    other = gguf_blocks(qtype, PANEL, K, seed=5)  # a layer's parts side by side: [gate | up]
    fused = quant.pack_gguf_stack([[(raw, qtype), (other, qtype)]] * 2)
    np.testing.assert_array_equal(fused, np.stack([np.concatenate(
        [quant.pack_numpy(raw, qtype), quant.pack_numpy(other, qtype)])] * 2))


def _run_quant(lib, isa, x, packed, x_bits=16):
    f = quant.format_of(packed)
    k, n = quant.weight_shape(packed)
    y = np.full((x.shape[0], n), np.nan, np.float32)
    rc = lib.specjax_matmul_run_quant(isa.encode(), x.ctypes.data, packed.ctypes.data,
                                      f.row_bytes, y.ctypes.data, x.shape[0], k, n, x_bits)
    return None if rc == -1 else y


def _quant_bound(x, raw, qtype):
    """The kernel rounds each row's sub-block of x to a step of max |x_block| / 32258 (an
    error of at most half of it on each entry) and computes the rounded x times the weight
    exactly in integers (the min and offset terms take the rounded x's sum): that error times
    |w| summed, plus float rounding at most K + 2 K / qs deep on terms bounded by
    |x| @ (|q s| + |m|) (test_cpu_matmul.py's K * 2^-23 factor)."""
    q, scale, mn = quant.unpack_blocks(raw, qtype)
    f = quant.FORMATS[qtype]
    qs = np.abs(q * np.repeat(scale, f.qs, 1)).T                    # [K, N]
    size = qs + np.abs(np.repeat(mn, f.qs, 1)).T
    w = np.abs(q * np.repeat(scale, f.qs, 1) + np.repeat(mn, f.qs, 1)).T
    step = np.abs(x).reshape(len(x), -1, f.qs).max(-1) / 32258   # [M, nb]
    rounding = np.repeat(step / 2, f.qs, 1).astype(np.float64) @ w
    return rounding * (1 + 1e-6) + x.shape[1] * 2.0 ** -23 * (np.abs(x).astype(np.float64) @ size)


@pytest.mark.skipif(cpu_matmul.library_path() is None, reason="the kernel is not built")
@pytest.mark.parametrize("isa", ISAS)
def test_every_type_and_row_count_within_the_bound_and_alike_on_every_isa(isa):
    """Rows 1..16, 31, 47, 64 (every row group split), each type: within the bound of a
    float64 product with the gguf package's floats; a row's result the same alone or among
    others, and the same on every instruction set (the portable path's order), bit for bit."""
    lib, rng = _lib(), np.random.default_rng(1)
    x_all = rng.standard_normal((64, K)).astype(np.float32)
    for qtype in quant.TYPES:
        raw = gguf_blocks(qtype, 2 * PANEL, K)
        packed = np.ascontiguousarray(quant.pack_gguf(raw, qtype))
        w = as_float(raw, qtype)
        for m in (*range(1, 17), 31, 47, 64):
            x = x_all[:m]
            y = _run_quant(lib, isa, x, packed)
            if y is None:
                pytest.skip(f"this CPU has no {isa}")
            exact = x.astype(np.float64) @ w.astype(np.float64)
            assert np.all(np.abs(y - exact) <= _quant_bound(x, raw, qtype)), (qtype, isa, m)
            np.testing.assert_array_equal(y, _run_quant(lib, "portable", x, packed),
                                          err_msg=f"{qtype} {isa} rows={m}")
            np.testing.assert_array_equal(y[-1], _run_quant(lib, isa, x[-1:], packed)[0])


@pytest.mark.skipif(cpu_matmul.library_path() is None, reason="the kernel is not built")
@pytest.mark.parametrize("isa", ISAS)
def test_zero_rows_give_zeros_and_leave_the_others_alone(isa):
    """Padding rows (zeros) are skipped: +0 out, what the integer path gives a zero row, and
    the live rows bit-identical to a call without them, for every type."""
    lib, rng = _lib(), np.random.default_rng(4)
    x = rng.standard_normal((11, K)).astype(np.float32)
    dead = np.array([1, 2, 6, 10])
    x[dead] = 0.0
    live = np.setdiff1d(np.arange(11), dead)
    for qtype in quant.TYPES:
        packed = np.ascontiguousarray(quant.pack_gguf(gguf_blocks(qtype, PANEL, K), qtype))
        y = _run_quant(lib, isa, x, packed)
        if y is None:
            pytest.skip(f"this CPU has no {isa}")
        assert np.all(y[dead] == 0) and not np.signbit(y[dead]).any(), qtype
        np.testing.assert_array_equal(y[live], _run_quant(lib, isa, x[live], packed),
                                      err_msg=qtype)


@pytest.mark.skipif(cpu_matmul.library_path() is None, reason="the kernel is not built")
def test_jitted_custom_call_with_threads_and_rows_alone_or_together():
    assert cpu_matmul.available(), cpu_matmul.status()
    rng = np.random.default_rng(2)
    raw = gguf_blocks("Q4_1", 40 * PANEL, K)  # 40 panels: the thread split
    packed = jnp.asarray(quant.pack_gguf(raw, "Q4_1"))
    w = as_float(raw, "Q4_1")
    n = w.shape[1]
    f = jax.jit(cpu_matmul.matmul)
    assert "specjax_matmul_quant" in f.lower(jnp.ones((3, K)), packed).as_text()
    for lead in [(1,), (2, 3), (5, 1, 8)]:
        x = rng.standard_normal((*lead, K)).astype(np.float32)
        y = np.asarray(f(jnp.asarray(x), packed))
        assert y.shape == (*lead, w.shape[1])
        rows = x.reshape(-1, K)
        exact = rows.astype(np.float64) @ w.astype(np.float64)
        assert np.all(np.abs(y.reshape(-1, n) - exact) <= _quant_bound(rows, raw, "Q4_1"))
        np.testing.assert_array_equal(y.reshape(-1, w.shape[1])[-1],
                                      np.asarray(f(jnp.asarray(x.reshape(-1, K)[-1:]), packed))[0])
    # and the same as the kernel called from C on this thread
    flat = np.ascontiguousarray(x.reshape(-1, K))
    isa = cpu_matmul.status().removeprefix("kernel (").removesuffix(")")
    np.testing.assert_array_equal(y.reshape(-1, n),
                                  _run_quant(_lib(), isa, flat, np.asarray(packed)))


def test_not_built_dequantizes_and_dots(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "library_path", lambda: None)
    cpu_matmul._load.cache_clear()
    try:
        packed = jnp.asarray(quant.pack_gguf(gguf_blocks("Q8_0", PANEL, 64), "Q8_0"))
        x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 64)), jnp.float32)
        assert "specjax_matmul" not in jax.jit(cpu_matmul.matmul).lower(x, packed).as_text()
        np.testing.assert_allclose(cpu_matmul.matmul(x, packed), x @ quant.dequantize(packed),
                                   rtol=1e-6, atol=1e-6)
    finally:
        monkeypatch.undo()
        cpu_matmul._load.cache_clear()


def test_what_is_not_a_quantized_weight_is_refused_by_name():
    assert quant.format_of(jnp.ones((2, 3, PANEL))) is None  # a packed float weight
    assert quant.format_of(np.zeros((2, 3, 100), np.uint8)) is None  # no layout's row size
    with pytest.raises(ValueError, match="not supported"):
        quant.unpack_blocks(np.zeros((32, 18), np.uint8), "Q2_K")
    with pytest.raises(ValueError, match="multiple of 32 outputs"):
        quant.pack_gguf(gguf_blocks("Q8_0", 40, 64), "Q8_0")
    with pytest.raises(ValueError, match="do not match"):
        cpu_matmul.matmul(jnp.ones((2, 63)), jnp.asarray(quant.pack_gguf(
            gguf_blocks("Q8_0", PANEL, 64), "Q8_0")))


def test_an_accelerator_gets_the_dequantize_then_dot_path():
    """Lowered for CUDA (no GPU needed to lower), the step holds no CPU custom call: a GPU
    runs the same quantized model through jnp's dequantization and XLA's dot."""
    from jax import export
    packed = jnp.asarray(quant.pack_gguf(gguf_blocks("Q4_1", PANEL, 64), "Q4_1"))
    checks = [export.DisabledSafetyCheck.custom_call("specjax_matmul_quant")]
    lower = lambda platform: export.export(jax.jit(cpu_matmul.matmul), platforms=[platform],
                                           disabled_checks=checks)(jnp.ones((3, 64)), packed)
    assert "specjax_matmul" not in lower("cuda").mlir_module()
    if cpu_matmul.available():
        assert "specjax_matmul_quant" in lower("cpu").mlir_module()


@pytest.mark.skipif(cpu_matmul.library_path() is None, reason="the kernel is not built")
def test_8bit_x_alike_on_every_isa_rows_alone_or_together_and_within_its_bound():
    """x rounded to 8 bits (an int8 view of the weight, `quant.with_8bit_x`): the AVX2 path
    skips the zero low bytes, and still gives the portable path's results bit for bit, a row
    the same alone or among others, within the 16-bit bound with the step max |x| / 127."""
    lib = _lib()
    x = np.random.default_rng(7).standard_normal((5, K)).astype(np.float32)
    for qtype in quant.TYPES:
        raw = gguf_blocks(qtype, 64, K)
        packed = quant.pack_gguf(raw, qtype)
        base = _run_quant(lib, "portable", x, packed, 8)
        assert not np.array_equal(base, _run_quant(lib, "portable", x, packed, 16))
        for isa in ISAS:
            y = _run_quant(lib, isa, x, packed, 8)
            if y is None:
                continue
            np.testing.assert_array_equal(y, base, err_msg=f"{qtype} {isa}")
            np.testing.assert_array_equal(_run_quant(lib, isa, x[2:3], packed, 8), base[2:3])
        exact = x.astype(np.float64) @ as_float(raw, qtype).astype(np.float64)
        bound = _quant_bound(x, raw, qtype) * (32258 / 127)
        assert (np.abs(base - exact) <= bound).all(), qtype
    view = quant.with_8bit_x(packed)
    assert quant.x_bits(view) == 8 and quant.x_bits(packed) == 16
    np.testing.assert_array_equal(np.asarray(quant.dequantize(jnp.asarray(view))),
                                  np.asarray(quant.dequantize(jnp.asarray(packed))))
