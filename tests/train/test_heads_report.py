"""The acceptance report: its statistics, E[AL] against an explicit per-anchor simulation of
greedy drafting and verification, and the tree-masked greedy continuation."""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from head_helpers import EAGLE, TARGET, random_fill, reference_chain
from specjax.models import Llama
from specjax.train.heads.report import acceptance_report, chain_report, greedy_chain_tokens
from specjax.train.heads.spec import new_head


def test_chain_report_statistics():
    rng = np.random.default_rng(0)
    agree = rng.random((4, 500)) < 0.7
    mask = rng.random(500) < 0.9
    report = chain_report(agree, mask)
    a = agree[:, mask]
    leading = np.array([next((k for k in range(4) if not a[k, n]), 4) for n in range(a.shape[1])])
    assert report["expected_acceptance_length"] == pytest.approx(1 + leading.mean())
    for k in range(4):
        d = report["per_depth"][k]
        assert d["agreement"] == pytest.approx(a[k].mean())
        reached = leading >= k
        assert d["reached"] == reached.sum()
        assert d["conditional_agreement"] == pytest.approx(a[k][reached].mean())


SMALL = TARGET.replace(vocab_size=3)


def explicit_acceptance(spec, head, target, tokens):
    """For every anchor on its own, simulate greedy drafting and verification: the target's
    greedy continuation from explicit sequences, the head's chain (`reference_chain`) fed with
    it. -> the number of leading depths that agree, per anchor `[B*T]`."""
    B, T1 = tokens.shape
    T, K = T1 - 1, spec.depth
    forward = jax.jit(lambda seq: target.forward(seq, capture_layers=spec.needed_layers))
    _, captured = forward(tokens)
    hidden1 = head.fuse(captured[:3, :, :T])
    chain = jax.jit(partial(reference_chain, head.qkv_and_residual, head.finish),
                    static_argnums=2)
    counts = []
    for b in range(B):
        for a in range(T):
            seq = list(np.asarray(tokens[b, :a + 2]))
            greedy = []
            for _ in range(K):  # padded to one length: causal, so the padding is harmless
                padded = jnp.asarray([seq + [0] * (T1 + K - len(seq))], jnp.int32)
                greedy.append(int(jnp.argmax(forward(padded)[0][0, len(seq) - 1])))
                seq.append(greedy[-1])
            # Step j >= 2 of this anchor reads the embedding of greedy token j-1.
            inputs = [tokens[:, 1:]] + [jnp.full((B, T), g, jnp.int32) for g in greedy[:-1]]
            embeds = jnp.stack([target.embed_tokens(x) for x in inputs])
            outs = chain(hidden1, embeds, b, a)
            draft = np.asarray(head.to_target_ids(jnp.argmax(head.logits(outs), axis=-1)))
            n = 0
            while n < K and draft[n] == greedy[n]:
                n += 1
            counts.append(n)
    return np.asarray(counts)


def test_report_expected_acceptance_length_equals_explicit_simulation():
    # A 3-token vocabulary, so that agreement (and so depths >= 2) is common.
    target = random_fill(Llama(SMALL, rngs=nnx.Rngs(0)), seed=7, scale=0.5)
    spec = dataclasses.replace(EAGLE, draft_vocab=3)
    head = random_fill(new_head(spec, target, 0), seed=25, scale=0.5)  # reaches depth 3
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, 3, size=(2, 9)), jnp.int32)
    batch = {"tokens": tokens, "valid": jnp.ones(tokens.shape, bool)}
    report = acceptance_report(spec, head, target, [batch])
    counts = explicit_acceptance(spec, head, target, tokens)
    assert report["anchors"] == counts.size
    assert report["expected_acceptance_length"] == pytest.approx(1 + counts.mean())
    assert (counts >= 2).any(), "the case should exercise depths beyond the first"


def test_greedy_chain_tokens_equal_explicit_greedy(target, window):
    g = np.asarray(greedy_chain_tokens(target, window, 3))
    B, T1 = window.shape
    forward = jax.jit(lambda seq: target.forward(seq)[0])
    for b in range(B):
        for a in range(T1 - 1):
            seq = list(np.asarray(window[b, :a + 2]))
            for k in range(3):  # padded to one length: causal, so the padding is harmless
                logits = forward(jnp.asarray([seq + [0] * (T1 + 3 - len(seq))], jnp.int32))
                seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
                assert g[k, b, a] == seq[-1], (b, a, k)

