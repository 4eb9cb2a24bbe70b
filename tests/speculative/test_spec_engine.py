"""Speculative decoding inside the engine: exact output, exact acceptance, exact KV ledger."""
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax import DraftTargetConfig, NGramConfig, SamplingParams, UserProvidedConfig
from specjax.engine.compile_counter import count_compilations
from specjax.models import Llama
from specjax.models.dense_greedy import dense_greedy

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [7],
           [9, 9, 9, 9, 9], [3, 3]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def greedy_refs(tiny_model):
    return {tuple(p): dense_greedy(tiny_model, p, 64) for p in PROMPTS}


class Oracle(specjax.Drafter):
    """Proposes the target's own greedy continuation with draft index `wrong` corrupted, and
    records how many tokens each request gained since its previous proposal."""

    def __init__(self, refs, wrong=None, vocab=64):
        self.refs, self.wrong, self.vocab = refs, wrong, vocab
        self.history: dict[int, list[tuple[int, int]]] = {}

    def propose_for(self, request_id, token_ids, max_draft_len):
        for prompt, ref in self.refs.items():
            full = list(prompt) + ref
            if len(token_ids) >= len(prompt) and list(token_ids) == full[:len(token_ids)]:
                draft = full[len(token_ids):len(token_ids) + max_draft_len]
                if self.wrong is not None and self.wrong < len(draft):
                    draft[self.wrong] = (draft[self.wrong] + 1) % self.vocab
                self.history.setdefault(request_id, []).append((len(token_ids), len(draft)))
                return draft
        raise AssertionError("oracle asked about a sequence that is not the greedy one")

    def propose(self, token_ids, max_draft_len):
        raise NotImplementedError


def _llm(model, spec, **kw):
    kw = {**dict(max_batch_size=4, tokens_per_block=4, prefill_chunk=8, progress=False), **kw}
    return specjax.LLM(model, speculative_config=spec, **kw)


def _full_pool(llm):
    return llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


@pytest.fixture(scope="module")
def draft_model(tiny_model):
    return Llama(tiny_model.config.replace(num_layers=1), rngs=nnx.Rngs(7))


MODES = {
    "ngram": lambda refs, target, draft: NGramConfig(max_draft_len=3),
    "ngram_private_sched": lambda refs, target, draft: NGramConfig(
        max_draft_len=4, draft_len_schedule={1: 4, 2: 2, 4: 1}, is_public_pool=False),
    "user_oracle": lambda refs, target, draft: UserProvidedConfig(max_draft_len=4,
                                                                  drafter=Oracle(refs, wrong=2)),
    "draft_target": lambda refs, target, draft: DraftTargetConfig(max_draft_len=3,
                                                                  speculative_model=draft),
    "draft_target_self": lambda refs, target, draft: DraftTargetConfig(
        max_draft_len=2, draft_len_schedule={1: 2, 3: 1}, speculative_model=target),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_equals_plain_greedy_across_batches_and_arrivals(mode, tiny_model, draft_model,
                                                                greedy_refs):
    llm = _llm(tiny_model, MODES[mode](greedy_refs, tiny_model, draft_model))
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for batch in ([PROMPTS[0]], PROMPTS[:3], PROMPTS):
        for prompt, out in zip(batch, llm.generate(batch, params)):
            assert out.token_ids == greedy_refs[tuple(prompt)][:MAX_TOKENS], (mode, prompt)
    # Requests joining a running batch mid-flight.
    engine = llm.engine
    ids, outs = {}, {}
    for i, prompt in enumerate(PROMPTS):
        ids[engine.add_request(prompt, params)] = prompt
        for _ in range(i):
            outs.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, prompt in ids.items():
        assert outs[rid].token_ids == greedy_refs[tuple(prompt)][:MAX_TOKENS]
    assert _full_pool(llm)
    if mode == "draft_target_self":  # the target drafting for itself is always right
        assert llm.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("wrong", [0, 1, 3])
def test_oracle_accepts_exactly_the_predicted_count(tiny_model, greedy_refs, wrong):
    D = 4
    oracle = Oracle(greedy_refs, wrong=wrong)
    llm = _llm(tiny_model, UserProvidedConfig(max_draft_len=D, drafter=oracle))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    for out in outs:
        history = oracle.history[out.request_id]
        # Each step gains (accepted + 1) tokens; with index `wrong` corrupted exactly
        # min(wrong, real draft length) drafts are accepted.
        for (length, drafted), (next_length, _) in zip(history, history[1:]):
            assert next_length - length == min(wrong, drafted) + 1
        # The last step's drafts are cut to the room left: a step emits drafts + 1 tokens.
        room = len(out.prompt_token_ids) + MAX_TOKENS - history[-1][0] - 1
        assert out.stats.num_accepted_draft_tokens == sum(min(wrong, d) for _, d in history[:-1]) \
            + min(wrong, history[-1][1], room)
    assert _full_pool(llm)


def test_statistics_ignore_padding(tiny_model, greedy_refs):
    """The same requests padded into different buckets give the same statistics."""
    prompts = PROMPTS[:3]
    figures = []
    for max_batch in (3, 8):  # 3 rows: no padded row, then one padded into bucket 4
        oracle = Oracle(greedy_refs, wrong=1)
        llm = _llm(tiny_model, UserProvidedConfig(max_draft_len=3, drafter=oracle),
                   max_batch_size=max_batch)
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
        stats = llm.stats
        proposed = sum(d for h in oracle.history.values() for _, d in h)
        assert stats.drafted_tokens <= proposed  # padded draft slots never count
        figures.append((stats.acceptance_rate, stats.acceptance_length, stats.drafted_tokens,
                        [o.stats.acceptance_length for o in outs]))
    assert figures[0] == figures[1]
    assert figures[0][0] == pytest.approx(1 / 3, abs=0.05)  # index 1 wrong of 3 -> ~1 in 3


def test_seeded_sampling_matches_plain_sampling(tiny_model, draft_model):
    """Strict acceptance draws each target token with the request's (seed, position) key, so a
    seeded sampled request gives exactly what plain sampled decoding gives."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_k=20, seed=11)
    plain = _llm(tiny_model, None).generate(PROMPTS, params)
    spec = _llm(tiny_model, DraftTargetConfig(max_draft_len=3, speculative_model=tiny_model))
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert spec.stats.acceptance_rate < 1.0  # the greedy drafts do get rejected sometimes


def test_overlap_on_and_off_give_identical_results(tiny_model, draft_model):
    spec = DraftTargetConfig(max_draft_len=3, draft_len_schedule={1: 3, 3: 1},
                             speculative_model=draft_model)
    mixed = [SamplingParams(max_tokens=MAX_TOKENS), SamplingParams(max_tokens=9),
             SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3),
             SamplingParams(max_tokens=5, stop_token_ids=(7,)), SamplingParams(max_tokens=17)]
    results = []
    for overlap in (True, False):
        llm = _llm(tiny_model, spec, overlap_scheduler=overlap)
        assert llm.engine.overlap == overlap
        outs = llm.generate(PROMPTS, mixed)
        results.append(([o.token_ids for o in outs], [o.finish_reason for o in outs],
                        llm.stats.accepted_draft_tokens, llm.stats.drafted_tokens))
        assert _full_pool(llm)
    assert results[0] == results[1]


class Wrong(specjax.Drafter):
    def __init__(self):
        self.calls = 0

    def propose(self, token_ids, max_draft_len):
        self.calls += 1
        return [(token_ids[-1] + 1 + i) % 64 for i in range(max_draft_len)]


def test_gate_trips_and_falls_back_without_recompiling(tiny_model, greedy_refs):
    drafter = Wrong()
    llm = _llm(tiny_model, UserProvidedConfig(max_draft_len=3, drafter=drafter,
                                              acceptance_rate_window_size=3,
                                              acceptance_rate_threshold=0.2))
    with count_compilations() as compiled:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
        assert compiled() == 0
    assert llm.engine.gate.disabled
    calls = drafter.calls
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=5))
    assert drafter.calls == calls  # speculation stays off for good
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_refs[tuple(prompt)][:MAX_TOKENS]


def test_no_compilation_after_warmup_in_spec_modes(tiny_model, draft_model):
    spec = DraftTargetConfig(max_draft_len=3, draft_len_schedule={1: 3, 2: 2, 3: 0},
                             speculative_model=draft_model)
    llm = _llm(tiny_model, spec)
    with count_compilations() as compiled:
        for n in (1, 2, 3, 4, 5, 2):
            llm.generate(PROMPTS[:n], SamplingParams(max_tokens=6))
        assert compiled() == 0


def test_randomized_kv_ledger(tiny_model, greedy_refs):
    """Hundreds of steps, requests of varying lengths joining and leaving, random accept
    patterns, a pool small enough to preempt: no block is ever lost or double-held, every
    running request's logical length equals its computed tokens, outputs stay exact."""
    rng = np.random.default_rng(0)

    class Random(Oracle):
        def propose_for(self, request_id, token_ids, max_draft_len):
            self.wrong = int(rng.integers(0, max_draft_len + 1))
            return super().propose_for(request_id, token_ids, int(rng.integers(0, max_draft_len + 1)))

    llm = _llm(tiny_model, UserProvidedConfig(max_draft_len=4, drafter=Random(greedy_refs)),
               num_kv_blocks=16, max_model_len=40)
    engine, alloc = llm.engine, llm.engine.allocator
    expected, finished, steps, peak = {}, {}, 0, 0
    while steps < 300:
        if rng.random() < 0.3 and len(expected) < 40:
            prompt = PROMPTS[int(rng.integers(len(PROMPTS)))]
            n = int(rng.integers(1, 40 - len(prompt) + 1))
            expected[engine.add_request(prompt, SamplingParams(max_tokens=n))] = \
                greedy_refs[tuple(prompt)][:n]
        if rng.random() < 0.03 and engine.running:  # cancellations too
            victim = engine.running[int(rng.integers(len(engine.running)))]
            engine.abort(victim.request_id)
            expected.pop(victim.request_id)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        assert alloc.num_free_blocks + alloc.num_held_blocks == alloc.total_blocks
        peak = max(peak, alloc.num_held_blocks)
        for r in engine.running:
            assert alloc.length(r.request_id) == r.num_computed
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, ref in expected.items():
        assert finished[rid].token_ids == ref
    assert _full_pool(llm) and peak <= alloc.total_blocks
    assert sum(o.stats.num_preemptions for o in finished.values()) > 0


def test_rejection_sampling_fails_closed_for_host_drafters(tiny_model, tiny_llm):
    """NGram drafts carry no distribution: with use_rejection_sampling the step keeps strict
    matching (decided by buffer shapes), so seeded sampling stays token-for-token plain."""
    llm = _llm(tiny_model, NGramConfig(max_draft_len=3, use_rejection_sampling=True))
    assert llm.engine.state.slots.draft_probs is None
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=s) for s in range(3)]
    prompts = [PROMPTS[3], PROMPTS[4], PROMPTS[3]]
    assert ([o.token_ids for o in llm.generate(prompts, params)]
            == [o.token_ids for o in tiny_llm.generate(prompts, params)])
    assert llm.stats.drafted_tokens > 0 and _full_pool(llm)


def test_rejection_sampling_draft_target_is_exact_for_greedy_and_frees_blocks(
        tiny_model, draft_model, greedy_refs):
    spec = DraftTargetConfig(max_draft_len=3, speculative_model=draft_model,
                             use_rejection_sampling=True)
    llm = _llm(tiny_model, spec)
    assert llm.engine.state.slots.draft_probs is not None
    params = [SamplingParams(max_tokens=MAX_TOKENS),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=2),
              SamplingParams(max_tokens=MAX_TOKENS)]
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], params)
    assert outs[0].token_ids == greedy_refs[tuple(PROMPTS[0])][:MAX_TOKENS]
    assert outs[2].token_ids == greedy_refs[tuple(PROMPTS[2])][:MAX_TOKENS]
    assert len(outs[1].token_ids) == MAX_TOKENS and _full_pool(llm)
