"""Log-probabilities, logit bias and penalties against the dense reference forward: what the
paged, chunked, batched engine reports is what the model says about the whole sequence."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax import SamplingParams

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
           [9, 9, 9, 9, 9]]
TOL = 1e-4   # the dense forward and the paged one sum in different orders


WIDTH = 64   # every reference forward runs at this length: one compile (causal: padding
             # after a sequence changes none of its rows)


@functools.lru_cache(maxsize=None)
def _jitted(model):
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, buf: nnx.merge(graphdef, state)(buf)[0])
    return lambda seq: np.asarray(forward(state, jnp.asarray(
        [list(seq) + [0] * (WIDTH - len(seq))], jnp.int32)), np.float64)[:len(seq)]


def dense_logprobs(model, seq) -> np.ndarray:
    """[len(seq), V]: row t is log p(. | seq[:t+1])."""
    logits = _jitted(model)(seq)
    return logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1,
                                  keepdims=True)) - logits.max(-1, keepdims=True)


def assert_entry(entry, row: np.ndarray, token: int, k: int) -> None:
    """One {token: logprob} entry against the reference distribution `row` [V]."""
    top = list(np.argsort(-row, kind="stable")[:k])
    assert list(entry)[:k] == top or np.allclose(sorted(row[list(entry)[:k]]),
                                                 sorted(row[top]), atol=TOL)  # near-ties
    assert token in entry and len(entry) in (k, k + 1)
    for t, lp in entry.items():
        assert abs(lp - row[t]) < TOL, (t, lp, row[t])


def test_logprobs_equal_dense_forward(tiny_llm, tiny_model):
    params = SamplingParams(max_tokens=10, logprobs=3, prompt_logprobs=2)
    for prompt, out in zip(PROMPTS, tiny_llm.generate(PROMPTS, params)):
        ref = dense_logprobs(tiny_model, prompt + out.token_ids)
        P = len(prompt)
        assert len(out.logprobs) == len(out.token_ids)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert_entry(entry, ref[P + i - 1], token, 3)
            assert next(iter(entry)) == token   # greedy: the chosen token is the top one
        # Prompt tokens: one entry each, the first without context (the 18-token prompt
        # runs in three chunks of 8).
        assert len(out.prompt_logprobs) == P and out.prompt_logprobs[0] is None
        for t in range(1, P):
            assert_entry(out.prompt_logprobs[t], ref[t - 1], prompt[t], 2)


def test_logprobs_zero_and_stop_cut(tiny_llm):
    full = tiny_llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, logprobs=0))[0]
    assert all(list(e) == [t] for e, t in zip(full.logprobs, full.token_ids))
    # A stop token ends the output mid-step: the entries end with it.
    stop = full.token_ids[4]
    cut = tiny_llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, logprobs=1,
                                                       stop_token_ids=(stop,)))[0]
    assert cut.token_ids[-1] == stop and len(cut.logprobs) == len(cut.token_ids)
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]
    # Without the option nothing is reported.
    assert tiny_llm.generate(PROMPTS[0], SamplingParams(max_tokens=3))[0].logprobs is None


def test_logprobs_survive_preemption(tiny_model):
    """Preempted requests are recomputed: their entries are neither lost nor repeated."""
    small = specjax.LLM(tiny_model, max_batch_size=4, tokens_per_block=4, prefill_chunk=8,
                        num_kv_blocks=13, max_model_len=48, progress=False)
    prompts = [[i + 2, i + 3, i + 4] for i in range(4)]
    params = SamplingParams(max_tokens=28, logprobs=2, prompt_logprobs=1)
    outs = small.generate(prompts, params)
    assert sum(o.stats.num_preemptions for o in outs) > 0
    for prompt, out in zip(prompts, outs):
        ref = dense_logprobs(tiny_model, prompt + out.token_ids)
        assert len(out.logprobs) == len(out.token_ids) == 28
        assert len(out.prompt_logprobs) == len(prompt)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert_entry(entry, ref[len(prompt) + i - 1], token, 2)
    assert small.engine.allocator.num_free_blocks == small.engine.allocator.total_blocks


def penalized_greedy(model, prompt, n, params) -> list[int]:
    """Plain greedy decoding with vLLM's penalty rules, on the dense forward: the semantics
    `specjax.core.penalties` must implement."""
    seq = list(prompt)
    for _ in range(n):
        x = _jitted(model)(seq)[-1]
        for t, b in params.logit_bias:
            x[t] += b
        out = np.bincount(seq[len(prompt):], minlength=x.size)
        seen = (out > 0) | (np.bincount(prompt, minlength=x.size) > 0)
        r = params.repetition_penalty
        x = np.where(seen, np.where(x > 0, x / r, x * r), x)
        x = x - params.frequency_penalty * out - params.presence_penalty * (out > 0)
        seq.append(int(np.argmax(x)))
    return seq[len(prompt):]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=16, presence_penalty=1.5),
    SamplingParams(max_tokens=16, frequency_penalty=0.7),
    SamplingParams(max_tokens=16, repetition_penalty=1.8),
    SamplingParams(max_tokens=16, repetition_penalty=0.5, frequency_penalty=-0.5,
                   logit_bias={7: 2.0, 11: -3.0}),
    SamplingParams(max_tokens=16, logit_bias={30: 100.0}),
], ids=["presence", "frequency", "repetition", "mixed", "bias"])
def test_penalties_and_bias_equal_dense_reference(tiny_llm, tiny_model, params):
    plain = tiny_llm.generate(PROMPTS, SamplingParams(max_tokens=16))
    outs = tiny_llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == penalized_greedy(tiny_model, prompt, 16, params)
    # The options change the output (the reference is not plain greedy in disguise).
    assert any(a.token_ids != b.token_ids for a, b in zip(plain, outs))
    if params.logit_bias == ((30, 100.0),):
        assert all(o.token_ids == [30] * 16 for o in outs)
