"""GGUF's quantized blocks in the kernel's panel layout, and the jnp dequantization beside it.

A quantized weight `W [K, N]` (GGUF stores it `[N, K]`, each output's blocks along K) is
repacked once, at load, without ever making a float copy, into panels of `PANEL` output
columns and blocks of `qk` inputs: `packed [..., N / PANEL, K / qk, R]` bytes, each block row

    values: qk x PANEL, in pairs of k's (4 bits: PANEL / 2 bytes a k, byte j holding column
            j in its low nibble and column j + 16 in its high one; 8 bits: one int8 a
            column), the two k's of a pair interleaved byte by byte
    scale:  PANEL floats      min: PANEL floats        W[k, n] = q * scale + min

the floats float32, or float16 where GGUF's own scale and min are (the _0 and _1 types: a
half widens exactly, so the kernel's products are the same bit for bit, from fewer bytes),
so the kernel streams each panel front to back and widens a pair of k's `PANEL` integers to
the 16-bit pairs its integer dot instructions take with a few vector instructions, once for
every row of x (kernel.cc). Every type GGUF files use maps onto
it exactly: `scale * q` is exact in float32 for each (a half-precision scale, times at most an
8-bit integer, times a 6-bit one for the K types' sub-block scales), so `q * scale + min` rounds
once, where the `gguf` package's dequantization rounds once too: the same floats, bit for bit.

    type   values  qk   scale        min          floats   bytes a weight (file)
    Q8_0   int8    32   d            0            half     1.125  (1.0625)
    Q4_0   4 bits  32   d            -8 d         half     0.625  (0.5625)
    Q4_1   4 bits  32   d            m            half     0.625  (0.625)
    Q5_0   int8    32   d            -16 d        half     1.125  (0.6875)
    Q5_1   int8    32   d            m            half     1.125  (0.75)
    Q4_K   4 bits  32   d * sc       -dmin * m    float32  0.75   (0.5625)
    Q5_K   int8    32   d * sc       -dmin * m    float32  1.25   (0.6875)
    Q6_K   int8    16   d * sc       0            float32  1.5    (0.8125)

The dtype and the row size tell the formats apart: uint8 is 4 bits (R = 768, or 640 with
halves), int8 is 8 bits with qk 32 (R = 1280, or 1152 with halves) or 16 (R = 768).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_matmul.reference import PANEL

QK_K = 256  # a K type's super-block
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


class Format(NamedTuple):
    bits: int            # 4 (uint8, two values a byte) or 8 (int8)
    qk: int              # inputs (k) a scale and a min cover
    half: bool = False   # scales and mins in float16 (blocks of 32 only), else float32

    @property
    def value_bytes(self) -> int:
        """Bytes of values in one block row."""
        return self.qk * PANEL * self.bits // 8

    @property
    def float_bytes(self) -> int:
        return 2 if self.half else 4

    @property
    def float_dtype(self):
        return jnp.float16 if self.half else jnp.float32

    @property
    def row_bytes(self) -> int:
        return self.value_bytes + 2 * PANEL * self.float_bytes

    @property
    def dtype(self):
        return np.uint8 if self.bits == 4 else np.int8


FORMATS = {"Q8_0": Format(8, 32, True), "Q4_0": Format(4, 32, True),
           "Q4_1": Format(4, 32, True), "Q5_0": Format(8, 32, True), "Q5_1": Format(8, 32, True),
           "Q4_K": Format(4, 32), "Q5_K": Format(8, 32), "Q6_K": Format(8, 16)}
LAYOUTS = (Format(4, 32), Format(8, 32), Format(8, 16), Format(4, 32, True),
           Format(8, 32, True))  # what kernel.cc's quant_layout accepts


def format_of(packed) -> Format | None:
    """The layout of a packed quantized weight `[..., P, K / qk, R]`, None for anything else
    (a float weight, packed or not)."""
    if getattr(packed, "ndim", 0) < 3:
        return None
    dtype, r = np.dtype(packed.dtype), packed.shape[-1]
    for f in LAYOUTS:
        if dtype == f.dtype and r == f.row_bytes:
            return f
    return None


def is_quantized(w) -> bool:
    return format_of(w) is not None


def _format(packed) -> Format:
    f = format_of(packed)
    if f is None:
        raise ValueError(f"not a packed quantized weight: {getattr(packed, 'dtype', '')} "
                         f"{getattr(packed, 'shape', packed)}")
    return f


def weight_shape(packed) -> tuple[int, int]:
    """(K, N) of the weight `packed` holds."""
    f = _format(packed)
    p, nb, _ = packed.shape[-3:]
    return nb * f.qk, p * PANEL


# ---- GGUF blocks -> (q, scale, min) ---------------------------------------------------------

def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """`[..., n]` bytes -> `[..., 2n]`: the low nibbles, then the high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> the eight 6-bit sub-block scales and mins."""
    s = scales.reshape(*scales.shape[:-1], 3, 4).astype(np.uint8)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def unpack_blocks(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks `[N, bytes]` (one output's blocks a row) -> q `[N, K]` (int16), scale and min
    `[N, K / qk]` float32, with W^T = q * scale + min per sub-block of `FORMATS[qtype].qk`."""
    if qtype not in FORMATS:
        raise ValueError(f"quantized type {qtype!r} is not supported (supported: "
                         f"{', '.join(TYPES)})")
    n = raw.shape[0]
    per = BLOCK_BYTES[qtype]
    if raw.shape[-1] % per:
        raise ValueError(f"{qtype}: a row of {raw.shape[-1]} bytes is not whole blocks")
    b = np.asarray(raw, np.uint8).reshape(n, -1, per)
    if qtype == "Q8_0":
        d = _f16(b[..., 0:2])
        q = b[..., 2:].view(np.int8).astype(np.int16)
        scale, mn = d, np.zeros_like(d)
    elif qtype in ("Q4_0", "Q4_1"):
        d = _f16(b[..., 0:2])
        start = 2 if qtype == "Q4_0" else 4
        q = _nibbles(b[..., start:]).astype(np.int16)
        scale, mn = d, (-8 * d if qtype == "Q4_0" else _f16(b[..., 2:4]))
    elif qtype in ("Q5_0", "Q5_1"):
        # d (f16)[, m (f16)], qh: the 32 fifth bits (little-endian), qs: 16 bytes of nibbles
        d = _f16(b[..., 0:2])
        start = 2 if qtype == "Q5_0" else 4
        qh = b[..., start:start + 4].copy().view("<u4")                  # [n, nb, 1]
        high = (qh >> np.arange(32, dtype=np.uint32)) & 1                 # element e: bit e
        q = (_nibbles(b[..., start + 4:]) | (high.astype(np.uint8) << 4)).astype(np.int16)
        scale, mn = d, (-16 * d if qtype == "Q5_0" else _f16(b[..., 2:4]))
    elif qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, m = _k_scales(b[..., 4:16])
        if qtype == "Q4_K":
            # 4 chunks of 64: 32 bytes, low nibbles the first sub-block, high the second.
            q = _nibbles(b[..., 16:].reshape(n, -1, 4, 32)).reshape(n, -1, QK_K)
        else:
            qh, ql = b[..., 16:48], b[..., 48:]
            low = _nibbles(ql.reshape(n, -1, 4, 32)).reshape(n, -1, QK_K)
            # element e's fifth bit: bit e // 32 of qh[e % 32]
            high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            q = low | (high.reshape(n, -1, QK_K) << 4)
        q = q.astype(np.int16)
        scale, mn = d[..., None] * sc, -(dmin[..., None] * m)
    else:  # Q6_K: ql 128, qh 64, scales 16 (int8), d
        ql, qh = b[..., :128], b[..., 128:192]
        sc = b[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[..., 208:210])
        # two halves of 128: ql 64 bytes (nibbles), qh 32 bytes (four 2-bit fields)
        low = _nibbles(ql.reshape(n, -1, 2, 64))                       # [n, nb, 2, 128]
        high = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        q = (low | (high.reshape(n, -1, 2, 128) << 4)).astype(np.int16) - 32
        scale, mn = d[..., None] * sc, np.zeros(sc.shape, np.float32)
    return (q.reshape(n, -1), scale.reshape(n, -1).astype(np.float32),
            mn.reshape(n, -1).astype(np.float32))


def pack_gguf(raw: np.ndarray, qtype: str, f: Format | None = None) -> np.ndarray:
    """GGUF blocks of a weight stored `[N, ...]` (N outputs, a whole number of panels) -> the
    packed `[N / PANEL, K / qk, R]` layout (module docstring) of `f` (default: the type's own,
    `FORMATS[qtype]`; a wider one that holds it exactly, as `common_format` picks). pack.cc
    does it in one pass where the kernel library is built; the numpy path beside it makes the
    same bytes."""
    f = f or FORMATS[qtype]
    out = aligned_empty((raw.shape[0] // PANEL, *_packed_tail(raw, qtype, f)), f.dtype)
    _pack_into(out, raw, qtype, f)
    return out


def _packed_tail(raw: np.ndarray, qtype: str, f: Format) -> tuple[int, int]:
    """(K / qk, R) of `raw`'s weight packed as `f`."""
    if qtype not in FORMATS:
        raise ValueError(f"quantized type {qtype!r} is not supported (supported: "
                         f"{', '.join(TYPES)})")
    k = raw.shape[-1] // BLOCK_BYTES[qtype] * BLOCK_VALUES[qtype]
    return k // f.qk, f.row_bytes


def _pack_into(out: np.ndarray, raw: np.ndarray, qtype: str, f: Format) -> None:
    n = raw.shape[0]
    if n % PANEL:
        raise ValueError(f"a quantized weight needs a multiple of {PANEL} outputs, not {n}")
    pack = _native_pack()
    if pack is None:
        out[...] = pack_numpy(raw, qtype, f)
        return
    raw = np.ascontiguousarray(raw, np.uint8).reshape(n, -1)
    code = pack(raw.ctypes.data, n, raw.shape[1], TYPES.index(qtype), f.bits, f.qk,
                int(f.half), out.ctypes.data)
    if code == 2:
        raise ValueError("a scale or min is not a float16: this layout would round it")
    if code:
        raise ValueError(f"pack.cc refused {qtype} [{n}, {raw.shape[1]} bytes] as {f} "
                         f"(code {code})")


def pack_numpy(raw: np.ndarray, qtype: str, f: Format | None = None) -> np.ndarray:
    """`pack_gguf` in numpy: where pack.cc is not built, and what it is tested against."""
    f = f or FORMATS[qtype]
    q, scale, mn = unpack_blocks(raw, qtype)
    repeat = FORMATS[qtype].qk // f.qk
    return pack_values(q, np.repeat(scale, repeat, -1), np.repeat(mn, repeat, -1), f)


BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144,
               "Q5_K": 176, "Q6_K": 210}
BLOCK_VALUES = {t: 256 if t.endswith("_K") else 32 for t in TYPES}


@functools.cache
def _native_pack():
    """pack.cc's `specjax_pack_gguf` from the built kernel library, None where it is not built
    (or `SPECJAX_NATIVE_PACK=off`: the numpy path, for A/B runs)."""
    if os.environ.get("SPECJAX_NATIVE_PACK", "").lower() in ("0", "off", "false"):
        return None
    found = sorted(Path(__file__).parent.glob("_kernel*.so"))
    try:
        fn = ctypes.cdll.LoadLibrary(str(found[0])).specjax_pack_gguf if found else None
    except (OSError, AttributeError):  # a stale build without it
        return None
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return fn


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialized array on a page boundary: `jax.device_put` on a CPU then shares its
    memory instead of copying it (it copies a misaligned one), so a packed model is held
    once."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buf = np.empty(nbytes + _PAGE, np.uint8)
    at = -buf.ctypes.data % _PAGE
    return buf[at:at + nbytes].view(dtype).reshape(shape)


_PAGE = 4096


def pack_values(q: np.ndarray, scale: np.ndarray, mn: np.ndarray, f: Format) -> np.ndarray:
    """q `[N, K]`, scale and min `[N, K / qk]` -> `[N / PANEL, K / qk, R]`."""
    n, k = q.shape
    if n % PANEL:
        raise ValueError(f"a quantized weight needs a multiple of {PANEL} outputs, not {n}")
    p, nb = n // PANEL, k // f.qk
    # [P, PANEL, nb, qk] -> [P, nb, qk, PANEL]
    v = q.reshape(p, PANEL, nb, f.qk).transpose(0, 2, 3, 1)
    if f.bits == 4:
        v = v.astype(np.uint8)
        v = v[..., :PANEL // 2] | (v[..., PANEL // 2:] << 4)
    else:
        v = v.astype(np.int8).view(np.uint8)
    v = v.reshape(p, nb, f.qk // 2, 2, -1).swapaxes(-1, -2)  # a pair's bytes interleaved
    if f.half and not all(np.array_equal(a.astype(np.float16).astype(np.float32), a)
                          for a in (scale, mn)):
        raise ValueError("a scale or min is not a float16: this layout would round it")
    side = lambda a: np.ascontiguousarray(
        a.reshape(p, PANEL, nb).transpose(0, 2, 1).astype(f"<f{f.float_bytes}")).view(np.uint8)
    out = np.concatenate([v.reshape(p, nb, -1), side(scale), side(mn)], axis=-1)
    return out.view(f.dtype)


# ---- jnp: dequantize, look up rows, the reference dot ------------------------------------

def _split(packed: jax.Array) -> tuple[Format, jax.Array, jax.Array, jax.Array]:
    """packed `[..., P, nb, R]` -> (format, q float32 `[..., P, nb, qk, PANEL]`, scale and min
    `[..., P, nb, 1, PANEL]`)."""
    f = _format(packed)
    lead = packed.shape[:-1]
    raw = jax.lax.bitcast_convert_type(packed, jnp.uint8) if f.bits == 8 else packed
    width = PANEL * f.bits // 8  # bytes a k
    values = raw[..., :f.value_bytes].reshape(*lead, f.qk // 2, width, 2)
    values = jnp.swapaxes(values, -1, -2).reshape(*lead, f.qk, width)
    if f.bits == 4:
        q = jnp.concatenate([values & 0x0F, values >> 4], axis=-1).astype(jnp.float32)
    else:
        q = jax.lax.bitcast_convert_type(values, jnp.int8).astype(jnp.float32)
    floats = jax.lax.bitcast_convert_type(
        raw[..., f.value_bytes:].reshape(*lead, 2 * PANEL, f.float_bytes),
        f.float_dtype).astype(jnp.float32)
    scale = floats[..., None, :PANEL]
    mn = floats[..., None, PANEL:]
    return f, q, scale, mn


def dequantize(packed: jax.Array) -> jax.Array:
    """`[..., P, nb, R]` -> the float32 weight `[..., K, N]`."""
    f, q, scale, mn = _split(packed)
    w = q * scale + mn                                   # [..., P, nb, qk, PANEL]
    *lead, p, nb, qk, _ = w.shape
    w = jnp.moveaxis(w.reshape(*lead, p, nb * qk, PANEL), -3, -2)
    return w.reshape(*lead, nb * qk, p * PANEL)


def take_columns(packed: jax.Array, ids: jax.Array) -> jax.Array:
    """Columns `ids` of the weight, as rows: `W[:, ids].T`, `ids.shape + (K,)` float32 -- the
    token lookup of a tied embedding kept as its (packed) LM head. Only each column's own
    bytes are gathered: a step looks up one token a row."""
    f = _format(packed)
    raw = jax.lax.bitcast_convert_type(packed, jnp.uint8) if f.bits == 8 else packed
    p, c = (ids // PANEL)[..., None, None], (ids % PANEL)[..., None, None]
    blocks = jnp.arange(packed.shape[-2])[:, None]                        # [nb, 1]
    k = jnp.arange(f.qk)
    at = lambda byte: (k // 2) * 2 * (PANEL * f.bits // 8) + 2 * byte + k % 2  # in a pair
    if f.bits == 4:
        v = raw[p, blocks, at(c % (PANEL // 2))]                          # [..., nb, qk]
        q = (v >> (4 * (c // (PANEL // 2))).astype(jnp.uint8)) & 0x0F
    else:
        q = jax.lax.bitcast_convert_type(raw[p, blocks, at(c)], jnp.int8)
    size = f.float_bytes
    side = lambda at: jax.lax.bitcast_convert_type(
        raw[p, blocks, at + size * c + jnp.arange(size)],
        f.float_dtype).astype(jnp.float32)[..., None]  # [..., nb, 1]
    scale, mn = side(f.value_bytes), side(f.value_bytes + size * PANEL)
    return (q.astype(jnp.float32) * scale + mn).reshape(*ids.shape, -1)


def quant_matmul_reference(x: jax.Array, packed: jax.Array) -> jax.Array:
    """x `[..., K]` @ the dequantized weight -> `[..., N]` float32, by XLA's dot: what runs
    where the kernel cannot (an accelerator, the kernel off or not built)."""
    return x.astype(jnp.float32) @ dequantize(packed)


def common_format(formats) -> Format:
    """The one layout every one of `formats` converts to exactly: 8 bits if any is (a 4-bit
    value is an int8 too), blocks of 16 if any is (a block of 32 is two of 16, its scale and
    min repeated), half floats only if every one has them."""
    formats = list(formats)
    qk = min(f.qk for f in formats)
    return Format(max(f.bits for f in formats), qk, qk == 32 and all(f.half for f in formats))


def pack_gguf_stack(tensors, release=None) -> np.ndarray:
    """GGUF tensors `[(blocks [N, bytes], type), ...]` of one shape (a parameter's layers,
    whose types a file may mix) -> `[len, P, K / qk, R]` in their `common_format`, written in
    place layer by layer (on threads: pack.cc runs without the GIL). A layer given as a list
    of tensors packs them side by side, their outputs concatenated (a fused `[gate | up]`
    made without a copy). `release(i)` is called once layer i is packed (the loader drops
    its file pages)."""
    layers = [t if isinstance(t, list) else [t] for t in tensors]
    f = common_format(FORMATS[t] for parts in layers for _, t in parts)
    tails = {_packed_tail(raw, t, f) for parts in layers for raw, t in parts}
    rows = [[raw.shape[0] for raw, _ in parts] for parts in layers]
    if len(tails) > 1 or any(r != rows[0] for r in rows):
        raise ValueError(f"the layers' tensors differ in shape: {rows[0]} outputs and "
                         f"{sorted(tails)} blocks against {rows}")
    cuts = np.cumsum([0] + [n // PANEL for n in rows[0]])
    out = aligned_empty((len(layers), int(cuts[-1]), *tails.pop()), f.dtype)

    def one(i: int) -> None:
        for (raw, t), a, b in zip(layers[i], cuts[:-1], cuts[1:]):
            _pack_into(out[i, a:b], raw, t, f)
        if release is not None:
            release(i)

    with concurrent.futures.ThreadPoolExecutor(min(len(layers), os.cpu_count() or 1)) as pool:
        list(pool.map(one, range(len(layers))))
    return out
