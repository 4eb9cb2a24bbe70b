"""Mamba-2 selective state-space scan (SSD) for hybrid/SSM targets and drafters.

`ssm_scan` is what callers use: the compiled Pallas chunked kernel on a GPU (for shapes it
supports, see `kernel.compiled_supported`), the jnp reference elsewhere (the chunked form;
`ssm_scan_sequential` is the recurrence every form is tested against), the kernel in
interpret mode with `interpret=True` (see `pallas_kernels.backend`).
`ssm_scan_states_reference` (the state after every position, for committing the state at the
accepted depth in speculative verification) and `ssm_scan_chunked_reference` (the kernel's
chunked algorithm in jnp) are plain jnp on every backend.
"""
from __future__ import annotations

import jax

from pallas_kernels.backend import dispatch
from pallas_kernels.ssm_scan.kernel import compiled_supported, ssm_scan_kernel
from pallas_kernels.ssm_scan.reference import (ssm_scan_chunked_reference, ssm_scan_reference,
                                               ssm_scan_sequential, ssm_scan_states_reference)


def ssm_scan(x: jax.Array, dt: jax.Array, A: jax.Array, b: jax.Array, c: jax.Array,
             h0: jax.Array, *, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """See `ssm_scan_reference` for the contract: (y [B, T, H, P], h_final [B, H, P, N])."""
    return dispatch(ssm_scan_kernel, ssm_scan_reference, x, dt, A, b, c, h0,
                    interpret=interpret, supported=compiled_supported(x.shape, b.shape))


__all__ = ["compiled_supported", "ssm_scan", "ssm_scan_chunked_reference", "ssm_scan_kernel",
           "ssm_scan_reference", "ssm_scan_sequential", "ssm_scan_states_reference"]
