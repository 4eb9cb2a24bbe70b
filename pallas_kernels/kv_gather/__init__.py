"""Paged KV relocation (accepted rows to their final slots) and page gather.

`relocate_kv` and `gather_kv_pages` are what callers use: the compiled Pallas kernels on a GPU,
the jnp references elsewhere, the kernels in interpret mode with `interpret=True` (see
`pallas_kernels.backend`).
"""
from __future__ import annotations

import jax

from pallas_kernels.backend import dispatch
from pallas_kernels.kv_gather.kernel import gather_kv_pages_kernel, relocate_kv_kernel
from pallas_kernels.kv_gather.reference import gather_kv_pages_reference, relocate_kv_reference


def relocate_kv(k_pool: jax.Array, v_pool: jax.Array, src_blocks: jax.Array,
                src_offsets: jax.Array, dst_blocks: jax.Array, dst_offsets: jax.Array,
                num_moves: jax.Array, *,
                interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """See `relocate_kv_reference` for the contract."""
    return dispatch(relocate_kv_kernel, relocate_kv_reference, k_pool, v_pool, src_blocks,
                    src_offsets, dst_blocks, dst_offsets, num_moves, interpret=interpret)


def gather_kv_pages(pool: jax.Array, layer: jax.Array | int, block_tables: jax.Array, *,
                    interpret: bool | None = None) -> jax.Array:
    """See `gather_kv_pages_reference` for the contract."""
    return dispatch(gather_kv_pages_kernel, gather_kv_pages_reference, pool, layer,
                    block_tables, interpret=interpret)


__all__ = ["gather_kv_pages", "gather_kv_pages_kernel", "gather_kv_pages_reference",
           "relocate_kv", "relocate_kv_kernel", "relocate_kv_reference"]
