"""Kernel-or-reference dispatch, and the one place that picks the Pallas GPU lowering.

Every public kernel entry point (`chain_speculative_sampling`, `paged_attention`,
`relocate_kv`, `gather_kv_pages`) is `dispatch(...)` over a (kernel, reference) pair with the
reference's signature plus `interpret`. Per call, at trace time:

- `interpret=True`: the Pallas kernel in interpret mode (any backend; how the CPU tests run it);
- otherwise, on a GPU backend (`jax.default_backend() == "gpu"`) and when the kernel supports
  the call's static shapes: the compiled Pallas kernel;
- otherwise (CPU, TPU, unsupported shapes, no Pallas GPU lowering in this JAX): the reference.

`SPECJAX_PALLAS=reference|kernel|interpret` (environment) overrides the automatic choice, for
A/B checks on a GPU and for debugging. A jitted function that calls the kernels depends on it,
and a traced function is reused whatever the environment says later: where such a function is
made, read the override (`forced`), key the function's cache by it and trace under it
(`forcing`), as `specjax.core.steps` does. Anywhere else it is read per call.

Lowering: the kernels are written against the Triton-style Pallas API (pointer loads with
masks, `jax.experimental.pallas.triton`), which current JAX deprecates in favour of Mosaic GPU.
`gpu_compiler_params` is the only place that chooses it (by passing Triton `CompilerParams`,
which selects the Triton lowering whatever `jax_pallas_use_mosaic_gpu` says); a Mosaic GPU
port changes this module and the kernels, never their callers.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Any, Callable, Iterator

import jax

GPU_LOWERING = "triton"
_ENV = "SPECJAX_PALLAS"
_MODES = ("reference", "kernel", "interpret")
_UNSET = object()
# The override a function being traced was made with (`forcing`), else _UNSET: read the
# environment.
_TRACED_WITH: contextvars.ContextVar[Any] = contextvars.ContextVar("pallas_forced",
                                                                  default=_UNSET)


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


def forced() -> str | None:
    """What `SPECJAX_PALLAS` forces now ("reference" | "kernel" | "interpret"), None when it
    forces nothing."""
    value = os.environ.get(_ENV, "").strip().lower()
    if value and value not in _MODES:
        raise ValueError(f"{_ENV}={value!r}; expected one of {', '.join(_MODES)}")
    return value or None


@contextlib.contextmanager
def forcing(mode: str | None) -> Iterator[None]:
    """Choose within this block as `forced()` said `mode` (None: nothing forced), whatever the
    environment says now: a function traced here behaves as it was made to."""
    token = _TRACED_WITH.set(mode)
    try:
        yield
    finally:
        _TRACED_WITH.reset(token)


def choose(interpret: bool | None, supported: bool = True) -> str:
    """"interpret" | "kernel" | "reference" for one call (see the module docstring).

    `supported`: whether the compiled kernel handles this call's static shapes (interpret mode
    handles every shape the reference does).
    """
    compiled_ok = jax.default_backend() == "gpu" and supported and triton_available()
    forced_mode = _TRACED_WITH.get()
    if forced_mode is _UNSET:
        forced_mode = forced()
    if forced_mode:
        if forced_mode == "kernel":
            return "kernel" if compiled_ok else "interpret"
        return forced_mode
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
