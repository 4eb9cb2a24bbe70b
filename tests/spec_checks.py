"""Checks shared by the speculative tests, and drafts that are right only some of the time.

A greedy-equality test passes trivially when every draft is rejected (the target alone
decides every token) or when every draft is accepted (the rejection path never runs), so each
one also calls `assert_mixed_acceptance` on the engine's statistics.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import specjax
from specjax.engine.stats import EngineStats
from specjax.sampling_params import SamplingParams
from specjax.models import Llama


def spec_llm(target, spec, **kw) -> specjax.LLM:
    """A small engine for a drafter's tests. One batch bucket: a drafter's step does not
    depend on it (tests/engine and test_spec_engine.py run every bucket), and warm-up compiles
    a third of the programs at batch 4."""
    kw = {**dict(max_batch_size=4, tokens_per_block=4, prefill_chunk=8, progress=False), **kw}
    kw.setdefault("batch_sizes", (kw["max_batch_size"],))
    return specjax.LLM(target, speculative_config=spec, **kw)


def assert_full_depth(stats: EngineStats, max_draft_len: int) -> None:
    """The histograms agree with the totals, and some request-step verified `max_draft_len`
    drafts (the deepest draft the engine can verify) and none verified more."""
    verified, accepted = stats.verified_histogram, stats.accepted_histogram
    assert sum(verified) == sum(accepted) == stats.request_steps_with_drafts, stats
    assert sum(d * n for d, n in enumerate(verified)) == stats.drafted_tokens, stats
    assert sum(a * n for a, n in enumerate(accepted)) == stats.accepted_draft_tokens, stats
    assert len(verified) == max_draft_len + 1 and verified[max_draft_len] > 0, (
        f"no request-step verified {max_draft_len} drafts: {verified}")
    assert len(accepted) <= max_draft_len + 1, stats


def assert_mixed_acceptance(stats: EngineStats, max_draft_len: int) -> None:
    """Drafts were proposed, some accepted and some rejected, and (D > 1) some request-step
    verified a full-depth draft of D tokens."""
    assert stats.drafted_tokens > 0, "no draft was verified"
    assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens, (
        f"accepted {stats.accepted_draft_tokens} of {stats.drafted_tokens} drafts: the "
        "accept and reject paths did not both run")
    assert_full_depth(stats, max_draft_len)


def acceptance_summary(stats: EngineStats) -> str:
    """accepted/drafted and both histograms, for assertion messages and reports."""
    return (f"accepted {stats.accepted_draft_tokens}/{stats.drafted_tokens} "
            f"verified_histogram={stats.verified_histogram} "
            f"accepted_histogram={stats.accepted_histogram}")


def truncated_copy(target: Llama, num_layers: int) -> Llama:
    """The target's embeddings, head and first `num_layers` layers: a draft model of another
    shape that agrees with the target often but not always (about 40% of drafts accepted
    for the 2-layer test model cut to 1 layer)."""
    draft = Llama(target.config.replace(num_layers=num_layers), rngs=nnx.Rngs(0))
    draft.embed.value = target.embed[...]
    draft.final_norm.value = target.final_norm[...]
    if not target.config.tie_word_embeddings:
        draft.lm_head.value = target.lm_head[...]
    for name, param in target.layers.items():
        draft.layers[name].value = param[...][:num_layers]
    return draft


def noisy_copy(model: Llama, scale: float, seed: int = 0) -> Llama:
    """`model` with Gaussian noise of `scale` x each parameter's standard deviation added
    (norm weights, all ones, stay as they are): same shape, right only some of the time."""
    copy = nnx.clone(model)
    leaves, tree = jax.tree.flatten(nnx.state(copy, nnx.Param))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
             for x, k in zip(leaves, keys)]
    nnx.update(copy, jax.tree.unflatten(tree, noisy))
    return copy


def join_mid_run(llm, prompts, refs, max_tokens) -> None:
    """Requests join while others are generating (each prompt twice, shorter each time);
    each finishes with plain greedy's tokens (`refs` by prompt tuple) and the pool is full
    again."""
    engine = llm.engine
    expected, done = {}, {}
    for i, prompt in enumerate(prompts * 2):
        expected[engine.add_request(prompt, SamplingParams(max_tokens=max_tokens - i))] = \
            refs[tuple(prompt)][:max_tokens - i]
        for _ in range(3):
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert done == expected
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks
