"""Fused projections: the inference layout's q/k/v and gate/up weights, one matrix each.

Checkpoints (and training) keep one weight per projection, under its Hugging Face name. The
engine runs the same layers with `[q | k | v]` and `[gate | up]` concatenated along the output
features, so a decode step issues one matmul where it issued three (or two): on a CPU each
dispatch and each pass over the input costs, and the wider matmul reads the same weight bytes.
`linear_parts` is the one place a layer multiplies through either layout.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_matmul import PANEL, quant
from specjax.models.linear import linear

# fused name -> the projections it concatenates, in output-feature order.
FUSED_GROUPS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def projection_sizes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Output widths of each group's parts for a layer shaped by `cfg` (any config with
    num_heads, num_kv_heads, head_dim, intermediate_size: a target's or a head's)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (q, kv, kv), "gate_up": (cfg.intermediate_size,) * 2}


def fuse_projections(params: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """One layer's `{name: array}` with every complete group's `<p>_proj` (and `<p>_bias`)
    replaced by `<group>_proj` (`<group>_bias`) concatenated along the last axis."""
    out = dict(params)
    for group, parts in FUSED_GROUPS.items():
        if not _fusable([out.get(f"{p}_proj") for p in parts]):
            continue
        for kind in ("proj", "bias"):
            names = [f"{p}_{kind}" for p in parts]
            if all(n in out for n in names):
                arrays = [out.pop(n) for n in names]
                # a quantized weight's output columns are its panels, `[..., P, K / qk, R]`
                axis = -3 if quant.is_quantized(arrays[0]) else -1
                out[f"{group}_{kind}"] = jnp.concatenate(arrays, axis=axis)
    return out


def _fusable(weights: list) -> bool:
    """Float weights, or quantized ones of one layout (a GGUF may mix types within a layer:
    those stay apart)."""
    if any(w is None for w in weights):
        return True  # nothing to fuse; the loop above skips it
    formats = {quant.format_of(w) for w in weights}
    return formats == {None} or (len(formats) == 1 and None not in formats)


def unfuse_projections(params: Mapping[str, jax.Array], sizes: Mapping[str, Sequence[int]]
                       ) -> dict[str, jax.Array]:
    """The inverse of `fuse_projections`, given each group's part widths (`{"qkv": (q, kv,
    kv), "gate_up": (f, f)}`): the checkpoint names back."""
    out = dict(params)
    for group, parts in FUSED_GROUPS.items():
        for kind in ("proj", "bias"):
            name = f"{group}_{kind}"
            if name in out and quant.is_quantized(out[name]):
                fused = out.pop(name)
                cuts = list(accumulate(s // PANEL for s in sizes[group][:-1]))
                pieces = jnp.split(fused, cuts, axis=-3)
                out.update({f"{p}_{kind}": x for p, x in zip(parts, pieces)})
            elif name in out:
                pieces = _split(out.pop(name), sizes[group])
                out.update({f"{p}_{kind}": x for p, x in zip(parts, pieces)})
    return out


def linear_parts(x: jax.Array, params: Mapping[str, jax.Array], group: str,
                 sizes: Sequence[int], bias: bool = False) -> list[jax.Array]:
    """x `[..., in]` through the group's projections (`FUSED_GROUPS[group]`, output widths
    `sizes`) in either layout -> one `[..., size]` array per projection, biases added."""
    parts = FUSED_GROUPS[group]
    if f"{group}_proj" in params:
        y = linear(x, params[f"{group}_proj"])
        if bias:
            y = y + params[f"{group}_bias"]
        return _split(y, sizes)
    ys = [linear(x, params[f"{p}_proj"]) for p in parts]
    if bias:
        ys = [y + params[f"{p}_bias"] for y, p in zip(ys, parts)]
    return ys


def _split(y: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
    if y.shape[-1] != sum(sizes):
        raise ValueError(f"fused projection has {y.shape[-1]} output features, expected "
                         f"{' + '.join(map(str, sizes))}")
    return jnp.split(y, list(accumulate(sizes[:-1])), axis=-1)
