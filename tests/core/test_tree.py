"""Draft trees on the device (`specjax.core.tree`) and growing them
(`specjax.speculative.workers.tree`): each checked against a plain-Python restatement of the
reference behaviour (semantics.md, "Dynamic tree")."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core.kv import make_kv_pool
from specjax.core.tree import MAX_TREE_NODES, TreeShape, relocate_path, tree_accept, tree_layout
from specjax.speculative.workers.tree import grow_tree


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
    tokens, parents = fn(first)
    for b in range(3):
        want_tokens, want_parents = python_grow(first[b], table, K, depth, T)
        assert np.asarray(tokens[b]).tolist() == want_tokens
        assert np.asarray(parents[b]).tolist() == want_parents
        assert all(0 <= p < i + 1 for i, p in enumerate(want_parents))  # parents first


def test_grow_tree_maps_head_ids_to_target_ids():
    table = np.log(np.full((4, 4), 0.25, np.float32))
    first = np.log(np.asarray([[0.1, 0.2, 0.3, 0.4]], np.float32))
    tokens, parents = grow_tree(first, lambda *a: (jnp.asarray(table)[a[1] % 4], a[2], a[3]),
                                jnp.zeros((1, 2)), None, 2, 1, 2, lambda ids: ids + 100)
    assert np.asarray(tokens).tolist() == [[103, 102]]
    assert np.asarray(parents).tolist() == [[0, 0]]
