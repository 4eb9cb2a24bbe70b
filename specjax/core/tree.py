"""Draft trees on the device: their static shape, their layout in a run, the greedy walk that
accepts a path, and the relocation of that path's K/V to linear positions.

A tree of T nodes rides in a run of 1 + T rows: row 0 is the root (the request's newest token),
rows 1..T the nodes, every parent before its children; `parents` `[B, T]` holds each node's
parent row (0 = the root). Row i's K/V are written to pool slot start + i while its position
(RoPE, and the key its sampled token is drawn with) is start + depth_i; attention lets each
row see the committed context, its ancestors and itself (the paged attention's `tree_mask`).

Acceptance walks from the root: at each depth the target's token at the current node (drawn
exactly as plain decoding would draw the token at that position: argmax, or the request's key
for it) is looked up among the node's children; a match descends, no match stops. Every
emitted token is the target's own choice given the accepted prefix, so greedy and seeded
sampled output equal plain decoding token for token, whatever the tree holds.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from pallas_kernels.kv_gather import relocate_kv
from pallas_kernels.paged_attention.reference import TREE_MAX_NODES
from specjax.core.kv import KVPool
from specjax.core.sharding import POOL, heads_local

# The tree mask is one int32 bitmask per row (bit j: row j is an ancestor or the row itself),
# so a run holds at most 32 rows: the root and 31 nodes.
MAX_TREE_NODES = TREE_MAX_NODES - 1


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """A dynamic tree's static shape: `top_k` children per expanded node and frontier width,
    `max_depth` levels, `max_nodes` nodes verified per step at that depth.

    A shallower step (the draft-length schedule's value d < max_depth) verifies
    `nodes_for(d)` = ceil(max_nodes * d / max_depth) nodes: strictly increasing in d, so a
    step's depth follows from its run width (`depth_for`), and within [d, top_k * d]."""

    top_k: int
    max_depth: int
    max_nodes: int

    def __post_init__(self):
        if not (1 <= self.max_depth <= self.max_nodes <= min(self.top_k * self.max_depth,
                                                              MAX_TREE_NODES)):
            raise ValueError(f"a tree needs 1 <= depth ({self.max_depth}) <= nodes "
                             f"({self.max_nodes}) <= min(top_k * depth, {MAX_TREE_NODES})")

    def nodes_for(self, depth: int) -> int:
        return -(-self.max_nodes * depth // self.max_depth)

    def depth_for(self, nodes: int) -> int:
        for depth in range(self.max_depth + 1):
            if self.nodes_for(depth) == nodes:
                return depth
        raise ValueError(f"no depth of {self} verifies {nodes} nodes")


@struct.dataclass
class TreeLayout:
    depths: jax.Array     # [B, 1+T] int32: 0 for the root
    ancestors: jax.Array  # [B, 1+T] int32: bit j set when row j is an ancestor or the row itself
    valid: jax.Array      # [B, 1+T] bool: the row may be accepted (the root always)


def tree_layout(parents: jax.Array, num_nodes: jax.Array, room: jax.Array,
                max_depth: int) -> TreeLayout:
    """parents `[B, T]` (node i+1's parent row), num_nodes `[B]` (nodes past it are not part of
    the tree), room `[B]` (the deepest node that still fits the request's max length) ->
    the rows' depths, ancestor masks and validity. A node is valid when its parent is an
    earlier valid row and its depth is at most `max_depth` and `room`."""
    B, T = parents.shape
    rows = jnp.arange(1 + T)
    par = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), parents.astype(jnp.int32)], axis=1)
    own = (rows[None, :] <= num_nodes[:, None]) & (par < rows[None, :])
    own = own & ((par >= 0) | (rows[None, :] == 0))
    bit = lambda r: jnp.left_shift(jnp.int32(1), r)
    # Pointer jumping, one level per pass: `up` is the ancestor max_depth - k levels up.
    ancestors = bit(rows)[None, :] * jnp.ones((B, 1), jnp.int32)
    depths = jnp.zeros((B, 1 + T), jnp.int32)
    ok = own
    up = par
    for _ in range(max_depth):
        has = up >= 0
        safe = jnp.maximum(up, 0)
        ancestors = ancestors | jnp.where(has, bit(safe), 0)
        depths = depths + has
        ok = ok & jnp.where(has, jnp.take_along_axis(own, safe, axis=1), True)
        up = jnp.where(has, jnp.take_along_axis(par, safe, axis=1), -1)
    ok = ok & (up < 0) & (depths <= room[:, None])  # deeper than max_depth: not in the tree
    return TreeLayout(depths=depths, ancestors=ancestors, valid=ok.at[:, 0].set(True))


def tree_accept(tokens: jax.Array, parents: jax.Array, layout: TreeLayout, targets: jax.Array,
                depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tokens `[B, 1+T]` (the run), parents `[B, T]`, targets `[B, 1+T]` (the target's token
    after each row) -> (new_tokens `[B, depth+1]`: the accepted nodes' tokens then the
    target's token after the last, new_tokens_lens `[B]` = accepted + 1, path `[B, depth+1]`:
    the rows of the root and the accepted nodes, the last repeated past the accepted ones)."""
    B = tokens.shape[0]
    par = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), parents.astype(jnp.int32)], axis=1)
    node = jnp.zeros((B,), jnp.int32)
    going = jnp.ones((B,), bool)
    path = [node]
    for _ in range(depth):
        want = jnp.take_along_axis(targets, node[:, None], axis=1)         # [B, 1]
        match = (par == node[:, None]) & (tokens == want) & layout.valid    # children only
        found = going & jnp.any(match, axis=1)
        node = jnp.where(found, jnp.argmax(match, axis=1).astype(jnp.int32), node)
        going = found
        path.append(node)
    path = jnp.stack(path, axis=1)
    accepted = jnp.sum(path[:, 1:] != path[:, :-1], axis=1)
    return jnp.take_along_axis(targets, path, axis=1), accepted + 1, path


def relocate_path(pool: KVPool, start_pos: jax.Array, block_tables: jax.Array, path: jax.Array,
                  num_moves: jax.Array) -> KVPool:
    """Move the K/V of the accepted nodes (every layer) from their slots start + path[k] to
    the linear slots start + k, k = 1..num_moves `[B]`, before anything reads them. Sources
    are never before their destinations (a node's row is at least its depth), and every
    source is read before any destination is written."""
    bs = pool.tokens_per_block
    R = path.shape[1] - 1
    src = start_pos[:, None] + path[:, 1:]
    dst = start_pos[:, None] + jnp.arange(1, R + 1)[None, :]
    where = lambda pos: (jnp.take_along_axis(block_tables, pos // bs, axis=1), pos % bs)
    (src_b, src_o), (dst_b, dst_o) = where(src), where(dst)
    move = heads_local(relocate_kv, pool.mesh, (POOL, POOL) + (P(),) * 5, (POOL, POOL))
    k, v = move(pool.k, pool.v, src_b, src_o, dst_b, dst_o, num_moves)
    return pool.replace(k=k, v=v)
