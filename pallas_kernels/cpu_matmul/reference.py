"""The packed weight layout and the jnp dot the CPU kernel must equal.

A weight `W [K, N]` is packed once, at load, into panels of `PANEL` columns,
`packed[p, k, j] = W[k, p * PANEL + j]` (`[ceil(N / PANEL), K, PANEL]`, the last panel's
missing columns zero): each panel is one contiguous run the kernel streams front to back.
`matmul_reference` is `x @ W` on the unpacked weight, XLA's own dot.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

PANEL = 32  # columns per panel (kernel.cc: PANEL)


def num_panels(n: int) -> int:
    return -(-n // PANEL)


def pack_weight(w: jax.Array) -> jax.Array:
    """`[..., K, N]` -> `[..., ceil(N / PANEL), K, PANEL]` (leading axes kept: stacked layers)."""
    *lead, k, n = w.shape
    p = num_panels(n)
    w = jnp.pad(w, [(0, 0)] * len(lead) + [(0, 0), (0, p * PANEL - n)])
    return jnp.moveaxis(w.reshape(*lead, k, p, PANEL), -2, -3)


def unpack_weight(packed: jax.Array, n: int | None = None) -> jax.Array:
    """The inverse of `pack_weight`: `[..., P, K, PANEL]` -> `[..., K, n]` (n: P * PANEL)."""
    *lead, p, k, _ = packed.shape
    w = jnp.moveaxis(packed, -3, -2).reshape(*lead, k, p * PANEL)
    return w if n is None else w[..., :n]


def matmul_reference(x: jax.Array, packed: jax.Array, n: int | None = None) -> jax.Array:
    """x `[..., K]` @ the packed weight's `[K, n]` -> `[..., n]`, by XLA's dot."""
    return x @ unpack_weight(packed, n).astype(x.dtype)
