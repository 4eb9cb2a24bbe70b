"""Growing a dynamic draft tree (EAGLE-3's `use_dynamic_tree`), independent of the head.

Level 0: the top-K tokens of the first draft distribution, score = log-probability. Each later
level: every frontier node proposes its top-K children (K² candidates), score = the child's
log-probability + its parent's score; the best K become the next frontier; every candidate is
kept. Finally the T best candidates by score form the tree, in candidate order -- level by
level, so every parent precedes its children (a child never outscores its parent, so it is
chosen only with it; on exact ties a child whose parent was left out gets parent -1 and is
never accepted).

The head is behind `expand`: given the frontier's tokens and per-node state it returns each
node's next-token log-probabilities and the state its children inherit, which keeps this
module testable with a table for a head.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# expand(level, tokens [B, K], node_state, shared) -> (log-probs [B, K, V], the state each
# node's children inherit (leaves [B, K, ...]), shared)
Expand = Callable[[int, jax.Array, Any, Any], tuple[jax.Array, Any, Any]]


def grow_tree(first_logp: jax.Array, expand: Expand, node_state: Any, shared: Any,
              top_k: int, depth: int, num_nodes: int,
              to_target: Callable[[jax.Array], jax.Array] = lambda ids: ids
              ) -> tuple[jax.Array, jax.Array]:
    """first_logp `[B, V]` (the distribution after the newest token), `node_state` for the
    level-0 nodes (leaves `[B, K, ...]`), `to_target` mapping the head's ids to the target's
    -> (tokens `[B, num_nodes]`, parents `[B, num_nodes]`: each node's parent row, 0 = the
    root, -1 = not part of the tree)."""
    B = first_logp.shape[0]
    K = top_k
    score, ids = jax.lax.top_k(first_logp, K)                          # [B, K]
    tokens = to_target(ids).astype(jnp.int32)
    cand_tokens, cand_scores = [tokens], [score]
    cand_parents = [jnp.full((B, K), -1, jnp.int32)]
    frontier = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K))  # candidate indices
    offset = K
    for level in range(1, depth):
        logp, children_state, shared = expand(level, tokens, node_state, shared)
        child_logp, child_ids = jax.lax.top_k(logp, K)                  # [B, K, K]
        child_scores = (score[:, :, None] + child_logp).reshape(B, K * K)
        child_tokens = to_target(child_ids).astype(jnp.int32).reshape(B, K * K)
        cand_tokens.append(child_tokens)
        cand_scores.append(child_scores)
        cand_parents.append(jnp.repeat(frontier, K, axis=1))
        score, pick = jax.lax.top_k(child_scores, K)                   # the next frontier
        tokens = jnp.take_along_axis(child_tokens, pick, axis=1)
        frontier = offset + pick.astype(jnp.int32)
        node_state = jax.tree.map(
            lambda x, slot=pick // K: jnp.take_along_axis(
                x, slot.reshape(B, K, *([1] * (x.ndim - 2))), axis=1),
            children_state)
        offset += K * K
    scores = jnp.concatenate(cand_scores, axis=1)                       # [B, C]
    _, chosen = jax.lax.top_k(scores, num_nodes)
    chosen = jnp.sort(chosen, axis=1)                                   # parents first
    tokens = jnp.take_along_axis(jnp.concatenate(cand_tokens, axis=1), chosen, axis=1)
    parent_cand = jnp.take_along_axis(jnp.concatenate(cand_parents, axis=1), chosen, axis=1)
    C = scores.shape[1]
    row_of = jnp.full((B, C), -1, jnp.int32).at[jnp.arange(B)[:, None], chosen].set(
        jnp.arange(1, num_nodes + 1, dtype=jnp.int32))                 # candidate -> tree row
    parent_row = jnp.take_along_axis(row_of, jnp.maximum(parent_cand, 0), axis=1)
    parents = jnp.where(parent_cand < 0, 0, parent_row)
    return tokens, parents
