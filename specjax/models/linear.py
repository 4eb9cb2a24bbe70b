"""Every dense projection goes through `linear(x, w)`, in either of two weight layouts.

Checkpoints, training and accelerators keep a projection as `w [in, out]` and multiply with
XLA's dot. On a CPU the engine runs its steps with each float32 projection packed once, at
load (`packed_for_cpu`), for `pallas_kernels.cpu_matmul`: a kernel that streams each weight
once however many rows (batch x verified tokens) a step multiplies, where XLA:CPU's multi-row
dot read it at a fraction of the 1-row rate (issue 61: verifying 4 drafts cost 2.17x a plain
step). A packed weight is `[ceil(out / 32), in, 32]`: `linear` tells the layouts apart by rank
(a layer's projection is 2-D; under `lax.scan` the stacked `[L, ...]` arrays are sliced to it).

A GGUF's quantized projections stay quantized (`pallas_kernels.cpu_matmul.quant`: uint8/int8
`[P, K / qk, R]`, 3-D like a packed float weight): the same kernel on a CPU, a jnp
dequantize-then-dot elsewhere. `dequantized` turns them back into float `[in, out]` weights
where XLA's dot is asked for on a CPU.
"""
from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import cpu_matmul
from pallas_kernels.cpu_matmul import quant
from specjax.models.roles import PROJECTIONS

M = TypeVar("M", bound=nnx.Module)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x `[..., in]` @ w: `[in, out]` (or a vector `[in]`) by XLA's dot, or packed
    `[P, in, 32]` / quantized `[P, in / qk, R]` by the CPU kernel
    (`pallas_kernels.cpu_matmul.matmul`)."""
    if w.ndim <= 2:
        return x @ w
    if w.ndim == 3:
        return cpu_matmul.matmul(x, w)
    raise ValueError(f"a projection weight is [in, out] or packed [P, in, 32]; got {w.shape}")


def packable(name: Any, array: Any) -> bool:
    """Whether `packed_for_cpu` packs this parameter: a float32 projection whose output width
    is a whole number of panels (every real model's; the rest keep XLA's dot)."""
    return (name in PROJECTIONS and getattr(array, "ndim", 0) >= 2
            and array.dtype == jnp.float32 and array.shape[-1] % cpu_matmul.PANEL == 0)


def packed_for_cpu(module: M) -> M:
    """A copy of `module` (a model or drafter in its inference layout) with every packable
    projection packed for the CPU kernel. A target whose LM head is its embedding
    (`tie_word_embeddings`) gets a packed `lm_head` of its own (the embedding stays for the
    token lookup): `head_weight()` prefers it."""
    module = nnx.merge(*nnx.split(module))
    config = getattr(module, "config", None)
    if (getattr(config, "tie_word_embeddings", False) and hasattr(module, "embed")
            and not hasattr(module, "lm_head") and not quant.is_quantized(module.embed[...])):
        module.lm_head = nnx.Param(module.embed[...].T)
    graphdef, state = nnx.split(module)
    pure = nnx.to_pure_dict(state)

    def pack(tree):
        if isinstance(tree, dict):
            return {k: (cpu_matmul.pack_weight(v) if packable(k, v) else pack(v))
                    for k, v in tree.items()}
        return tree

    nnx.replace_by_pure_dict(state, pack(pure))
    return nnx.merge(graphdef, state)


def is_quantized(module: nnx.Module) -> bool:
    """Whether any parameter of `module` is a quantized weight (`quant.py`)."""
    return any(quant.is_quantized(a) for a in jax.tree.leaves(nnx.state(module)))


def dequantized(module: M) -> M:
    """A copy of `module` with every quantized weight turned into float32 `[..., in, out]`
    (an embedding kept as its LM head back into `[V, D]`): the same values, for XLA's dot."""
    if not is_quantized(module):
        return module
    graphdef, state = nnx.split(nnx.merge(*nnx.split(module)))

    def convert(tree):
        if isinstance(tree, dict):
            return {k: (jnp.swapaxes(quant.dequantize(v), -1, -2) if k == "embed"
                        else quant.dequantize(v)) if quant.is_quantized(v) else convert(v)
                    for k, v in tree.items()}
        return tree

    nnx.replace_by_pure_dict(state, convert(nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


ACTIVATION_BITS = (16, 8)


def check_activation_bits(bits: Any) -> None:
    if bits not in ACTIVATION_BITS:
        raise ValueError(f"activation_bits is 16 or 8, not {bits!r}")


def activation_bits(module: nnx.Module) -> int:
    """The bits x is rounded to against `module`'s quantized weights (16 for a float model)."""
    bits = {quant.x_bits(a) for a in jax.tree.leaves(nnx.state(module)) if quant.is_quantized(a)}
    return min(bits, default=16)


def with_activation_bits(module: M, bits: int) -> M:
    """`module` with its quantized weights multiplied against x rounded to `bits` a value by
    the CPU kernel: 16 (as loaded), or 8 (llama.cpp's Q8 activations: the same weight bytes,
    `quant.with_8bit_x`). 8 halves the kernel's byte products, which bound an AVX2-only core;
    a row is still computed alone, so speculative output stays equal to plain. Float
    weights are unaffected."""
    check_activation_bits(bits)
    if bits == 16 or not is_quantized(module):
        return module
    graphdef, state = nnx.split(nnx.merge(*nnx.split(module)))

    def convert(tree):
        if isinstance(tree, dict):
            return {k: convert(v) for k, v in tree.items()}
        return quant.with_8bit_x(tree) if quant.is_quantized(tree) else tree

    nnx.replace_by_pure_dict(state, convert(nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)
