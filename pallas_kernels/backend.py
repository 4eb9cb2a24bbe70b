"""Kernel-or-reference dispatch, and the one place that picks the Pallas GPU lowering.

Every public kernel entry point (`chain_speculative_sampling`, `paged_attention`,
`relocate_kv`, `gather_kv_pages`) is `dispatch(...)` over a (kernel, reference) pair with the
reference's signature plus `interpret`. Per call, at trace time:

- `interpret=True`: the Pallas kernel in interpret mode (any backend; how the CPU tests run it);
- otherwise, on a GPU backend (`jax.default_backend() == "gpu"`) and when the kernel supports
  the call's static shapes: the compiled Pallas kernel;
- otherwise (CPU, TPU, unsupported shapes, no Pallas GPU lowering in this JAX): the reference.

`SPECJAX_PALLAS=reference|kernel|interpret` (environment, read per call) overrides the automatic
choice, for A/B checks on a GPU and for debugging.

Lowering: the kernels are written against the Triton-style Pallas API (pointer loads with
masks, `jax.experimental.pallas.triton`), which current JAX deprecates in favour of Mosaic GPU.
`gpu_compiler_params` is the only place that chooses it (by passing Triton `CompilerParams`,
which selects the Triton lowering whatever `jax_pallas_use_mosaic_gpu` says); a Mosaic GPU
port changes this module and the kernels, never their callers.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import jax

GPU_LOWERING = "triton"
_ENV = "SPECJAX_PALLAS"
_MODES = ("reference", "kernel", "interpret")


def triton_available() -> bool:
    """Whether this JAX still ships the Pallas Triton lowering the kernels use."""
    import importlib.util
    try:
        return importlib.util.find_spec("jax.experimental.pallas.triton") is not None
    except ImportError:
        return False


def gpu_compiler_params(num_warps: int | None = None, num_stages: int | None = None) -> Any:
    """Compiler params for a compiled GPU pallas_call; they also select the lowering."""
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def choose(interpret: bool | None, supported: bool = True) -> str:
    """"interpret" | "kernel" | "reference" for one call (see the module docstring).

    `supported`: whether the compiled kernel handles this call's static shapes (interpret mode
    handles every shape the reference does).
    """
    compiled_ok = jax.default_backend() == "gpu" and supported and triton_available()
    forced = os.environ.get(_ENV, "").strip().lower()
    if forced:
        if forced not in _MODES:
            raise ValueError(f"{_ENV}={forced!r}; expected one of {', '.join(_MODES)}")
        if forced == "kernel":
            return "kernel" if compiled_ok else "interpret"
        return forced
    if interpret:
        return "interpret"
    return "kernel" if compiled_ok else "reference"


def dispatch(kernel: Callable, reference: Callable, *args: Any, interpret: bool | None = None,
             supported: bool = True, **kwargs: Any) -> Any:
    """Run `kernel(*args, interpret=bool, **kwargs)` or `reference(*args, **kwargs)`."""
    mode = choose(interpret, supported)
    if mode == "reference":
        return reference(*args, **kwargs)
    return kernel(*args, interpret=(mode == "interpret"), **kwargs)
