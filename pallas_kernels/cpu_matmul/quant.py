"""GGUF's quantized blocks in the kernel's panel layout, each type at its own size, and the jnp
dequantization beside it.

A quantized weight `W [K, N]` (GGUF stores it `[N, K]`, each output's blocks along K) is
repacked once, at load, without a float copy, into panels of `PANEL` output columns and
super-blocks of `sb` inputs (the file's own block: 256 for the K types, 32 for the rest):
`packed [..., N / PANEL, K / sb, R]` uint8, R naming the type (`format_of`). A panel's
super-block row holds, for each sub-block of `qs` inputs (the inputs one scale covers), its
values a quad of k's at a time (the four k's an integer dot instruction sums into one lane):

    low plane   4 bits a value, 64 bytes a quad: byte 32 v + 4 j + e holds column 16 v + j
                (low nibble) and column 16 v + 8 + j (high nibble) at k + e
                (Q8_0: the int8 values, 128 bytes a quad, byte 32 v + 4 j + e column 8 v + j)
    high plane  Q5 types 1 bit, Q6_K 2 bits a value, in 32-byte chunks laid over a vector of
                the low plane: chunk c's byte 4 j + e holds, from bit ((2 t + v) * 2 + h) *
                high, the high bits of column 16 v + 8 h + j at k + e of quad 2 c + t (1 bit)
                or c (2 bits, t = 0) of the sub-block

then the sub-blocks' integer scales (K types: one byte a column and sub-block, Q6_K's signed)
and mins (Q4_K, Q5_K), then the super-block's half-precision d and (where the type has one)
dmin or m, `PANEL` of each. These are the file's fields, only regrouped by column panel, so a
step streams about the file's bytes:

    type   sb   qs  value   per sub-block     per super-block   W = q * scale + min
    Q8_0   32   32  int8    -                 d                 q d
    Q4_0   32   32  4       -                 d                 q d - 8 d
    Q4_1   32   32  4       -                 d, m              q d + m
    Q5_0   32   32  4+1     -                 d                 q d - 16 d
    Q5_1   32   32  4+1     -                 d, m              q d + m
    Q4_K   256  32  4       sc, m (6 bits)    d, dmin           q d sc - dmin m
    Q5_K   256  32  4+1     sc, m (6 bits)    d, dmin           q d sc - dmin m
    Q6_K   256  16  4+2     sc (int8)         d                 (q - 32) d sc

`d * sc` and `dmin * m` are exact in float32 (an 11-bit mantissa times a 6- or 8-bit integer),
so the kernel forms each column's scale and min from these fields as the `gguf` package's
dequantization does, and `q * scale + min` rounds once there and here: the same floats, bit
for bit. A parameter whose layers mix types (every `_K_M` file's `ffn_down` and `attn_v`)
keeps each layer in its own type: the loader hands such layers over one array each.
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
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # pack.cc's order


class Format(NamedTuple):
    qtype: str
    sb: int          # inputs (k) a super-block covers: the file's block
    qs: int          # inputs a sub-block's scale covers (x is rounded a block of qs at a time)
    high: int        # value bits above the low nibble: 0, 1 (Q5) or 2 (Q6_K); Q8_0: int8
    ints: int        # integer fields a column and sub-block: 0, 1 (Q6_K: sc), 2 (sc, m)
    halves: int      # half-precision fields a column and super-block: 1 (d) or 2 (d, dmin/m)

    @property
    def subs(self) -> int:
        return self.sb // self.qs

    @property
    def int8(self) -> bool:
        return self.qtype == "Q8_0"

    @property
    def sub_bytes(self) -> int:
        """Bytes of one sub-block's values (low and high planes)."""
        return self.qs * PANEL if self.int8 else self.qs * PANEL // 2 + self.qs * 4 * self.high

    @property
    def row_bytes(self) -> int:
        return self.subs * (self.sub_bytes + PANEL * self.ints) + 2 * PANEL * self.halves


FORMATS = {"Q8_0": Format("Q8_0", 32, 32, 0, 0, 1), "Q4_0": Format("Q4_0", 32, 32, 0, 0, 1),
           "Q4_1": Format("Q4_1", 32, 32, 0, 0, 2), "Q5_0": Format("Q5_0", 32, 32, 1, 0, 1),
           "Q5_1": Format("Q5_1", 32, 32, 1, 0, 2), "Q4_K": Format("Q4_K", 256, 32, 0, 2, 2),
           "Q5_K": Format("Q5_K", 256, 32, 1, 2, 2), "Q6_K": Format("Q6_K", 256, 16, 2, 1, 1)}
_BY_ROW = {f.row_bytes: f for f in FORMATS.values()}
assert len(_BY_ROW) == len(FORMATS)  # a row size names one type


def format_of(packed) -> Format | None:
    """The type of a packed quantized weight `[..., P, K / sb, R]` (uint8, or int8: the same
    bytes for 8-bit x, `with_8bit_x`; R names it), None for anything else (a float weight,
    packed or not)."""
    if getattr(packed, "ndim", 0) < 3 or np.dtype(packed.dtype) not in _BYTES:
        return None
    return _BY_ROW.get(packed.shape[-1])


_BYTES = (np.dtype(np.uint8), np.dtype(np.int8))


def x_bits(packed) -> int:
    """The bits the CPU kernel rounds x to against this quantized weight: 16 (a uint8 weight:
    within 0.05 logits of the float product on a 135M model) or 8 (int8: llama.cpp's Q8
    activations, half the byte products on AVX2 and VNNI, logits within a few tenths to units)."""
    _format(packed)
    return 8 if np.dtype(packed.dtype) == np.int8 else 16


def with_8bit_x(packed):
    """The same weight (its bytes viewed, not copied) multiplied with x rounded to 8 bits a
    value per block by the CPU kernel: the weight says how it is multiplied, so a step traced
    with it is its own compiled program. Elsewhere (the jnp paths) it is the same weight."""
    _format(packed)
    if isinstance(packed, np.ndarray):
        return packed.view(np.int8)
    return jax.lax.bitcast_convert_type(packed, jnp.int8)


def _as_bytes(packed):
    """A quantized weight's bytes as uint8, whichever x it asks for (the jnp paths' shifts
    and masks are on unsigned bytes)."""
    return packed if np.dtype(packed.dtype) == np.uint8 else \
        jax.lax.bitcast_convert_type(packed, jnp.uint8)


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
    p, nsb, _ = packed.shape[-3:]
    return nsb * f.sb, p * PANEL


def packed_bytes(qtype: str, k: int, n: int) -> int:
    """Bytes of a `[K, N]` weight of `qtype` packed (its file bytes but for the K types'
    6-bit sub-block scales, a byte each here: 1.03x for Q4_K)."""
    f = FORMATS[qtype]
    return n // PANEL * (k // f.sb) * f.row_bytes


# ---- GGUF blocks -> fields -> (q, scale, min) -----------------------------------------------

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
    return sc, mn


class Fields(NamedTuple):
    """A weight's GGUF fields, one output a row: values `[N, K]` (the low 4 bits, or Q8_0's
    int8), high bits `[N, K]`, integer scales and mins `[N, K / qs]`, the half fields' bits
    `[N, K / sb]` (d, and dmin or m; zeros where the type has none)."""
    low: np.ndarray
    high: np.ndarray
    sc: np.ndarray
    mn: np.ndarray
    d: np.ndarray
    d2: np.ndarray


def gguf_fields(raw: np.ndarray, qtype: str) -> Fields:
    """GGUF blocks `[N, bytes]` -> their `Fields`."""
    if qtype not in FORMATS:
        raise ValueError(f"quantized type {qtype!r} is not supported (supported: "
                         f"{', '.join(TYPES)})")
    n, per = raw.shape[0], BLOCK_BYTES[qtype]
    if raw.shape[-1] % per:
        raise ValueError(f"{qtype}: a row of {raw.shape[-1]} bytes is not whole blocks")
    b = np.asarray(raw, np.uint8).reshape(n, -1, per)
    half = lambda at: np.ascontiguousarray(b[..., at:at + 2]).view(np.uint16)[..., 0]
    zero16 = np.zeros(b.shape[:2], np.uint16)
    none = np.zeros((n, 0), np.uint8)
    flat = lambda a: a.reshape(n, -1)
    if qtype == "Q8_0":
        low = b[..., 2:].view(np.int8)
        return Fields(flat(low), flat(np.zeros(low.shape, np.uint8)), none, none, half(0), zero16)
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        one, five = qtype.endswith("_1"), qtype.startswith("Q5")
        start = 4 if one else 2
        qs = b[..., start + (4 if five else 0):]
        low = _nibbles(qs)
        high = np.zeros(low.shape, np.uint8)
        if five:  # qh: the 32 fifth bits, little-endian, element e at bit e
            qh = b[..., start:start + 4].copy().view("<u4")
            high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        return Fields(flat(low), flat(high), none, none, half(0),
                      half(2) if one else zero16)
    if qtype in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., 16:] if qtype == "Q4_K" else b[..., 48:]
        # 4 chunks of 64: 32 bytes, low nibbles the first sub-block, high the second.
        low = _nibbles(qs.reshape(n, -1, 4, 32)).reshape(n, -1, QK_K)
        high = np.zeros(low.shape, np.uint8)
        if qtype == "Q5_K":  # element e's fifth bit: bit e // 32 of qh[e % 32]
            qh = b[..., 16:48]
            high = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1)
            high = high.reshape(n, -1, QK_K)
        return Fields(flat(low), flat(high), flat(sc), flat(mn), half(0), half(2))
    # Q6_K: ql 128, qh 64, scales 16 (int8), d; two halves of 128: ql 64 bytes (nibbles),
    # qh 32 bytes (four 2-bit fields)
    ql, qh = b[..., :128], b[..., 128:192]
    low = _nibbles(ql.reshape(n, -1, 2, 64))
    high = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    return Fields(flat(low), flat(high.reshape(n, -1, 2, 128)),
                  flat(b[..., 192:208].view(np.int8)), none, half(208), zero16)


def unpack_blocks(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks `[N, bytes]` -> q `[N, K]` (int16), scale and min `[N, K / qs]` float32,
    with W^T = q * scale + min per sub-block of `FORMATS[qtype].qs`."""
    f, x = FORMATS.get(qtype), gguf_fields(raw, qtype)
    as_half = lambda bits: bits.view(np.float16).astype(np.float32)
    d, d2 = (np.repeat(as_half(a), f.subs, -1) for a in (x.d, x.d2))
    q = x.low.astype(np.int16) | (x.high.astype(np.int16) << 4)
    if qtype == "Q8_0":
        return q, d, np.zeros_like(d)
    if f.sb == 32:
        return q, d, (d2 if qtype.endswith("_1") else -(8 << f.high) * d)
    if qtype == "Q6_K":
        return q - 32, d * x.sc.astype(np.float32), np.zeros_like(d)
    return q, d * x.sc.astype(np.float32), -(d2 * x.mn.astype(np.float32))


def pack_gguf(raw: np.ndarray, qtype: str) -> np.ndarray:
    """GGUF blocks of a weight stored `[N, ...]` (N outputs, a whole number of panels) -> the
    packed `[N / PANEL, K / sb, R]` layout (module docstring). pack.cc does it in one pass
    where the kernel library is built; the numpy path beside it makes the same bytes."""
    out = aligned_empty((raw.shape[0] // PANEL, *_packed_tail(raw, qtype)), np.uint8)
    _pack_into(out, raw, qtype)
    return out


def _packed_tail(raw: np.ndarray, qtype: str) -> tuple[int, int]:
    """(K / sb, R) of `raw`'s weight packed."""
    if qtype not in FORMATS:
        raise ValueError(f"quantized type {qtype!r} is not supported (supported: "
                         f"{', '.join(TYPES)})")
    return raw.shape[-1] // BLOCK_BYTES[qtype], FORMATS[qtype].row_bytes


def _pack_into(out: np.ndarray, raw: np.ndarray, qtype: str) -> None:
    n = raw.shape[0]
    if n % PANEL:
        raise ValueError(f"a quantized weight needs a multiple of {PANEL} outputs, not {n}")
    pack = _native_pack()
    if pack is None:
        out[...] = pack_numpy(raw, qtype)
        return
    raw = np.ascontiguousarray(raw, np.uint8).reshape(n, -1)
    code = pack(raw.ctypes.data, n, raw.shape[1], TYPES.index(qtype), out.ctypes.data)
    if code:
        raise ValueError(f"pack.cc refused {qtype} [{n}, {raw.shape[1]} bytes] (code {code})")


def pack_numpy(raw: np.ndarray, qtype: str) -> np.ndarray:
    """`pack_gguf` in numpy: where pack.cc is not built, and what it is tested against."""
    if raw.shape[0] % PANEL:
        raise ValueError(f"a quantized weight needs a multiple of {PANEL} outputs, not "
                         f"{raw.shape[0]}")
    f, x = FORMATS.get(qtype), gguf_fields(raw, qtype)
    n, k = x.low.shape
    p, nsb = n // PANEL, k // f.sb
    # [P, column, nsb, subs, qs] -> [P, nsb, subs, qs, column]
    by_k = lambda a: a.reshape(p, PANEL, nsb, f.subs, f.qs).transpose(0, 2, 3, 4, 1)
    low = by_k(x.low.view(np.uint8))                      # [P, nsb, subs, qs, column]
    quads = lambda a: a.reshape(*a.shape[:-2], f.qs // 4, 4, *a.shape[-1:])
    if f.int8:  # [.., quad, e, v, j] -> [.., quad, v, j, e]
        planes = [quads(low).reshape(p, nsb, f.subs, f.qs // 4, 4, 4, 8)
                  .transpose(0, 1, 2, 3, 5, 6, 4).reshape(p, nsb, f.subs, -1)]
    else:       # [.., quad, e, v, h, j] -> nibble h of byte (v, j, e)
        v = quads(low).reshape(p, nsb, f.subs, f.qs // 4, 4, 2, 2, 8)
        v = v[..., 0, :] | (v[..., 1, :] << 4)              # [.., quad, e, v, j]
        planes = [v.transpose(0, 1, 2, 3, 5, 6, 4).reshape(p, nsb, f.subs, -1)]
    if f.high:
        per = 2 // f.high  # quads a chunk holds
        h = quads(by_k(x.high)).reshape(p, nsb, f.subs, f.qs // 4 // per, per, 4, 2, 2, 8)
        # [.., chunk, t, e, v, h, j] -> byte (j, e) of the chunk, bits ((2t + v) 2 + h) high
        t, v, hh = (np.arange(n).reshape(shape) for n, shape in
                    ((per, (-1, 1, 1, 1, 1)), (2, (1, 1, -1, 1, 1)), (2, (1, 1, 1, -1, 1))))
        shift = (((2 * t + v) * 2 + hh) * f.high).astype(np.uint8)
        bits = (h << shift).sum(axis=(-5, -3, -2), dtype=np.uint32).astype(np.uint8)  # [c, e, j]
        planes.append(bits.swapaxes(-1, -2).reshape(p, nsb, f.subs, -1))  # [.., c, j, e]
    subs = np.concatenate(planes, axis=-1).reshape(p, nsb, -1)
    side = lambda a, dt: np.ascontiguousarray(
        a.reshape(p, PANEL, nsb, -1).transpose(0, 2, 3, 1)).astype(dt).view(np.uint8)         .reshape(p, nsb, -1)
    parts = [subs]
    if f.ints:
        parts.append(side(x.sc.view(np.uint8), np.uint8))
    if f.ints == 2:
        parts.append(side(x.mn, np.uint8))
    parts.append(side(x.d, "<u2"))
    if f.halves == 2:
        parts.append(side(x.d2, "<u2"))
    return np.concatenate(parts, axis=-1)


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
                       ctypes.c_void_p]
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


# ---- jnp: dequantize, look up rows, the reference dot ------------------------------------

def _halves(raw: jax.Array, at: int) -> jax.Array:
    """`[..., R]` bytes -> the `PANEL` half fields from byte `at`, as float32 `[..., PANEL]`."""
    bits = raw[..., at:at + 2 * PANEL].reshape(*raw.shape[:-1], PANEL, 2)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _scale_min(f: Format, d, d2, sc, mn):
    """Each column's scale and min from its fields (float32 d, d2; sc, mn integers, broadcast
    alike): the products `unpack_blocks` forms, in its order."""
    if f.int8:
        return d, jnp.zeros_like(d)
    if f.sb == 32:
        return d, (d2 if f.halves == 2 else jnp.float32(-(8 << f.high)) * d)
    scale = d * sc.astype(jnp.float32)
    return scale, (jnp.zeros_like(scale) if f.ints == 1 else -(d2 * mn.astype(jnp.float32)))


def dequantize(packed: jax.Array) -> jax.Array:
    """`[..., P, nsb, R]` -> the float32 weight `[..., K, N]`."""
    f = _format(packed)
    packed = _as_bytes(packed)
    lead = packed.shape[:-1]                                   # [..., P, nsb]
    subs = packed[..., :f.subs * f.sub_bytes].reshape(*lead, f.subs, f.sub_bytes)
    g = f.qs // 4                                              # quads a sub-block
    to_k = lambda a: a.reshape(*lead, f.subs, f.qs, PANEL).astype(jnp.int32)
    if f.int8:  # [.., quad, v, j, e] -> [.., quad, e, v, j]
        low = subs[..., :f.qs * PANEL].reshape(*lead, f.subs, g, 4, 8, 4)
        q = to_k(jnp.moveaxis(jax.lax.bitcast_convert_type(low, jnp.int8), -1, -3))
    else:       # [.., quad, v, j, e], nibble h -> [.., quad, e, v, h, j]
        low = subs[..., :f.qs * PANEL // 2].reshape(*lead, f.subs, g, 2, 8, 4)
        low = jnp.stack([low & 0x0F, low >> 4], axis=-1)      # [.., quad, v, j, e, h]
        q = to_k(jnp.transpose(low, (*range(low.ndim - 5), -5, -2, -4, -1, -3)))
    if f.high:
        per = 2 // f.high
        chunks = subs[..., f.qs * PANEL // 2:].reshape(*lead, f.subs, g // per, 1, 1, 1, 8, 4)
        t, v, hh = (np.arange(n).reshape(shape) for n, shape in
                    ((per, (-1, 1, 1, 1, 1)), (2, (1, -1, 1, 1, 1)), (2, (1, 1, -1, 1, 1))))
        shift = (((2 * t + v) * 2 + hh) * f.high).astype(np.uint8)        # [t, v, h, 1, 1]
        bits = (chunks >> shift) & ((1 << f.high) - 1)           # [.., c, t, v, h, j, e]
        bits = jnp.transpose(bits, (*range(bits.ndim - 6), -6, -5, -1, -4, -3, -2))
        q = q | (to_k(bits) << 4)                                 # [.., c, t, e, v, h, j]
    if f.qtype == "Q6_K":
        q = q - 32
    at = f.subs * f.sub_bytes
    sc = packed[..., at:at + f.subs * PANEL].reshape(*lead, f.subs, 1, PANEL)
    if f.qtype == "Q6_K":
        sc = jax.lax.bitcast_convert_type(sc, jnp.int8)
    mn = packed[..., at + f.subs * PANEL:at + 2 * f.subs * PANEL].reshape(sc.shape) \
        if f.ints == 2 else sc
    h = at + f.subs * PANEL * f.ints
    d = _halves(packed, h)[..., None, None, :]
    d2 = _halves(packed, h + 2 * PANEL)[..., None, None, :] if f.halves == 2 else d
    scale, m = _scale_min(f, d, d2, sc, mn)
    w = q.astype(jnp.float32) * scale + m                    # [..., P, nsb, subs, qs, PANEL]
    *outer, p, nsb = lead
    w = jnp.moveaxis(w.reshape(*outer, p, nsb * f.sb, PANEL), -3, -2)
    return w.reshape(*outer, nsb * f.sb, p * PANEL)


def take_columns(packed: jax.Array, ids: jax.Array) -> jax.Array:
    """Columns `ids` of the weight, as rows: `W[:, ids].T`, `ids.shape + (K,)` float32 -- the
    token lookup of a tied embedding kept as its (packed) LM head. Only each column's own
    bytes are gathered: a step looks up one token a row."""
    f = _format(packed)
    packed = _as_bytes(packed)
    p, c = (ids // PANEL)[..., None, None], (ids % PANEL)[..., None, None]
    at = lambda offsets: packed[p, jnp.arange(packed.shape[-2])[:, None], offsets]
    k = np.arange(f.sb)
    j, kk = k // f.qs, k % f.qs                        # the sub-block, the k within it
    g, e = kk // 4, kk % 4                             # the quad, the k within it
    base = j * f.sub_bytes + e
    if f.int8:
        q = jax.lax.bitcast_convert_type(at(base + g * 4 * PANEL + 4 * c),
                                         jnp.int8).astype(jnp.int32)
    else:
        v, h, col = c // 16, (c // 8) % 2, c % 8
        q = (at(base + g * 2 * PANEL + PANEL * v + 4 * col) >> (4 * h).astype(jnp.uint8)) & 0x0F
        q = q.astype(jnp.int32)
        if f.high:
            per = 2 // f.high
            chunk = at(base + f.qs * PANEL // 2 + (g // per) * PANEL + 4 * col)
            shift = ((((g % per) * 2 + v) * 2 + h) * f.high).astype(jnp.uint8)
            q = q | (((chunk >> shift) & ((1 << f.high) - 1)).astype(jnp.int32) << 4)
    if f.qtype == "Q6_K":
        q = q - 32
    ints = f.subs * f.sub_bytes
    sc = at(ints + j * PANEL + c)
    if f.qtype == "Q6_K":
        sc = jax.lax.bitcast_convert_type(sc, jnp.int8)
    mn = at(ints + (f.subs + j) * PANEL + c) if f.ints == 2 else sc
    hat = ints + f.subs * PANEL * f.ints
    half = lambda off: jax.lax.bitcast_convert_type(
        at(off + 2 * c + np.arange(2)[None])[..., None, :], jnp.float16).astype(jnp.float32)
    d = half(hat)
    d2 = half(hat + 2 * PANEL) if f.halves == 2 else d
    scale, m = _scale_min(f, d, d2, sc, mn)
    return (q.astype(jnp.float32) * scale + m).reshape(*ids.shape, -1)


def quant_matmul_reference(x: jax.Array, packed: jax.Array) -> jax.Array:
    """x `[..., K]` @ the dequantized weight -> `[..., N]` float32, by XLA's dot: what runs
    where the kernel cannot (an accelerator, the kernel off or not built)."""
    return x.astype(jnp.float32) @ dequantize(packed)


def pack_gguf_stack(tensors, release=None) -> np.ndarray:
    """GGUF tensors `[(blocks [N, bytes], type), ...]` of one shape and one type (a
    parameter's layers) -> `[len, P, K / sb, R]`, written in place layer by layer (on threads:
    pack.cc runs without the GIL). A layer given as a list of tensors packs them side by side,
    their outputs concatenated (a fused `[gate | up]` made without a copy). `release(i)` is
    called once layer i is packed (the loader drops its file pages)."""
    layers = [t if isinstance(t, list) else [t] for t in tensors]
    types = {t for parts in layers for _, t in parts}
    if len(types) != 1:
        raise ValueError(f"one packed array holds one type, not {sorted(types)}: each layer "
                         "of a parameter that mixes types is packed alone")
    qtype = types.pop()
    tails = {_packed_tail(raw, qtype) for parts in layers for raw, _ in parts}
    rows = [[raw.shape[0] for raw, _ in parts] for parts in layers]
    if len(tails) > 1 or any(r != rows[0] for r in rows):
        raise ValueError(f"the layers' tensors differ in shape: {rows[0]} outputs and "
                         f"{sorted(tails)} blocks against {rows}")
    cuts = np.cumsum([0] + [n // PANEL for n in rows[0]])
    out = aligned_empty((len(layers), int(cuts[-1]), *tails.pop()), np.uint8)

    def one(i: int) -> None:
        for (raw, _), a, b in zip(layers[i], cuts[:-1], cuts[1:]):
            _pack_into(out[i, a:b], raw, qtype)
        if release is not None:
            release(i)

    with concurrent.futures.ThreadPoolExecutor(min(len(layers), os.cpu_count() or 1)) as pool:
        list(pool.map(one, range(len(layers))))
    return out
