"""The penalties at each verified position count exactly the tokens before it: generated ones
and the drafts (a tree node: its ancestors) -- checked against a per-position numpy loop."""
import jax.numpy as jnp
import numpy as np

from specjax.core.batch import empty_batch, set_row
from specjax.core.penalties import (chain_context, make_penalty_state, penalize,
                                    penalize_draft, record_generated, start_penalties,
                                    tree_context)
from specjax.core.tree import tree_layout

V, S = 12, 3


def reference(logits, counts, prompt_seen, before, rep, freq, pres):
    """One position: logits [V] after generated-token `counts` [V] plus tokens `before`."""
    c = counts + np.bincount(before, minlength=V).astype(np.int64)
    seen = c > 0
    x = np.where(seen | prompt_seen, np.where(logits > 0, logits / rep, logits * rep), logits)
    return x - freq * c - pres * seen


def _state():
    state = make_penalty_state(S, V)
    rng = np.random.default_rng(0)
    tokens = np.zeros((1, 20), np.int32)
    history = rng.integers(0, V, 14)
    tokens[0, :14] = history
    state = start_penalties(state, np.array([1], np.int32), tokens, np.array([6], np.int32),
                            np.array([14], np.int32))
    return state, history[:6], history[6:14]


def test_start_and_record_counts():
    state, prompt, generated = _state()
    assert np.array_equal(np.asarray(state.counts[1]), np.bincount(generated, minlength=V))
    assert np.array_equal(np.asarray(state.prompt[1]), np.bincount(prompt, minlength=V) > 0)
    state = record_generated(state, np.array([1, 3], np.int32),
                             np.array([[4, 4, 5], [1, 2, 3]], np.int32), np.array([2, 0]))
    assert int(state.counts[1, 4]) == np.sum(generated == 4) + 2
    assert int(state.counts[1, 5]) == np.sum(generated == 5)   # past the row's length
    assert int(state.counts[3].sum()) == 0


def _batch(W):
    batch = empty_batch(2, W, 1, S)
    set_row(batch, 0, run=[0] * W, start_pos=0, blocks=[], slot=1, max_len=30,
            repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.9)
    set_row(batch, 1, run=[0] * W, start_pos=0, blocks=[], slot=2, max_len=30)  # no penalty
    return batch


def test_chain_positions_count_the_drafts_before_them():
    state, prompt, generated = _state()
    W = 5
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, W, V)).astype(np.float32) * 3
    run = rng.integers(0, V, (2, W)).astype(np.int32)
    out = np.asarray(penalize(jnp.asarray(logits), state, _batch(W), jnp.asarray(run),
                              chain_context(W)))
    counts = np.bincount(generated, minlength=V)
    prompt_seen = np.bincount(prompt, minlength=V) > 0
    for j in range(W):
        # Position j verifies after run[0] (the newest token, counted already) and drafts
        # run[1..j].
        want = reference(logits[0, j], counts, prompt_seen, run[0, 1:j + 1], 1.7, 0.4, 0.9)
        np.testing.assert_allclose(out[0, j], want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(out[1], logits[1])    # the unpenalised row is untouched


def test_a_drafter_penalises_each_draft_as_verification_will():
    """Draft k's logits, penalised counting drafts 0 .. k-1 (all of a wider buffer, or its first
    k), equal verification's at the row that checks draft k."""
    state, _, _ = _state()
    D = 4
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(2, D + 1, V)).astype(np.float32) * 3)
    run = jnp.asarray(rng.integers(0, V, (2, D + 1)).astype(np.int32))
    batch = _batch(D + 1)
    verified = np.asarray(penalize(logits, state, batch, run, chain_context(D + 1)))
    drafts = run[:, 1:]
    for k in range(D + 1):
        exact = penalize_draft(logits[:, k], state, batch, drafts[:, :k])
        masked = penalize_draft(logits[:, k], state, batch, drafts, num_before=k)
        np.testing.assert_allclose(np.asarray(exact), verified[:, k], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(masked), verified[:, k], rtol=1e-6, atol=1e-6)


def test_tree_positions_count_their_ancestors():
    state, prompt, generated = _state()
    # Root 0; nodes 1, 2 children of the root; 3 child of 1; 4 child of 3; 5 child of 2.
    parents = np.array([[0, 0, 1, 3, 2]] * 2, np.int32)
    T = parents.shape[1]
    layout = tree_layout(jnp.asarray(parents), jnp.array([T, T]), jnp.array([9, 9]), 4)
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, T + 1, V)).astype(np.float32) * 3
    run = rng.integers(0, V, (2, T + 1)).astype(np.int32)
    out = np.asarray(penalize(jnp.asarray(logits), state, _batch(T + 1), jnp.asarray(run),
                              tree_context(layout.ancestors)))
    counts = np.bincount(generated, minlength=V)
    prompt_seen = np.bincount(prompt, minlength=V) > 0
    par = [-1] + list(parents[0])
    for node in range(T + 1):
        path, a = [], par[node]
        while a > 0:          # proper ancestors other than the root
            path.append(run[0, a])
            a = par[a]
        want = reference(logits[0, node], counts, prompt_seen, np.array(path, int),
                         1.7, 0.4, 0.9)
        np.testing.assert_allclose(out[0, node], want, rtol=1e-6, atol=1e-5)
