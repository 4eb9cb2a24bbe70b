"""Speculative decoding inside the engine: exact output, exact acceptance, exact KV ledger,
stop conditions inside accepted runs."""
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax import DraftTargetConfig, NGramConfig, SamplingParams, UserProvidedConfig
from specjax.analysis import trace
from specjax.engine.compile_counter import count_compilations
from specjax.models import Llama
from specjax.models.dense_greedy import dense_greedy
from tests.conftest import TINY
from tests.spec_checks import (assert_full_depth, assert_mixed_acceptance, noisy_copy,
                               truncated_copy)

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
    """The target cut to its first layer: another shape, right on about 40% of drafts."""
    return truncated_copy(tiny_model, 1)


@pytest.fixture(scope="module")
def noisy_model(tiny_model):
    """The target with noise on every weight: its shape, right on about 60% of drafts."""
    return noisy_copy(tiny_model, 0.2)


# A schedule that drafts 2 at batch sizes 1-2 and 1 from 3 on, shared by the self-drafting
# mode and its mixed-acceptance twin.
SELF_SCHEDULE = {1: 2, 3: 1}
MODES = {
    "ngram": lambda refs, m: NGramConfig(max_draft_len=3),
    "ngram_private_sched": lambda refs, m: NGramConfig(
        max_draft_len=4, draft_len_schedule={1: 4, 2: 2, 4: 1}, is_public_pool=False),
    "user_oracle": lambda refs, m: UserProvidedConfig(max_draft_len=4,
                                                      drafter=Oracle(refs, wrong=2)),
    "draft_target": lambda refs, m: DraftTargetConfig(max_draft_len=3,
                                                      speculative_model=m["draft"]),
    "draft_target_noisy": lambda refs, m: DraftTargetConfig(
        max_draft_len=2, draft_len_schedule=SELF_SCHEDULE, speculative_model=m["noisy"]),
    "draft_target_self": lambda refs, m: DraftTargetConfig(
        max_draft_len=2, draft_len_schedule=SELF_SCHEDULE, speculative_model=m["target"]),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_equals_plain_greedy_across_batches_and_arrivals(mode, tiny_model, draft_model,
                                                                noisy_model, greedy_refs):
    spec = MODES[mode](greedy_refs, dict(target=tiny_model, draft=draft_model,
                                         noisy=noisy_model))
    llm = _llm(tiny_model, spec)
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
        assert_full_depth(llm.stats, spec.max_draft_len)
    else:
        assert_mixed_acceptance(llm.stats, spec.max_draft_len)


@pytest.mark.parametrize("wrong", [0, 1, 3])
def test_oracle_accepts_exactly_the_predicted_count(tiny_model, greedy_refs, wrong):
    D = 4
    oracle = Oracle(greedy_refs, wrong=wrong)
    llm = _llm(tiny_model, UserProvidedConfig(max_draft_len=D, drafter=oracle))
    with trace(llm) as steps:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    verified_hist, accepted_hist = [0] * (D + 1), [0] * (D + 1)
    for out in outs:
        history = oracle.history[out.request_id]
        request_accepted = []
        # Each step gains (accepted + 1) tokens; with index `wrong` corrupted exactly
        # min(wrong, real draft length) drafts are accepted.
        for (length, drafted), (next_length, _) in zip(history, history[1:]):
            assert next_length - length == min(wrong, drafted) + 1
        # The last step's drafts are cut to the room left: a step emits drafts + 1 tokens.
        room = len(out.prompt_token_ids) + MAX_TOKENS - history[-1][0] - 1
        assert out.stats.num_accepted_draft_tokens == sum(min(wrong, d) for _, d in history[:-1]) \
            + min(wrong, history[-1][1], room)
        end = len(out.prompt_token_ids) + MAX_TOKENS
        for length, drafted in history:
            verified = min(drafted, end - length - 1)  # cut to the room left
            if verified:
                verified_hist[verified] += 1
                accepted_hist[min(wrong, verified)] += 1
                request_accepted.append(min(wrong, verified))
        # A request's AL counts its steps with drafts only; tokens per iteration counts all
        # of them (and the prompt's prefill, which gave the first token).
        n = len(request_accepted)
        # The trace holds the same per-step counts, in order.
        assert steps.per_request()[out.request_id].tolist() == request_accepted
        assert out.stats.num_steps_with_drafts == n
        assert out.stats.acceptance_length == pytest.approx((sum(request_accepted) + n) / n)
        assert out.stats.tokens_per_iteration == pytest.approx(
            len(out.token_ids) / out.stats.decoding_iterations)
    # Every request-step lands in the bins its drafts and accepted count say, and no other.
    trim = lambda hist: hist[:max(i for i, n in enumerate(hist) if n) + 1]
    assert llm.stats.verified_histogram == trim(verified_hist)
    assert llm.stats.accepted_histogram == trim(accepted_hist) == steps.accepted_histogram()
    assert all(r.draft_len == D for r in steps.records) and llm.stats.trace is None
    # AR_k: the share of request-steps with drafts that accepted at least k, for k up to the
    # deepest draft verified; AL = 1 + sum(AR_k).
    n = sum(accepted_hist)
    deepest = len(trim(verified_hist)) - 1
    expected = [sum(accepted_hist[k:]) / n for k in range(1, deepest + 1)]
    assert llm.stats.acceptance_per_position == pytest.approx(expected)
    assert 1 + sum(llm.stats.acceptance_per_position) == pytest.approx(llm.stats.acceptance_length)
    assert _full_pool(llm)
    # reset_stats starts from zero; the same requests then give the same figures again.
    first = (llm.stats.verified_histogram, llm.stats.accepted_histogram,
             llm.stats.acceptance_length, llm.stats.drafted_tokens)
    llm.reset_stats()
    assert llm.stats.drafted_tokens == 0 and llm.stats.acceptance_length is None
    assert llm.stats.acceptance_per_position == [] and llm.stats.verified_histogram == []
    llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert (llm.stats.verified_histogram, llm.stats.accepted_histogram,
            llm.stats.acceptance_length, llm.stats.drafted_tokens) == first


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
                        stats.verified_histogram, stats.accepted_histogram,
                        [o.stats.acceptance_length for o in outs]))
    assert figures[0] == figures[1]
    assert figures[0][0] == pytest.approx(1 / 3, abs=0.05)  # index 1 wrong of 3 -> ~1 in 3


def test_seeded_sampling_matches_plain_sampling(tiny_model, draft_model):
    """Strict acceptance draws each target token with the request's (seed, position) key, so a
    seeded sampled request gives exactly what plain sampled decoding gives."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_k=20, seed=11)
    plain = _llm(tiny_model, None).generate(PROMPTS, params)
    spec = _llm(tiny_model, DraftTargetConfig(max_draft_len=3, speculative_model=tiny_model,
                                              use_rejection_sampling=False))
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert_mixed_acceptance(spec.stats, 3)  # the greedy drafts do get rejected sometimes


def test_self_drafting_keeps_every_draft_under_bias_and_penalties(tiny_model, tiny_llm,
                                                                  greedy_refs):
    """The drafter biases and penalises its logits as verification will (counting the drafts
    before each): the target drafting for itself still has every draft accepted, and the
    output is plain decoding's under the same adjustments."""
    # The bias makes token 9 the choice until the frequency penalty outweighs it, after three
    # of them: within draft runs, so a drafter that forgot its own drafts would be rejected.
    params = SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.2, frequency_penalty=2.0,
                            presence_penalty=0.1, logit_bias={9: 6.0})
    spec = _llm(tiny_model, DraftTargetConfig(max_draft_len=3, speculative_model=tiny_model))
    outs = [o.token_ids for o in spec.generate(PROMPTS, params)]
    assert outs == [o.token_ids for o in tiny_llm.generate(PROMPTS, params)]
    assert all(o != greedy_refs[tuple(p)][:MAX_TOKENS] for o, p in zip(outs, PROMPTS))
    assert spec.stats.acceptance_rate == 1.0
    assert_full_depth(spec.stats, 3)
    assert _full_pool(spec)


@pytest.mark.parametrize("schedule", [None, {1: 3, 3: 1}], ids=["fixed", "scheduled"])
def test_overlap_on_and_off_give_identical_results(tiny_model, draft_model, greedy_refs,
                                                  schedule):
    spec = DraftTargetConfig(max_draft_len=3, draft_len_schedule=schedule,
                             speculative_model=draft_model)
    stop = greedy_refs[tuple(PROMPTS[3])][3]  # [9]*5 -> 3, 10, 60, 62: stops on its 4th token
    mixed = [SamplingParams(max_tokens=MAX_TOKENS), SamplingParams(max_tokens=9),
             SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3),
             SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop,)),
             SamplingParams(max_tokens=17)]
    results, figures = [], []
    for overlap in (True, False):
        llm = _llm(tiny_model, spec, overlap_scheduler=overlap)
        assert llm.engine.overlap == overlap
        outs = llm.generate(PROMPTS, mixed)
        results.append(([o.token_ids for o in outs], [o.finish_reason for o in outs]))
        stats = llm.stats
        figures.append((stats.accepted_draft_tokens, stats.drafted_tokens,
                        stats.verified_histogram, stats.accepted_histogram))
        assert _full_pool(llm)
        assert_mixed_acceptance(stats, 3)
    assert results[0] == results[1]
    if schedule is None:
        # Each request's drafts depend on its own tokens only, so every request-step verifies
        # and accepts the same drafts either way. (With a batch-size schedule they need not:
        # an overlapped step is sized before the unread one says which requests it finished.)
        assert figures[0] == figures[1]
    tokens, reasons = results[0]
    for i in (0, 1, 4):
        assert tokens[i] == greedy_refs[tuple(PROMPTS[i])][:mixed[i].max_tokens]
    ref = greedy_refs[tuple(PROMPTS[3])]
    assert tokens[3] == ref[:ref.index(stop) + 1] and reasons[3] == "stop"


class RightThenWrong(Oracle):
    """The oracle with draft 2 of 3 wrong (a third accepted, above the gate's threshold) for
    its first `right` proposals, every draft wrong after them."""

    def __init__(self, refs, right):
        super().__init__(refs, wrong=1)
        self.right, self.calls = right, 0

    def propose_for(self, request_id, token_ids, max_draft_len):
        self.calls += 1
        draft = super().propose_for(request_id, token_ids, max_draft_len)
        return draft if self.calls <= self.right else [(t + 1) % 64 for t in draft]


def test_gate_trips_and_falls_back_without_recompiling(tiny_model, greedy_refs):
    drafter = RightThenWrong(greedy_refs, right=12)
    # The schedule pins every step at 3 drafts (the cost model, which warm-up would enable,
    # would pick its own lengths): the gate is what this test watches.
    llm = _llm(tiny_model, UserProvidedConfig(max_draft_len=3, drafter=drafter,
                                              draft_len_schedule={1: 3},
                                              acceptance_rate_window_size=3,
                                              acceptance_rate_threshold=0.2), warmup=True)
    with count_compilations() as compiled, trace(llm) as steps:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
        assert compiled() == 0
    assert llm.engine.gate.disabled
    # The trace shows the rolling mean the gate saw and the step it tripped at: the first
    # whose full window averaged below the threshold; no step after it drafted.
    means, tripped = steps.gate_means(), steps.gate_tripped_at()
    assert tripped is not None and means[tripped] < 0.2
    assert all(m >= 0.2 for m in means[:tripped] if m == m)  # nan: window not full yet
    assert steps.draft_lens()[tripped + 1:].tolist() == [0] * (len(means) - tripped - 1)
    assert steps.draft_lens()[:tripped + 1].tolist() == [3] * (tripped + 1)
    # Drafts were accepted (and rejected) before the trip: both sides of the gate ran.
    assert_mixed_acceptance(llm.stats, 3)
    assert drafter.calls > drafter.right  # it tripped on the wrong drafts, not before them
    calls = drafter.calls
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=5))
    assert drafter.calls == calls  # speculation stays off for good
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_refs[tuple(prompt)][:MAX_TOKENS]


def test_no_compilation_after_warmup_in_spec_modes(tiny_model, draft_model):
    spec = DraftTargetConfig(max_draft_len=3, draft_len_schedule={1: 3, 2: 2, 3: 0},
                             speculative_model=draft_model)
    llm = _llm(tiny_model, spec, warmup=True)
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
    assert_mixed_acceptance(llm.stats, 4)


def test_rejection_sampling_fails_closed_for_host_drafters(tiny_model, tiny_llm, greedy_refs):
    """NGram drafts carry no distribution: with use_rejection_sampling the step keeps strict
    matching (decided by buffer shapes), so seeded sampling stays token-for-token plain."""
    llm = _llm(tiny_model, NGramConfig(max_draft_len=3, use_rejection_sampling=True))
    assert llm.engine.state.slots.draft_probs is None
    # The test model's logits are nearly flat: at 0.7 its samples are close to uniform and
    # NGram matches almost nothing; at 0.02 they still leave the greedy path but repeat
    # themselves, so drafts are accepted and rejected.
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=t, seed=s)
              for s, t in enumerate([0.02, 0.7, 0.02])]
    prompts = [PROMPTS[3], PROMPTS[4], PROMPTS[3]]
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs == [o.token_ids for o in tiny_llm.generate(prompts, params)]
    assert outs[0] != greedy_refs[tuple(PROMPTS[3])][:MAX_TOKENS]  # really sampled
    assert_mixed_acceptance(llm.stats, 3)
    assert _full_pool(llm)


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
    assert_mixed_acceptance(llm.stats, 3)


# ---- stop conditions inside accepted runs ---------------------------------------------------

STOP_D = 3


def _inside_every_run(ref, start):
    """(k, ref[k]) for the first k >= start where ref[k] appears nowhere before it and, with
    every draft accepted, more drafts of the same step follow it. The prompt step emits ref[0];
    a host drafter proposes for every generation step, so step j emits ref[1 + j(D+1)] ..
    ref[(j+1)(D+1)]; an in-step draft model drafts first in the first generation step, which
    emits ref[1] alone, and the runs after it start at ref[2]. The test then checks that
    drafts were accepted after the stop, rather than trusting this."""
    last_but_one = STOP_D - 2  # the stop may be at most the last draft but one of its run
    for k in range(start, len(ref)):
        if ((k - 1) % (STOP_D + 1) <= last_but_one and (k - 2) % (STOP_D + 1) <= last_but_one
                and ref[k] not in ref[:k]):
            return k, ref[k]
    raise AssertionError(f"no token of {ref} lies inside a run after index {start}")


@pytest.fixture(scope="module")
def eos_case(tiny_model, greedy_refs):
    """(model, eos, stop): the test model with an EOS id that the greedy continuation of
    PROMPTS[0] emits mid-run, and a later token of it to use as a stop token id."""
    ref = greedy_refs[tuple(PROMPTS[0])]
    k_eos, eos = _inside_every_run(ref, 5)  # not in the first generation steps
    k_stop, stop = _inside_every_run(ref, k_eos + 1)
    assert k_stop < MAX_TOKENS
    model = Llama(TINY.replace(eos_token_id=eos), rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(tiny_model))  # the same weights: the same greedy references
    return model, eos, stop


def _expected(ref, params, eos):
    """The reference cut by the engine's rules: the first stop token id (or EOS, unless
    ignored) ends the output and is part of it."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {eos})
    for i, token in enumerate(ref):
        if token in stops:
            return ref[:i + 1], "stop"
    return ref, "length"


STOP_SETUPS = {  # drafts that are always right, so every step accepts all STOP_D of them
    "host_oracle": lambda refs, model: UserProvidedConfig(max_draft_len=STOP_D,
                                                          drafter=Oracle(refs)),
    "draft_target_overlap": lambda refs, model: DraftTargetConfig(max_draft_len=STOP_D,
                                                                  speculative_model=model),
    "draft_target_sync": lambda refs, model: DraftTargetConfig(max_draft_len=STOP_D,
                                                               speculative_model=model),
}


@pytest.mark.parametrize("setup", list(STOP_SETUPS))
def test_stop_and_eos_inside_an_accepted_run(setup, eos_case, greedy_refs):
    """EOS and a stop token id, each the first draft of a step that accepted more drafts after
    it: the output ends exactly at it ("stop"), the rest of the run is dropped with the
    request's blocks, ignore_eos runs past EOS, and the other rows of the batch -- including
    the step already in flight with the overlap scheduler -- go on exactly."""
    model, eos, stop = eos_case
    spec = STOP_SETUPS[setup](greedy_refs, model)
    llm = _llm(model, spec, overlap_scheduler=setup != "draft_target_sync")
    engine = llm.engine
    # A host drafter needs every token so far, so its steps never overlap.
    overlapped = setup == "draft_target_overlap"
    assert engine.speculation.overlap == (setup != "host_oracle")
    rows = [(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS)),  # ends on EOS
            (PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                        stop_token_ids=(stop,))),  # past EOS, ends on `stop`
            (PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)),
            (PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS)),  # neither emits EOS
            (PROMPTS[4], SamplingParams(max_tokens=MAX_TOKENS))]
    ids = [engine.add_request(prompt, params) for prompt, params in rows]
    outs, next_step_in_flight = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
                step = engine.executor.inflight
                next_step_in_flight[out.request_id] = step is not None and any(
                    row.request.request_id == out.request_id for row in step.rows)
    for rid, (prompt, params) in zip(ids, rows):
        tokens, reason = _expected(greedy_refs[tuple(prompt)][:MAX_TOKENS], params, eos)
        assert (outs[rid].token_ids, outs[rid].finish_reason) == (tokens, reason), (setup, rid)
    assert [outs[rid].finish_reason for rid in ids] == ["stop", "stop", "length", "length",
                                                        "length"]
    assert eos in outs[ids[2]].token_ids  # ignore_eos did run past it
    for rid in ids[:2]:
        out = outs[rid]
        # Tokens the request's steps produced (one per step, plus its accepted drafts) that
        # the output dropped: 2 or more means the step that emitted the stop also accepted a
        # draft after it (and its bonus token), i.e. the stop was inside the accepted run.
        emitted = out.stats.decoding_iterations + out.stats.num_accepted_draft_tokens
        assert emitted - len(out.token_ids) >= 2, (setup, out.stats)
        assert next_step_in_flight[rid] == overlapped
        if setup == "host_oracle":  # its last proposal had the stop before its last draft
            start, drafted = spec.drafter.history[rid][-1]
            stop_at = len(out.prompt_token_ids) + len(out.token_ids) - 1
            assert start <= stop_at < start + drafted - 1
    assert llm.stats.acceptance_rate == 1.0
    assert_full_depth(llm.stats, STOP_D)
    assert _full_pool(llm)
