"""Structured output end to end on the bundled model: every constrained output parses and
validates (JSON schemas, regular expressions, choices) with speculation on; greedy constrained
speculative output equals plain constrained output token for token; sampled constrained output
follows the masked target distribution; KV blocks all come back and nothing compiles after
warm-up. (Every other speculative mode: tests/speculative/test_bundled_modes.py.)"""
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import specjax
from specjax import EagleConfig, NGramConfig, SamplingParams
from specjax.bench.structured import PROMPTS, REGEXES, SCHEMAS, cases
from specjax.engine.compile_counter import count_compilations
from specjax.engine.grammar import mask_width
from tests.spec_checks import acceptance_summary, full_depth

# One batch bucket and one prompt row a prefill step: these tests check grammars, not
# bucketing or prefill batching (tests/engine/test_engine.py).
SIZES = dict(max_batch_size=8, batch_sizes=(8,), prefill_chunk=32, max_prefill_rows=1,
             max_model_len=192, progress=False)
MAX_TOKENS = 96   # cases()' JSON outputs: each schema bounds its output well below it


def assert_valid(out, params: SamplingParams) -> None:
    assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
    if params.guided_json is not None:
        jsonschema.validate(json.loads(out.text), json.loads(params.guided_json))
    elif params.guided_regex is not None:
        assert re.fullmatch(params.guided_regex, out.text), (params.guided_regex, out.text)
    else:
        assert out.text in params.guided_choice


@pytest.fixture(scope="module")
def plain():
    llm = specjax.LLM("bundled", **SIZES)
    prompts, params = zip(*cases())
    return llm, llm.generate(list(prompts), list(params))


@pytest.fixture(scope="module")
def eagle():
    return specjax.LLM("bundled", speculative_config=full_depth(EagleConfig(max_draft_len=4)),
                       warmup=True, **SIZES)


@pytest.fixture(scope="module")
def eagle_cost_model():
    """The cost model choosing each step's length (its step costs measured at warm-up), at
    one batch bucket: where it chooses short lengths, forced tokens still make steps long."""
    return specjax.LLM("bundled", speculative_config=EagleConfig(max_draft_len=4),
                       warmup=True, **{**SIZES, "max_batch_size": 2, "batch_sizes": (2,)})


def test_the_cases_are_many_and_the_plain_outputs_valid(plain):
    _, outs = plain
    assert len(outs) >= 50
    for out, (_, params) in zip(outs, cases()):
        assert_valid(out, params)
    # The constraint does the work: unconstrained, the same prompts give no JSON at all.
    llm, _ = plain
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=24))
    for out in free:
        with pytest.raises(ValueError):
            json.loads(out.text)


def test_greedy_speculative_equals_plain_and_validates(plain, eagle):
    _, ref = plain
    prompts, params = zip(*cases())
    eagle.reset_stats()
    with count_compilations() as compiled:
        outs = eagle.generate(list(prompts), list(params))
        assert compiled() == 0, "a constrained request compiled a step after warm-up"
    for out, r, p in zip(outs, ref, params):
        assert_valid(out, p)
        assert out.token_ids == r.token_ids, (p.guided, out.text, r.text)
    stats = eagle.stats
    # Both paths ran: drafts accepted and drafts rejected (some cut by the grammar).
    assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens, acceptance_summary(stats)
    assert stats.acceptance_length > 1.3, acceptance_summary(stats)
    allocator = eagle.engine.allocator
    assert allocator.num_free_blocks == allocator.total_blocks


def test_mixed_batches_keep_the_unconstrained_rows_exact(plain, eagle):
    # Constrained and free rows share steps (which then are not overlapped); the free rows'
    # tokens are plain greedy's and the constrained rows' too.
    llm, _ = plain
    free = SamplingParams(max_tokens=40)
    mixed = [free, SamplingParams(max_tokens=MAX_TOKENS, guided_json=SCHEMAS[0]), free,
             SamplingParams(max_tokens=32, guided_regex=REGEXES[0])]
    prompts = PROMPTS + PROMPTS[:1]
    ref = llm.generate(prompts, mixed)
    outs = eagle.generate(prompts, mixed)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert_valid(outs[1], mixed[1])
    assert_valid(outs[3], mixed[3])


def test_host_drafts_are_cut_where_the_grammar_forbids_them(plain):
    # NGram drafts from the prompt's own text: mostly not JSON, so the grammar cuts them.
    _, ref = plain
    llm = specjax.LLM("bundled", speculative_config=NGramConfig(max_draft_len=4,
                                                                 max_matching_ngram_size=2),
                      **SIZES)
    prompts, params = zip(*cases()[:12])
    outs = llm.generate(list(prompts), list(params))
    for out, r, p in zip(outs, ref, params):
        assert_valid(out, p)
        assert out.token_ids == r.token_ids
    assert llm.stats.drafted_tokens > 0, acceptance_summary(llm.stats)


SAMPLED_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                  "n": {"type": "integer", "minimum": 0,
                                                        "maximum": 99}},
                  "required": ["name", "n"], "additionalProperties": False}


def target_logits(llm, outs, prompt_ids) -> np.ndarray:
    """The target's logits `[n, max_model_len, V]` at every position of each output's
    sequence, from one batched dense forward (padding after a sequence is never seen)."""
    padded = np.zeros((len(outs), SIZES["max_model_len"]), np.int32)
    for i, (out, _) in enumerate(outs):
        seq = prompt_ids + out.token_ids
        padded[i, :len(seq)] = seq
    return np.asarray(jax.jit(llm.model)(jnp.asarray(padded)), np.float64)


def exact_ranks(llm, outs, prompt_ids, logits, masked: bool) -> tuple[np.ndarray, np.ndarray]:
    """For every token after the first of each output (the first comes from the prompt's
    prefill; the rest from verification steps with drafts): the probability that the exact
    distribution p puts on its own argmax, and whether the token is that argmax. p is the
    target's T = 1 softmax at the token's prefix (`logits`: `target_logits`), over the
    tokens the grammar allows there (`masked`) or over all tokens (to show the check can
    fail)."""
    grammars = llm.engine.grammars
    probs, hits = [], []
    for (out, params), rows in zip(outs, logits):
        grammar = grammars.matcher(params)
        mask = np.zeros((1, mask_width(grammars.vocab_size)), np.int32)
        for j, token in enumerate(out.token_ids):
            row = rows[len(prompt_ids) + j - 1]
            if masked:
                grammar.matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
                bits = ((mask[0, :, None] >> np.arange(32)) & 1).reshape(-1)[:row.size]
                row = np.where(bits == 1, row, -np.inf)
            p = np.exp(row - row.max())
            p /= p.sum()
            if j >= 1:
                probs.append(p.max())
                hits.append(token == int(np.argmax(p)))
            assert grammar.advance(token)
    return np.array(probs), np.array(hits)


@pytest.mark.slow   # 128 sampled requests judged token by token: ~27 s here
def test_sampled_output_follows_the_masked_target(eagle):
    """Sampled at T = 1 by the EAGLE-3 engine (rejection sampling against draft distributions
    that know nothing of the grammar): how often each token is the argmax of its exact masked
    distribution p, against the sum of p(argmax). X_i = hit_i - p_i(argmax) are martingale
    differences in [-1, 1] when every token is drawn from its p, so by Azuma-Hoeffding
    |sum X_i| <= sqrt(2 n ln(2 / delta)) except with probability delta = 1e-6.

    Sized to the check's power: the same tokens judged without the mask fall short of it by
    0.22 a token on average (measured over 320 requests: 1120 below on n = 4981, bound 380),
    so 128 requests (n = 1979) fail it by 446 against a bound of 240: over 9 standard
    deviations beyond it (the sum's sd is at most sqrt(n) / 2 = 22)."""
    prompt = "import json\n\nconfig = "
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s,
                             guided_json=SAMPLED_SCHEMA) for s in range(128)]
    eagle.reset_stats()
    outs = eagle.generate([prompt] * len(params), params)
    for out, p in zip(outs, params):
        assert_valid(out, p)
    stats = eagle.stats
    assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens, acceptance_summary(stats)
    ids = eagle.encode(prompt)
    outs = list(zip(outs, params))
    logits = target_logits(eagle, outs, ids)
    probs, hits = exact_ranks(eagle, outs, ids, logits, masked=True)
    n = len(hits)
    bound = np.sqrt(2 * n * np.log(2 / 1e-6))
    assert n > 1000 and abs(hits.sum() - probs.sum()) <= bound, (n, hits.sum(), probs.sum(),
                                                                  bound)
    # Judged against the target without the grammar's mask, the same tokens fail.
    probs, hits = exact_ranks(eagle, outs, ids, logits, masked=False)
    assert abs(hits.sum() - probs.sum()) > bound, (hits.sum(), probs.sum(), bound)


def test_tokens_the_grammar_forces_are_drafted_by_the_host(plain, eagle_cost_model):
    # One long choice: after its first token every token is forced. The drafter knows nothing
    # of the grammar; the host drafts the forced tokens instead, and each step accepts them.
    choice = ["os.path.join(base, name) if name else base"]
    params = SamplingParams(max_tokens=40, guided_choice=choice)
    llm, _ = plain
    ref = llm.generate(PROMPTS[:2], params)
    for temperature in (0.0, 1.0):
        p = SamplingParams(max_tokens=40, guided_choice=choice, temperature=temperature, seed=3)
        outs = eagle_cost_model.generate(PROMPTS[:2], p)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        for out in outs:
            assert out.text == choice[0]
            assert out.stats.tokens_per_iteration > 2, out.stats   # plain decoding: 1
            assert out.stats.acceptance_rate == 1, out.stats
