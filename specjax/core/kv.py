"""The paged KV pool on the device: one pool per attention stack (target, draft model, head).

K and V are `[L, num_blocks, KV, tokens_per_block, hd]`: head-major inside a block, so a
block's keys of one head are one contiguous run, and gathered pages feed attention's per-head
products as they are (`pallas_kernels.kv_gather.gather_kv_pages`). Block 0 is the null block:
padded block-table entries and padded query rows point at it, so their writes land in memory
no live request reads. Drafters' pools share the target's block tables, so a request's
position maps to the same block in every pool. Which blocks a request holds is the host's
business (`specjax.engine.allocator`); the device only ever sees block tables.

Sliding-window layers can keep only their window (`ring_k`, `ring_v`): a ring of
`ring_blocks` blocks per slot (the spare's last), position p's K/V in the slot's block
`(p // tokens_per_block) % ring_blocks`, so a request holds window-plus-a-run of their K/V
whatever its length while the global layers' pages hold everything (Gemma 3: 15 of 18 layers
local). A ring of at least window + the widest run tokens keeps every position a query can see
(`specjax.core.forward.PagedAttention`): the entry a write overwrites belongs to a position
at least that far back, outside every window; a rejected draft's entry is rewritten before any
query sees its position. The ring's tables are computed on the device from the batch's slots.
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
    # Local layers' rings, `[L_ring, (slots + 1) * ring_blocks, KV, tokens_per_block, hd]`,
    # or None; `places[i]`: attention layer i's (in ring?, index in k or ring_k).
    ring_k: jax.Array | None = None
    ring_v: jax.Array | None = None
    places: tuple[tuple[bool, int], ...] | None = struct.field(pytree_node=False, default=None)
    ring_blocks: int = struct.field(pytree_node=False, default=0)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def tokens_per_block(self) -> int:
        return self.k.shape[3]


def make_kv_pool(num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 tokens_per_block: int, dtype, mesh: Mesh | None = None,
                 ring_layers: tuple[bool, ...] = (), ring_blocks: int = 0,
                 num_slots: int = 0) -> KVPool:
    """A zeroed pool of `num_layers` attention layers (the target's, or a drafter's); `mesh`:
    its KV heads split over the mesh's "tp" axis. `ring_layers` (one flag per layer): those
    that keep only a ring of `ring_blocks` blocks for each of `num_slots` slots and the
    spare (module docstring)."""
    dtype = jnp.dtype(dtype)
    if not any(ring_layers):
        shape = (num_layers, num_blocks, num_kv_heads, tokens_per_block, head_dim)
        return KVPool(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), mesh=mesh)
    if len(ring_layers) != num_layers or ring_blocks < 1 or num_slots < 1 or mesh is not None:
        raise ValueError("a ring needs a flag per layer, ring_blocks, num_slots and one device")
    places, counts = [], [0, 0]
    for ring in ring_layers:
        places.append((bool(ring), counts[bool(ring)]))
        counts[bool(ring)] += 1
    shape = (counts[0], num_blocks, num_kv_heads, tokens_per_block, head_dim)
    ring = (counts[1], (num_slots + 1) * ring_blocks, num_kv_heads, tokens_per_block, head_dim)
    return KVPool(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                  ring_k=jnp.zeros(ring, dtype), ring_v=jnp.zeros(ring, dtype),
                  places=tuple(places), ring_blocks=ring_blocks)


def ring_tables(pool: KVPool, slots: jax.Array, width: int) -> jax.Array:
    """`[B, width]`: logical block j of each row's slot -> its ring block (rows `slots` `[B]`,
    padded rows the spare's)."""
    R = pool.ring_blocks
    return slots[:, None] * R + jnp.arange(width)[None, :] % R
