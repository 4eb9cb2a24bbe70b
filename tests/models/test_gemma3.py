"""Gemma 3 in the engine, on a tiny random model of its shape: sliding-window layers (a window
shorter than the prompts) between global ones, two RoPE bases, sandwich norms, GeGLU, scaled
embeddings, a query scale that is not head_dim's. The paged engine's greedy output equals
the dense forward's, and every speculative mode is exact on it, its drafts both accepted
and rejected, with the local layers' K/V kept in a ring of their window per slot (a ring of window + run
less a block fails these tests). (Logits against transformers: tests/models/test_hf_parity.py's "gemma3"; the
real 270M file: tests/models/test_gemma3_270m.py.)"""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import SamplingParams
from specjax.bench.sampling import judge_groups, sample_and_tag, target_probs
from specjax.models import Llama, ModelConfig
from specjax.models.dense_greedy import dense_greedy
from specjax.speculative.config import (DraftTargetConfig, EagleConfig, MTPConfig, NGramConfig,
                                        SAConfig)
from tests.spec_checks import assert_mixed_acceptance, spec_llm
from tests.speculative import perm_models

# 8 layers (EAGLE-3 reads three of them), every third global; a window of 6 tokens, so
# every prompt below outgrows it and the engine's 4-token blocks fall out of it.
WINDOW = 6
GEMMA = perm_models.CFG.replace(
    model_type="gemma3_text", qk_norm=True, sandwich_norms=True, hidden_act="gelu_pytorch_tanh",
    embed_scale=True, query_pre_attn_scalar=12, rope_theta=1e6, rope_local_theta=1e4,
    sliding_windows=tuple(None if (i + 1) % 3 == 0 else WINDOW for i in range(8)))
PROMPTS = perm_models.PROMPTS
MAX_TOKENS = perm_models.MAX_TOKENS


@pytest.fixture(scope="module")
def gemma():
    """(target, perm, refs): greedy next token mostly perm[current] (`perm_models`), with the
    layers' normed outputs scaled down so that the scaled embedding still leads."""
    target, perm = perm_models.perm_target(GEMMA)
    for name in ("attn_out_norm", "ffn_out_norm"):
        target.layers[name].value = target.layers[name][...] * 0.05
    refs = {tuple(p): dense_greedy(target, p, MAX_TOKENS) for p in PROMPTS}
    return target, perm, refs


def perturbed(target: Llama, seed: int = 5, scale: float = 0.5) -> Llama:
    """A drafter that agrees with `target` often, not always: its weights plus noise."""
    draft = nnx.clone(target)
    rng = np.random.default_rng(seed)
    for name in ("q_proj", "up_proj"):
        w = np.asarray(draft.layers[name][...])
        draft.layers[name].value = jnp.asarray(w + scale * w.std() * rng.standard_normal(w.shape),
                                               w.dtype)
    return draft


def test_the_tiny_model_follows_its_permutation_often_not_always(gemma):
    target, perm, refs = gemma
    follows = [b == perm[a] for p in PROMPTS for a, b in zip([p[-1]] + refs[tuple(p)],
                                                              refs[tuple(p)])]
    assert 0.5 < np.mean(follows) < 1.0, np.mean(follows)


MODES = {
    "plain": lambda target, perm: None,
    "ngram": lambda target, perm: NGramConfig(max_draft_len=3, max_matching_ngram_size=2),
    "sa": lambda target, perm: SAConfig(max_draft_len=3),
    "draft_target": lambda target, perm: DraftTargetConfig(
        max_draft_len=3, speculative_model=perturbed(target)),
    "eagle3": lambda target, perm: EagleConfig(
        max_draft_len=3, speculative_model=perm_models.eagle_head(target, perm)),
    "eagle3_tree": lambda target, perm: EagleConfig(
        max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=2,
        max_total_draft_tokens=6, speculative_model=perm_models.eagle_head(target, perm)),
    "mtp": lambda target, perm: MTPConfig(
        max_draft_len=3, num_nextn_predict_layers=3,
        speculative_model=perm_models.mtp_heads(3, cfg=GEMMA)),
}
# Modes whose drafts come from a model: they must be both accepted and rejected here.
MODEL_DRAFTERS = {"draft_target", "eagle3", "mtp"}


# The tree and MTP workers are the same code for every family (tests/speculative covers them
# on Llama): on Gemma they run in the slow job.
SLOW = {"eagle3_tree", "mtp"}


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow if m in SLOW else ())
                                  for m in MODES])
def test_greedy_output_equals_the_dense_forward_in_every_mode(gemma, mode):
    target, perm, refs = gemma
    spec = MODES[mode](target, perm)
    if spec is not None and mode != "eagle3_tree":  # every step at full depth
        spec = dataclasses.replace(spec, draft_len_schedule={1: 3})
    llm = spec_llm(target, spec, max_model_len=64)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == refs[tuple(prompt)], (mode, prompt)
    # The local layers (6 of 8) keep only a ring per slot: window 6 + the widest run (the
    # prefill's 8) in 4-token blocks, plus one; the global pool holds the other 2.
    pool = llm.engine.executor.state.target
    assert pool.k.shape[0] == 2 and pool.ring_k.shape[:2] == (6, (4 + 1) * 5)
    assert llm.engine.prefix_cache is None
    if mode in MODEL_DRAFTERS:
        assert_mixed_acceptance(llm.stats, 3)
    elif spec is not None:
        assert llm.stats.drafted_tokens > 0
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


def test_sampled_tokens_follow_the_target_at_every_depth(gemma):
    """Rejection sampling with the perturbed drafter at temperature 0.8: 128 sequences of 32
    tokens, each token tagged with the depth that decided it and judged against the target's
    exact distribution at its prefix (`specjax.bench.sampling`: generalized chi-square,
    alpha = 1e-5 per group, 6 groups); the draft tokens themselves must fail the same test."""
    target, perm, _ = gemma
    D, T = 3, 0.8
    spec = DraftTargetConfig(max_draft_len=D, speculative_model=perturbed(target),
                             draft_len_schedule={1: D})
    llm = spec_llm(target, spec, max_batch_size=16, max_model_len=64, overlap_scheduler=False,
                   prefill_chunk=16)
    tags = sample_and_tag(llm, D, 128, 32, T, seed_offset=10**6, prompt=PROMPTS[1])
    p = target_probs(llm, tags.sequences, T)
    for r in judge_groups(tags, p, D):
        assert r.count > 0 and not r.differs, (r.name, r.stat, r.critical, r.count)
    for r in judge_groups(tags, p, D, drafted=True):
        assert r.differs, (r.name, r.stat, r.critical)
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks
