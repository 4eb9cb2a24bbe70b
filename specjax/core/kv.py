"""The paged KV pool on the device: one pool per attention stack (target, draft model, head).

K and V are `[L, num_blocks, KV, tokens_per_block, hd]`: head-major inside a block, so a
block's keys of one head are one contiguous run, and gathered pages feed attention's per-head
products as they are (`pallas_kernels.kv_gather.gather_kv_pages`). Block 0 is the null block:
padded block-table entries and padded query rows point at it, so their writes land in memory
no live request reads. Drafters' pools share the target's block tables, so a request's
position maps to the same block in every pool. Which blocks a request holds is the host's
business (`specjax.engine.allocator`); the device only ever sees block tables.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

NULL_BLOCK = 0


@struct.dataclass
class KVPool:
    k: jax.Array  # [L, num_blocks, KV, tokens_per_block, hd]
    v: jax.Array  # [L, num_blocks, KV, tokens_per_block, hd]
    # With tensor parallelism, the mesh whose "tp" axis splits the KV heads (the target's
    # pool); None: one device, or replicated (drafters' pools). Static: attention over a
    # split pool runs per device (`specjax.core.sharding.heads_local`).
    mesh: Mesh | None = struct.field(pytree_node=False, default=None)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def tokens_per_block(self) -> int:
        return self.k.shape[3]


def make_kv_pool(num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 tokens_per_block: int, dtype, mesh: Mesh | None = None) -> KVPool:
    """A zeroed pool of `num_layers` attention layers (the target's, or a drafter's); `mesh`:
    its KV heads split over the mesh's "tp" axis."""
    shape = (num_layers, num_blocks, num_kv_heads, tokens_per_block, head_dim)
    return KVPool(k=jnp.zeros(shape, jnp.dtype(dtype)), v=jnp.zeros(shape, jnp.dtype(dtype)),
                  mesh=mesh)
