"""Growing a dynamic draft tree (EAGLE-3's `use_dynamic_tree`), independent of the head.

Level 0: K children of the root; each later level: every frontier node proposes K children
(K² candidates), a candidate's score is its parent's score plus an increment; the best K become
the next frontier; every candidate is kept. Finally the T best candidates by score form the
tree, in candidate order -- level by level, so every parent precedes its children, and among
siblings the order they were drawn in. Increments are never positive and never grow along a
node's siblings, so a child is chosen only with its parent and a sibling only with those
before it (on exact ties a child whose parent was left out gets parent -1 and is never
accepted).

How children are drawn (`draw`):
- greedy rows: the top K of the head's distribution, increment = the child's log-probability
  (the tree holds the drafter's most likely paths; the walk in `specjax.core.tree` accepts);
- sampled rows (`sampled_draw`): K draws without replacement from the head's distribution
  filtered by the request's temperature / top-k / top-p / min-p (Gumbel-top-k, keyed by the
  request's seed, the step's position and the node), which is what recursive rejection
  sampling (`specjax.core.tree.tree_rejection_accept`) needs. A sampled child's increment
  must not depend on its own token, or the tree would keep a sibling because of what was
  drawn for it -- and a sibling kept only when its draw is likely is no longer a draw from q
  (`tests/mutants.py`: tree_keeps_siblings_by_their_own_draw). So the increment depends on
  the child's rank among its siblings alone (`sibling_values`): which children a node keeps
  depends only on the tree's shape and on whether the drafter's support ran out before them,
  a stopping rule the rejection sampler is exact under.

The head is behind `expand`: given the frontier's tokens and per-node state it returns each
node's next-token log-probabilities and the state its children inherit, which keeps this
module testable with a table for a head.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.rejection_sampling import counter_bits, mix32
from specjax.core.sampling import DRAFT_STREAM, entry_noise, filter_logits

# expand(level, tokens [B, K], node_state, shared) -> (log-probs [B, K, V], the state each
# node's children inherit (leaves [B, K, ...]), shared)
Expand = Callable[[int, jax.Array, Any, Any], tuple[jax.Array, Any, Any]]
# draw(level, log-probs [B, N, V]) -> (children's ids [B, N, K], score increments [B, N, K],
# the distributions they were drawn from [B, N, V'] or None)
Draw = Callable[[int, jax.Array], tuple[jax.Array, jax.Array, jax.Array | None]]


def top_k_draw(top_k: int) -> Draw:
    """Every row's children are the K most likely tokens (greedy trees)."""
    def draw(level, logp):
        score, ids = jax.lax.top_k(logp, top_k)
        return ids, score, None
    return draw


# A sampled tree's shape models each child's acceptance by rejection sampling from its rank
# alone: the first child 0.6, the second and third 0.2 and later ones 0.1, each given the
# siblings before it were rejected -- what EAGLE-3's bundled head measured (K = 4, depth 4,
# 16 nodes, temperature 1; per depth within 0.07 of these), and the shape of the figures
# the literature reports (Sequoia, Jeon et al. 2024): the first draw is accepted far more
# often than any later sibling. Any values keep the output exact.
SIBLING_ACCEPTANCE = (0.6, 0.2, 0.2, 0.1)


def sibling_values(top_k: int) -> jax.Array:
    """The log of each sibling's modelled chance to be the accepted child, given its parent
    was accepted: a_j times the chance that siblings 1..j-1 were rejected `[top_k]`
    (non-increasing)."""
    values, reached = [], 1.0
    for j in range(top_k):
        a = SIBLING_ACCEPTANCE[min(j, len(SIBLING_ACCEPTANCE) - 1)]
        values.append(reached * a)
        reached *= 1.0 - a
    return jnp.log(jnp.asarray(values, jnp.float32))


def sampled_draw(batch, newest: jax.Array, top_k: int) -> Draw:
    """Sampled rows (temperature > 0) draw their children without replacement from the
    filtered head distribution (see the module docstring); greedy rows take the top K. The
    distributions come back for every row (zeros for greedy rows)."""
    def sampled(level, logp):
        B, N, V = logp.shape
        rep = lambda x: jnp.broadcast_to(x[:, None], (B, N))  # noqa: E731
        rows = (batch.temperature > 0)[:, None, None]
        logq = jax.nn.log_softmax(filter_logits(logp, rep(batch.temperature), rep(batch.top_k),
                                                rep(batch.top_p), rep(batch.min_p)))
        # A key per (request, step, level, node): the step's newest position makes every
        # step's tree fresh noise, so no draw repeats one an earlier step's tree was shaped by.
        salt = mix32(jnp.uint32(1 + level * 64) + jnp.arange(N, dtype=jnp.uint32))
        keys = counter_bits(batch.seeds[:, None] ^ salt[None, :], newest[:, None], DRAFT_STREAM)
        perturbed = jnp.where(rows, logq + entry_noise(keys, V), logp)
        _, ids = jax.lax.top_k(perturbed, top_k)                          # [B, N, K]
        q = jnp.exp(logq)
        q_ids = jnp.take_along_axis(q, ids, axis=-1)
        # A child drawn after the support ran out (q = 0: only past draws decide that) is
        # never kept where a real one could be.
        inc = jnp.where(q_ids > 0, sibling_values(top_k), -jnp.inf)
        greedy = jnp.take_along_axis(logp, ids, axis=-1)
        return ids, jnp.where(rows, inc, greedy), jnp.where(rows, q, 0.0)

    def draw(level, logp):
        greedy = top_k_draw(top_k)
        # All-greedy batches (the common case) skip the filtering and the noise.
        return jax.lax.cond(jnp.any(batch.temperature > 0), lambda x: sampled(level, x),
                            lambda x: (*greedy(level, x)[:2], jnp.zeros(x.shape, jnp.float32)),
                            logp)
    return draw


def grow_tree(first_logp: jax.Array, expand: Expand, node_state: Any, shared: Any,
              top_k: int, depth: int, num_nodes: int,
              to_target: Callable[[jax.Array], jax.Array] = lambda ids: ids,
              draw: Draw | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """first_logp `[B, V]` (the distribution after the newest token), `node_state` for the
    level-0 nodes (leaves `[B, K, ...]`), `to_target` mapping the head's ids to the target's,
    `draw` how children are chosen (default: the top K) -> (tokens `[B, num_nodes]`, parents
    `[B, num_nodes]`: each node's parent row, 0 = the root, -1 = not part of the tree, and
    with a `draw` that returns them, the distribution each node was drawn from `[B,
    num_nodes, V]` in the head's vocabulary, else None)."""
    B = first_logp.shape[0]
    K = top_k
    draw = draw or top_k_draw(K)
    ids, score, q = draw(0, first_logp[:, None])
    ids, score = ids[:, 0], score[:, 0]                                 # [B, K]
    tokens = to_target(ids).astype(jnp.int32)
    cand_tokens, cand_scores = [tokens], [score]
    cand_parents = [jnp.full((B, K), -1, jnp.int32)]
    dists = [q]                                          # [B, N, V] per level (or None)
    cand_dist = [jnp.zeros((B, K), jnp.int32)]           # which distribution drew each candidate
    frontier = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K))  # candidate indices
    offset, drawn = K, 1
    for level in range(1, depth):
        logp, children_state, shared = expand(level, tokens, node_state, shared)
        child_ids, child_inc, q = draw(level, logp)                     # [B, K, K]
        dists.append(q)
        cand_dist.append(jnp.broadcast_to(drawn + jnp.repeat(jnp.arange(K, dtype=jnp.int32), K),
                                          (B, K * K)))
        drawn += K
        child_scores = (score[:, :, None] + child_inc).reshape(B, K * K)
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
    if dists[0] is None:
        return tokens, parents, None
    which = jnp.take_along_axis(jnp.concatenate(cand_dist, axis=1), chosen, axis=1)
    node_q = jnp.take_along_axis(jnp.concatenate(dists, axis=1), which[:, :, None], axis=1)
    return tokens, parents, node_q
