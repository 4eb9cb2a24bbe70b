"""A CPU matmul for decode-shaped rows that reads each weight once: `matmul(x, packed)`.

`kernel.cc`, a `jax.ffi` custom call built by `pip install` (setup.py; optional: no compiler,
no kernel), computes `x [..., K] @ W [K, N]` with `W` packed once at load
(`reference.pack_weight`), inside the compiled step like any other op. `reference.py` holds the
layout and the jnp dot it is tested against, which runs wherever the kernel cannot:
`status()` says which and why. A GGUF's quantized weights take the same kernel in their own
packed layout (`quant.py`; the products in integers, x rounded to about 16 bits a block);
`quant.quant_matmul_reference` (dequantize, then XLA's dot) runs where the kernel cannot.
`SPECJAX_CPU_MATMUL=xla` turns the kernel off (A/B runs), and
`SPECJAX_MATMUL_ISA=avx512vnni|avx512|avx2|portable` narrows the instruction set it picks at
run time.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_matmul import quant
from pallas_kernels.cpu_matmul.reference import (PANEL, matmul_reference, num_panels,
                                                 pack_weight, unpack_weight)

__all__ = ["PANEL", "available", "collapse_to_huge_pages", "library_path", "matmul",
           "matmul_reference", "num_panels", "pack_weight", "quant", "status", "unpack_weight"]

_TARGET = "specjax_matmul_f32"
_TARGET_QUANT = "specjax_matmul_quant"
_ENV = "SPECJAX_CPU_MATMUL"


def library_path() -> Path | None:
    """The built kernel (`_kernel.<python tag>.so` beside this file), None when not built."""
    found = sorted(Path(__file__).parent.glob("_kernel*.so"))
    return found[0] if found else None


@functools.cache
def _load() -> tuple[str | None, str]:
    """(instruction set, "") once the custom call is registered, else (None, why not)."""
    path = library_path()
    if path is None:
        return None, ("not built (pip install -e . compiles it; it needs a C++ compiler, "
                      "and installs without one)")
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        lib.specjax_matmul_isa.restype = ctypes.c_char_p
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.SpecjaxMatmulF32),
                                    platform="cpu")
        jax.ffi.register_ffi_target(_TARGET_QUANT, jax.ffi.pycapsule(lib.SpecjaxMatmulQuant),
                                    platform="cpu")
        return lib.specjax_matmul_isa().decode(), ""
    except (OSError, AttributeError, ValueError) as e:  # a stale or foreign build
        return None, f"{path.name} did not load: {e}"


def status() -> str:
    """What `matmul` runs on this machine: "kernel (avx512vnni)" / "kernel (avx512)" /
    "kernel (avx2)" / "kernel (portable)", or "xla (<why>)"."""
    if os.environ.get(_ENV, "").lower() == "xla":
        return f"xla ({_ENV}=xla)"
    isa, why = _load()
    if isa == "portable" and os.environ.get("SPECJAX_MATMUL_ISA") != "portable":
        # Plain C++ with no vector code of its own: a check of the layout and the threads,
        # not something to run in place of XLA's vectorised dot.
        return "xla (no AVX2 or AVX-512 on this CPU)"
    return f"kernel ({isa})" if isa else f"xla ({why})"


def available() -> bool:
    """Whether the kernel is built, loads and is not turned off by SPECJAX_CPU_MATMUL=xla."""
    return status().startswith("kernel")


def matmul(x: jax.Array, packed: jax.Array, n: int | None = None) -> jax.Array:
    """x `[..., K]` @ the packed weight `[P, K, PANEL]` (or a quantized one, `quant.py`) ->
    `[..., n]` (n: P * PANEL), in float32, cast back to x's dtype. The kernel where it is
    loaded, else `matmul_reference` (`quant.quant_matmul_reference`)."""
    if quant.is_quantized(packed):
        return _quant_matmul(x, packed)
    *lead, k = x.shape
    p, pk, panel = packed.shape
    n = p * PANEL if n is None else n
    if panel != PANEL or pk != k or not 0 <= p * PANEL - n < PANEL:
        raise ValueError(f"matmul: x {x.shape} and packed weight {packed.shape} (n={n}) "
                         f"do not match")
    if packed.dtype != jnp.float32 or not available():
        return matmul_reference(x, packed, n)
    rows = x.reshape(-1, k).astype(jnp.float32)
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(rows, packed).reshape(*lead, n).astype(x.dtype)


def _quant_matmul(x: jax.Array, packed: jax.Array) -> jax.Array:
    *lead, k = x.shape
    wk, n = quant.weight_shape(packed)
    if packed.ndim != 3 or wk != k:
        raise ValueError(f"matmul: x {x.shape} and quantized weight {packed.shape} (K={wk}) "
                         "do not match")
    rows = x.reshape(-1, k).astype(jnp.float32)
    if available():
        call = jax.ffi.ffi_call(_TARGET_QUANT, jax.ShapeDtypeStruct((rows.shape[0], n),
                                                                     jnp.float32),
                                vmap_method="sequential")
        # The custom call exists on the CPU only: an accelerator dequantizes and dots.
        y = jax.lax.platform_dependent(rows, packed, cpu=call,
                                       default=quant.quant_matmul_reference)
    else:
        y = quant.quant_matmul_reference(rows, packed)
    return y.reshape(*lead, n).astype(x.dtype)


_HUGE_PAGE = 2 << 20
_MADV_COLLAPSE = 25  # Linux 6.1+: back a range with huge pages now, contents unchanged


def collapse_to_huge_pages(arrays) -> int:
    """Back the packed weights among `arrays` (a pytree of CPU arrays) with 2 MiB pages where
    Linux allows it (`madvise(MADV_COLLAPSE)`, 6.1+), and return the bytes it moved.

    The kernel streams every weight once per step, and with 4 KiB pages the hardware
    prefetcher stops at each page: the SmolLM2 step's matmuls took 19.4 ms against 20.5 with
    the 314 of its 538 MB that lie in whole aligned huge pages collapsed (2-core Xeon). The
    contents do not change, so this is only a hint: on another OS, an older kernel or a
    refusal it does nothing and returns 0."""
    if not hasattr(os, "sched_getaffinity"):  # not Linux
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return 0
    done = 0
    for a in jax.tree.leaves(arrays):
        if (a.ndim < 3 or a.nbytes < _HUGE_PAGE
                or (a.shape[-1] != PANEL and not quant.is_quantized(a))):
            continue
        try:
            start = a.unsafe_buffer_pointer()
        except Exception:  # not a single-device CPU array
            continue
        lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
        hi = (start + a.nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if hi > lo and libc.madvise(lo, hi - lo, _MADV_COLLAPSE) == 0:
            done += hi - lo
    return done
