"""Draft trees on the device (`specjax.core.tree`) and growing them
(`specjax.speculative.workers.tree`): each checked against a plain-Python restatement of the
reference behaviour (semantics.md, "Dynamic tree")."""
import itertools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core.kv import make_kv_pool
from specjax.core.sampling import filter_logits
from specjax.bench.sampling import TreeTagger, judge_tree_groups
from specjax.core.tree import (MAX_TREE_NODES, TreeShape, relocate_path, tree_accept, tree_layout,
                               tree_rejection_accept)
from specjax.speculative.workers.tree import grow_tree, sampled_draw


def random_parents(rng, T):
    """Parents of nodes 1..T, each an earlier row (0 = the root)."""
    return np.asarray([rng.integers(0, i) for i in range(1, T + 1)], np.int32)


def python_layout(parents, num_nodes, room, max_depth):
    par = [-1] + list(parents)
    depths, ancestors, valid = [], [], []
    for i in range(len(par)):
        chain, node = [i], i
        while par[node] >= 0:
            node = par[node]
            chain.append(node)
        depth = len(chain) - 1
        ok = all(n <= num_nodes and (n == 0 or 0 <= par[n] < n) for n in chain)
        depths.append(depth if depth <= max_depth else None)
        ancestors.append(sum(1 << n for n in chain))
        valid.append(i == 0 or (ok and depth <= max_depth and depth <= room))
    return depths, ancestors, valid


def test_tree_shape_depths_and_node_counts():
    shape = TreeShape(top_k=4, max_depth=4, max_nodes=10)
    counts = [shape.nodes_for(d) for d in range(5)]
    assert counts == [0, 3, 5, 8, 10]  # ceil(10 d / 4): strictly increasing
    assert [shape.depth_for(n) for n in counts] == list(range(5))
    for d in range(1, 5):
        assert d <= shape.nodes_for(d) <= 4 * d
    with pytest.raises(ValueError, match="no depth"):
        shape.depth_for(4)
    with pytest.raises(ValueError, match="top_k"):
        TreeShape(top_k=2, max_depth=4, max_nodes=9)   # more nodes than K * D
    with pytest.raises(ValueError, match=str(MAX_TREE_NODES)):
        TreeShape(top_k=8, max_depth=4, max_nodes=32)  # more than the mask holds


def test_layout_matches_a_python_walk_over_random_trees():
    rng = np.random.default_rng(0)
    B, T, max_depth = 6, 12, 4
    parents = np.stack([random_parents(rng, T) for _ in range(B)])
    parents[1, 5] = -1           # a node whose parent was left out (and its subtree)
    parents[2, 3] = 7            # a "parent" after its child: not a tree row
    num_nodes = np.asarray([12, 12, 12, 5, 0, 9], np.int32)
    room = np.asarray([9, 9, 2, 9, 9, 1], np.int32)
    out = jax.jit(tree_layout, static_argnums=3)(parents, num_nodes, room, max_depth)
    for b in range(B):
        depths, ancestors, valid = python_layout(parents[b], num_nodes[b], room[b], max_depth)
        assert np.asarray(out.valid[b]).tolist() == valid, b
        for i in range(T + 1):
            if valid[i]:
                assert int(out.depths[b, i]) == depths[i] and int(out.ancestors[b, i]) == \
                    ancestors[i], (b, i)


def python_accept(tokens, parents, valid, targets, depth):
    node, path = 0, [0]
    for _ in range(depth):
        children = [c for c in range(1, len(tokens)) if parents[c - 1] == node and valid[c]]
        hit = [c for c in children if tokens[c] == targets[node]]
        if not hit:
            break
        node = hit[0]
        path.append(node)
    return [targets[n] for n in path], path


def test_accept_walks_the_target_choices_down_the_tree():
    rng = np.random.default_rng(1)
    B, T, depth, V = 64, 10, 4, 3  # a tiny vocabulary: many matches, siblings share tokens
    parents = np.stack([random_parents(rng, T) for _ in range(B)])
    tokens = rng.integers(0, V, (B, T + 1)).astype(np.int32)
    targets = rng.integers(0, V, (B, T + 1)).astype(np.int32)
    num_nodes = rng.integers(0, T + 1, B).astype(np.int32)
    room = rng.integers(0, depth + 2, B).astype(np.int32)
    layout = tree_layout(parents, num_nodes, room, depth)
    new_tokens, lens, path = jax.jit(tree_accept, static_argnums=4)(tokens, parents, layout,
                                                                    targets, depth)
    accepted_any = 0
    for b in range(B):
        want_tokens, want_path = python_accept(tokens[b], parents[b],
                                               np.asarray(layout.valid[b]), targets[b], depth)
        n = len(want_path)
        assert int(lens[b]) == n
        assert np.asarray(new_tokens[b, :n]).tolist() == [int(t) for t in want_tokens]
        assert np.asarray(path[b, :n]).tolist() == want_path
        accepted_any += n > 1
    assert accepted_any > B // 4  # the walk descended often, not only stopped at the root


def test_relocate_path_moves_the_accepted_rows_to_linear_slots():
    L, KV, hd, bs = 2, 2, 4, 4
    pool = make_kv_pool(L, KV, hd, num_blocks=9, tokens_per_block=bs, dtype="float32")
    pool = pool.replace(k=jax.random.normal(jax.random.key(0), pool.k.shape),
                        v=jax.random.normal(jax.random.key(1), pool.v.shape))
    start = np.asarray([5, 2], np.int32)
    tables = np.asarray([[3, 1, 4, 5], [6, 2, 8, 7]], np.int32)
    path = np.asarray([[0, 2, 5, 9], [0, 1, 1, 1]], np.int32)   # row 1 accepted one node
    moves = np.asarray([3, 0], np.int32)                        # ... but is padding here
    out = relocate_path(pool, start, tables, path, moves)
    slot = lambda b, pos: (tables[b, pos // bs], pos % bs)
    k, k0 = np.asarray(out.k), np.asarray(pool.k)
    for j in range(1, 4):
        dst, src = slot(0, 5 + j), slot(0, 5 + path[0, j])
        np.testing.assert_array_equal(k[:, dst[0], :, dst[1]], k0[:, src[0], :, src[1]])
    touched = {slot(0, 5 + j) for j in range(1, 4)}
    for blk, off in itertools.product(range(9), range(bs)):
        if (blk, off) not in touched:
            np.testing.assert_array_equal(k[:, blk, :, off], k0[:, blk, :, off])


def python_grow(first, table, K, depth, T):
    """The reference algorithm over log-prob rows: first [V], table[token] [V]."""
    top = lambda row: sorted(range(len(row)), key=lambda t: (-row[t], t))[:K]
    cands = [(first[t], t, -1) for t in top(first)]      # (score, token, parent candidate)
    frontier = list(range(K))
    for _ in range(1, depth):
        children = []
        for f in frontier:
            score, token, _ = cands[f]
            children += [(score + table[token][t], t, f) for t in top(table[token])]
        base = len(cands)
        cands += children
        order = sorted(range(len(children)), key=lambda i: (-children[i][0], i))[:K]
        frontier = [base + i for i in order]
    chosen = sorted(sorted(range(len(cands)), key=lambda i: (-cands[i][0], i))[:T])
    row = {c: i + 1 for i, c in enumerate(chosen)}
    return ([cands[c][1] for c in chosen],
            [0 if cands[c][2] < 0 else row.get(cands[c][2], -1) for c in chosen])


@pytest.mark.parametrize("K,depth,T", [(2, 1, 2), (2, 3, 6), (3, 4, 10), (4, 4, 16)])
def test_grow_tree_with_known_top_k_lists(K, depth, T):
    """A head that is a table (each token's next-token log-probs) gives known top-K lists, so
    the tree is known: the same as the reference algorithm restated in Python."""
    V = 12
    rng = np.random.default_rng(K * 10 + depth)
    table = np.log(rng.dirichlet(np.ones(V) * 0.5, size=V)).astype(np.float32)
    first = table[rng.integers(0, V, 3)]                 # three rows, different first tokens

    def expand(level, tokens, node, shared):
        assert node.shape == tokens.shape and shared.shape == ()
        return jnp.asarray(table)[tokens], node + 1, shared + 1

    fn = jax.jit(lambda f: grow_tree(f, expand, jnp.zeros((3, K), jnp.int32),
                                     jnp.zeros((), jnp.int32), K, depth, T))
    tokens, parents, _ = fn(first)
    for b in range(3):
        want_tokens, want_parents = python_grow(first[b], table, K, depth, T)
        assert np.asarray(tokens[b]).tolist() == want_tokens
        assert np.asarray(parents[b]).tolist() == want_parents
        assert all(0 <= p < i + 1 for i, p in enumerate(want_parents))  # parents first


def test_grow_tree_maps_head_ids_to_target_ids():
    table = np.log(np.full((4, 4), 0.25, np.float32))
    first = np.log(np.asarray([[0.1, 0.2, 0.3, 0.4]], np.float32))
    tokens, parents, _ = grow_tree(first, lambda *a: (jnp.asarray(table)[a[1] % 4], a[2], a[3]),
                                jnp.zeros((1, 2)), None, 2, 1, 2, lambda ids: ids + 100)
    assert np.asarray(tokens).tolist() == [[103, 102]]
    assert np.asarray(parents).tolist() == [[0, 0]]


# ---- sampled trees: siblings drawn without replacement, recursive rejection sampling ---------

def markov_tables(V, seed):
    """A drafter q(. | token) and a target p(. | token) that agree in part."""
    rng = np.random.default_rng(seed)
    q = rng.dirichlet(np.full(V, 0.6), size=V)
    p = 0.5 * q[:, rng.permutation(V)] + 0.5 * rng.dirichlet(np.full(V, 0.6), size=V)
    return q, p / p.sum(1, keepdims=True)


def sampled_batch(B, temperature=1.0, top_k=0, top_p=1.0):
    return SimpleNamespace(temperature=jnp.full((B,), temperature, jnp.float32),
                           top_k=jnp.full((B,), top_k, jnp.int32),
                           top_p=jnp.full((B,), top_p, jnp.float32),
                           min_p=jnp.zeros((B,), jnp.float32),
                           seeds=jnp.arange(B, dtype=jnp.uint32) * 7919 + 11)


def sampled_tree_step(q_table, p_probs, roots, K, D, T, batch, start=5):
    """Grow one sampled tree per row from the drafter's table (`sampled_draw` filters it with
    the batch's parameters) and accept it by recursive rejection sampling against the target's
    `p_probs` -> numpy (run tokens, parents, node q, emitted tokens, lens)."""
    B = len(roots)
    log_q = jnp.log(jnp.asarray(q_table, jnp.float32))
    newest = jnp.full((B,), start, jnp.int32)

    @jax.jit
    def step(roots):
        expand = lambda level, tokens, node, shared: (log_q[tokens], node, shared)  # noqa: E731
        nodes, parents, q = grow_tree(log_q[roots], expand, jnp.zeros((B, K)), None, K, D, T,
                                      draw=sampled_draw(batch, newest, K))
        run = jnp.concatenate([roots[:, None], nodes], axis=1)
        layout = tree_layout(parents, jnp.full((B,), T), jnp.full((B,), 100), D)
        p = jnp.asarray(p_probs, jnp.float32)[run]
        new_tokens, lens, _ = tree_rejection_accept(run, parents, layout, p, q, batch.seeds,
                                                    newest, D, K)
        return run, parents, q, new_tokens, lens

    return [np.asarray(x) for x in step(jnp.asarray(roots, jnp.int32))]


def test_sampled_tree_siblings_are_distinct_draws_in_a_tree_of_the_set_size():
    V, K, D, T, B = 8, 3, 3, 7, 64
    q_table, p_table = markov_tables(V, 0)
    run, parents, q, _, lens = sampled_tree_step(q_table, p_table, np.arange(B) % V, K, D, T,
                                                 sampled_batch(B))
    assert (lens >= 1).all() and (lens <= D + 1).all()
    for b in range(B):
        par = [-1] + parents[b].tolist()
        for node in range(T + 1):
            kids = [r for r in range(1, T + 1) if par[r] == node]
            assert len(kids) <= K
            tokens = [run[b, r] for r in kids]
            assert len(set(tokens)) == len(tokens)  # without replacement
            # every child was drawn from its parent's distribution
            for r in kids:
                np.testing.assert_allclose(q[b, r - 1], q_table[run[b, node]], rtol=1e-5,
                                           atol=1e-7)
        assert all(0 <= par[r] < r for r in range(1, T + 1))


def filtered(table, temperature, top_k):
    """softmax(filter_logits(log table)) per row: what a step makes of a raw distribution."""
    n = table.shape[0]
    f = filter_logits(jnp.log(jnp.asarray(table, jnp.float32)), jnp.full((n,), temperature),
                      jnp.full((n,), top_k, jnp.int32), jnp.ones((n,)), jnp.zeros((n,)))
    return np.asarray(jax.nn.softmax(f, axis=-1), np.float64)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3)])
def test_sampled_tree_tokens_follow_the_target_at_every_depth_and_sibling(temperature, top_k):
    """Every emitted token, grouped by its depth and by the sibling its decision reached, is
    judged against the exact residual it must follow (p after the rejections before it) by the
    bench's chi-square statistic at alpha = 1e-5 per group; 12000 trees. The power check:
    the same statistic on the siblings' own tokens (drawn from q) must fail."""
    V, K, D, T, B = 8, 3, 3, 7, 12000
    q_table, p_table = markov_tables(V, 1)
    p_f = filtered(p_table, temperature, top_k)   # the target as the step filters it
    roots = np.random.default_rng(2).integers(0, V, B)
    run, parents, q, new_tokens, lens = sampled_tree_step(
        q_table, p_f, roots, K, D, T, sampled_batch(B, temperature, top_k))
    np.testing.assert_allclose(q[0, 0], filtered(q_table, temperature, top_k)[roots[0]],
                               atol=1e-5)  # siblings are drawn from the filtered drafter
    tagger = TreeTagger()
    for b in range(B):
        tagger.add(b, 1, run[b].tolist(), parents[b].tolist(), q[b],
                   new_tokens[b, :lens[b]].tolist(), D)
    sequences = [[int(roots[b])] + new_tokens[b, :lens[b]].tolist() for b in range(B)]
    tags = tagger.done(sequences)
    seqs = np.zeros((B, D + 2), np.int64)
    for b, seq in enumerate(sequences):
        seqs[b, :len(seq)] = seq
    p = p_f[seqs]                                          # p[s, t] = p(. | token t)
    results = judge_tree_groups(tags, p, min_count=200)
    names = [r.name for r in results]
    for k in range(1, D + 1):
        assert f"depth {k}, sibling 1" in names and f"depth {k}, sibling 2" in names, names
    assert "depth 1, sibling 3" in names, names
    for r in results:
        assert not r.differs, f"{r.name}: chi2 {r.stat:.1f} > {r.critical:.1f} (n {r.count})"
    drafted = judge_tree_groups(tags, p, drafted=True, min_count=200)
    assert "depth 1, sibling 2" in [r.name for r in drafted]
    for r in drafted:
        assert r.differs, f"drafts, {r.name}: chi2 {r.stat:.1f} <= {r.critical:.1f}"
