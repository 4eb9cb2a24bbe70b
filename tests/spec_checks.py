"""Checks shared by the speculative tests, and drafts that are right only some of the time.

A greedy-equality test passes trivially when every draft is rejected (the target alone
decides every token) or when every draft is accepted (the rejection path never runs), so each
one also calls `assert_mixed_acceptance` on the engine's statistics.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import specjax
from specjax.engine.stats import EngineStats
from specjax.sampling_params import SamplingParams
from specjax.models import Llama


def spec_llm(target, spec, **kw) -> specjax.LLM:
    """A small engine for a drafter's tests. One batch bucket and one prompt row a prefill
    step: a drafter's step depends on neither (tests/engine and test_spec_engine.py run every
    bucket and several prompt rows), and the engine compiles half the programs."""
    kw = {**dict(max_batch_size=4, tokens_per_block=4, prefill_chunk=8, max_prefill_rows=1,
                 progress=False), **kw}
    kw.setdefault("batch_sizes", (kw["max_batch_size"],))
    return specjax.LLM(target, speculative_config=spec, **kw)


def full_depth(spec):
    """`spec` with every step at its full depth: warm-up turns the cost model on, whose
    timing-dependent lengths (tests/speculative/test_verify_lengths.py's subject) would leave
    a test's full-depth paths to chance and compile every candidate length in every bucket."""
    return dataclasses.replace(spec, draft_len_schedule={1: spec.max_draft_len})


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


# Helpers appended for the suite's compile budget (issue 60).
import functools  # noqa: E402

import numpy as np  # noqa: E402


@functools.partial(jax.jit, static_argnums=(0, 4))
def _dense_greedy_rows(graphdef, state, buffer, starts, steps, limits):
    model = nnx.merge(graphdef, state)
    rows = jnp.arange(buffer.shape[0])

    def body(i, buf):
        pos = starts + i
        logits = model(buf)[rows, pos - 1]
        new = jnp.where(i < limits, jnp.argmax(logits, -1).astype(buf.dtype), buf[rows, pos])
        return buf.at[rows, pos].set(new)

    return jax.lax.fori_loop(0, steps, body, buffer)


def dense_greedy_refs(model: Llama, prompts, max_tokens) -> dict[tuple, list[int]]:
    """{tuple(prompt): dense_greedy(model, prompt, n)} for every prompt at once: one jitted
    loop over the prompts right-padded into one batch (causal: a row's padding never reaches
    its logits), one compile instead of one per prompt length and token count. `max_tokens`:
    an int, or a function of the prompt. No EOS stop (the test models have none)."""
    prompts = list(dict.fromkeys(tuple(p) for p in prompts))
    counts = [max_tokens(list(p)) if callable(max_tokens) else max_tokens for p in prompts]
    total = max(len(p) + n for p, n in zip(prompts, counts))
    if total > model.config.max_position_embeddings:
        raise ValueError(f"{total} tokens exceed the model's context")
    buffer = np.zeros((len(prompts), 1 << (total - 1).bit_length()), np.int32)
    for row, p in enumerate(prompts):
        buffer[row, :len(p)] = p
    starts = np.asarray([len(p) for p in prompts], np.int32)
    graphdef, state = nnx.split(model)
    out = np.asarray(_dense_greedy_rows(graphdef, state, buffer, starts, max(counts),
                                        np.asarray(counts, np.int32)))
    return {p: [int(t) for t in out[row, len(p):len(p) + n]]
            for row, (p, n) in enumerate(zip(prompts, counts))}


@functools.partial(jax.jit, static_argnums=0)
def _dense_argmax(graphdef, state, buffer):
    return jnp.argmax(nnx.merge(graphdef, state)(buffer)[0], axis=-1)


def is_dense_greedy(model: Llama, prompt, tokens, max_new_tokens: int,
                    eos_token_ids=()) -> bool:
    """Whether `dense_greedy(model, prompt, max_new_tokens, eos_token_ids) == tokens`, from
    one dense forward instead of one per token: greedy iff each token is the argmax of the
    dense logits after the prompt and the tokens before it, no EOS before the last, and the
    last is an EOS or the budget's. The buffer is `dense_greedy`'s (same shape; causal, so
    later tokens never reach earlier logits): each argmax is the one its loop takes."""
    prompt, tokens = list(prompt), list(tokens)
    if not tokens or len(tokens) > max_new_tokens or any(t in eos_token_ids
                                                         for t in tokens[:-1]):
        return False
    if len(tokens) < max_new_tokens and tokens[-1] not in eos_token_ids:
        return False
    total = len(prompt) + max_new_tokens
    buffer = np.zeros((1, 1 << (total - 1).bit_length()), np.int32)
    buffer[0, :len(prompt) + len(tokens)] = prompt + tokens
    argmax = np.asarray(_dense_argmax(*nnx.split(model), buffer))
    return [int(t) for t in argmax[len(prompt) - 1:len(prompt) + len(tokens) - 1]] == tokens
