"""Draft trees on the device: their static shape, their layout in a run, the walk and the
recursive rejection sampling that accept a path, and the relocation of that path's K/V to
linear positions.

A tree of T nodes rides in a run of 1 + T rows: row 0 is the root (the request's newest token),
rows 1..T the nodes, every parent before its children; `parents` `[B, T]` holds each node's
parent row (0 = the root). Row i's K/V are written to pool slot start + i while its position
(RoPE, and the key its sampled token is drawn with) is start + depth_i; attention lets each
row see the committed context, its ancestors and itself (the paged attention's `tree_mask`).

Acceptance walks from the root. Greedy rows (and sampled rows without rejection sampling):
at each depth the target's token at the current node (drawn exactly as plain decoding would
draw the token at that position: argmax, or the request's key for it) is looked up among the
node's children; a match descends, no match stops (`tree_accept`). Every emitted token is the
target's own choice given the accepted prefix, so greedy and seeded sampled output equal
plain decoding token for token, whatever the tree holds. Sampled rows whose siblings were
drawn without replacement from the drafter: recursive rejection sampling
(`tree_rejection_accept`), whose output follows the target's distribution.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from pallas_kernels.kv_gather import relocate_kv
from pallas_kernels.rejection_sampling import mix32
from pallas_kernels.rejection_sampling.reference import (ACCEPT_STREAM, RESIDUAL_STREAM,
                                                         counter_uniform, sample_inverse_cdf)
from pallas_kernels.paged_attention.reference import TREE_MAX_NODES
from specjax.core.kv import KVPool, ring_tables
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


def tree_rejection_accept(tokens: jax.Array, parents: jax.Array, layout: TreeLayout,
                          target_probs: jax.Array, draft_probs: jax.Array, seeds: jax.Array,
                          start_pos: jax.Array, depth: int, top_k: int
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Recursive rejection sampling down a tree whose siblings were drawn without replacement
    (Jeon et al. 2024): the emitted tokens follow the target's distribution.

    tokens `[B, 1+T]` (the run), parents `[B, T]`, target_probs `[B, 1+T, V]` (the target's
    filtered distribution after each row), draft_probs `[B, T, V]` (the distribution node i
    was drawn from: its parent's q, before any sibling was removed), seeds `[B]`, start_pos
    `[B]` (the root's position) -> (new_tokens `[B, depth+1]`, lens `[B]` = accepted + 1,
    path `[B, depth+1]`) as `tree_accept`.

    At the current node, with p its target distribution and q its children's: child j
    (in the order drawn) is accepted with probability min(1, p(x_j) / q(x_j)); on rejection
    p <- normalise(max(0, p - q)) and q <- q without x_j, renormalised (the distribution the
    next sibling was drawn from). An accepted child becomes the node (its own p, its children's
    q); when no child is accepted -- or the node has none -- the token comes from p as it
    then stands. Why it is exact: by induction over the siblings, given the siblings tried so
    far were rejected, "accept x_j ~ q_j with min(1, p_j/q_j), else continue from p_{j+1}"
    emits p_j exactly -- the chain's argument with (p_j, q_j) in place of (p, q) -- provided
    x_j is a draw from q_j given the past and whether child j exists depends only on the past
    (`specjax.speculative.workers.tree`). A rejected x_j has p_j(x_j) < q_j(x_j), so p_{j+1}
    gives it no mass, consistent with q_{j+1} leaving it out. Each level then emits
    p(. | accepted prefix), the next level starts from the accepted child's own distributions,
    and the bonus after the deepest accepted node is a plain draw from its p.

    Uniforms: sibling j at the node's position draws from the chain's accept stream with the
    seed salted by j (j = 0 is the chain's own uniform), the final token from the chain's
    residual stream at its position."""
    B, R, V = target_probs.shape
    par = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), parents.astype(jnp.int32)], axis=1)
    rows = jnp.arange(B)
    q_rows = jnp.concatenate([jnp.zeros((B, 1, V), draft_probs.dtype), draft_probs], axis=1)

    def children_q(node):  # the distribution node's children were drawn from (any child's)
        first = jnp.argmax((par == node[:, None]) & layout.valid, axis=1)
        return q_rows[rows, first].astype(jnp.float32)

    node = jnp.zeros((B,), jnp.int32)
    going = jnp.ones((B,), bool)
    p_cur = target_probs[:, 0].astype(jnp.float32)
    q_cur = children_q(node)
    path = [node]
    for level in range(depth):
        children = (par == node[:, None]) & layout.valid                   # [B, 1+T]
        rank = jnp.cumsum(children, axis=1) - 1
        position = start_pos + level + 1
        found = jnp.zeros((B,), bool)
        for j in range(top_k):
            pick = children & (rank == j)
            child = jnp.argmax(pick, axis=1)
            token = tokens[rows, child]
            q_x, p_x = q_cur[rows, token], p_cur[rows, token]
            u = counter_uniform(seeds ^ mix32(jnp.uint32(j)), position, ACCEPT_STREAM)
            # q = 0: drawn after the support ran out (not a draw: skipped).
            tried = going & ~found & jnp.any(pick, axis=1) & (q_x > 0)
            accept = tried & (u * q_x < p_x)
            reject = (tried & ~accept)[:, None]
            residual = jnp.maximum(p_cur - q_cur, 0.0)
            mass = jnp.sum(residual, axis=1, keepdims=True)
            p_cur = jnp.where(reject & (mass > 0), residual / jnp.maximum(mass, 1e-30), p_cur)
            q_left = q_cur.at[rows, token].set(0.0)
            left = jnp.sum(q_left, axis=1, keepdims=True)
            q_cur = jnp.where(reject, q_left / jnp.maximum(left, 1e-30), q_cur)
            node = jnp.where(accept, child.astype(jnp.int32), node)
            found = found | accept
        going = going & found
        p_cur = jnp.where(found[:, None], target_probs[rows, node].astype(jnp.float32), p_cur)
        q_cur = jnp.where(found[:, None], children_q(node), q_cur)
        path.append(node)
    path = jnp.stack(path, axis=1)
    accepted = jnp.sum(path[:, 1:] != path[:, :-1], axis=1)
    last = sample_inverse_cdf(p_cur, counter_uniform(seeds, start_pos + 1 + accepted,
                                                     RESIDUAL_STREAM))
    new_tokens = jnp.take_along_axis(tokens, path, axis=1)[:, 1:]
    new_tokens = jnp.concatenate([new_tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)
    new_tokens = jnp.where(jnp.arange(depth + 1) == accepted[:, None], last[:, None], new_tokens)
    return new_tokens.astype(jnp.int32), accepted + 1, path


def relocate_path(pool: KVPool, start_pos: jax.Array, block_tables: jax.Array, path: jax.Array,
                  num_moves: jax.Array, slots: jax.Array | None = None) -> KVPool:
    """Move the K/V of the accepted nodes (every layer) from their slots start + path[k] to
    the linear slots start + k, k = 1..num_moves `[B]`, before anything reads them. Sources
    are never before their destinations (a node's row is at least its depth), and every
    source is read before any destination is written. A pool with local-layer rings moves
    theirs too (`slots` `[B]`: the rows' slots)."""
    bs = pool.tokens_per_block
    R = path.shape[1] - 1
    src = start_pos[:, None] + path[:, 1:]
    dst = start_pos[:, None] + jnp.arange(1, R + 1)[None, :]

    def moved(k_pool, v_pool, tables):
        where = lambda pos: (jnp.take_along_axis(tables, pos // bs, axis=1), pos % bs)
        (src_b, src_o), (dst_b, dst_o) = where(src), where(dst)
        move = heads_local(relocate_kv, pool.mesh, (POOL, POOL) + (P(),) * 5, (POOL, POOL))
        return move(k_pool, v_pool, src_b, src_o, dst_b, dst_o, num_moves)

    k, v = moved(pool.k, pool.v, block_tables)
    if pool.ring_k is None:
        return pool.replace(k=k, v=v)
    ring_k, ring_v = moved(pool.ring_k, pool.ring_v,
                           ring_tables(pool, slots, block_tables.shape[1]))
    return pool.replace(k=k, v=v, ring_k=ring_k, ring_v=ring_v)
