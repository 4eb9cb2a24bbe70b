"""The host loop: exact greedy output, continuous batching, admission, preemption, cancel."""
import pytest
from flax import nnx

import specjax
from specjax import SamplingParams
from specjax.engine.compile_counter import count_compilations
from specjax.engine.engine import EngineConfig
from specjax.models import Llama
from specjax.models.dense_greedy import dense_greedy
from tests.conftest import TINY

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [7],
           [9, 9, 9, 9, 9], [3, 3], [60, 1, 60, 2, 60]]


@pytest.fixture(scope="module")
def references(tiny_model):
    return {tuple(p): dense_greedy(tiny_model, p, 12) for p in PROMPTS}


def _drain(engine):
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return outs


def test_greedy_equals_dense_reference(tiny_llm, references):
    outs = tiny_llm.generate(PROMPTS, SamplingParams(max_tokens=12))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == references[tuple(prompt)]
        assert out.finish_reason == "length"
        assert out.stats.decoding_iterations == 12


def test_requests_joining_mid_run(tiny_llm, references):
    engine = tiny_llm.engine
    ids = {engine.add_request(PROMPTS[0], SamplingParams(max_tokens=12)): PROMPTS[0]}
    outs = {}
    for i, prompt in enumerate(PROMPTS[1:]):
        for _ in range(i + 1):  # a growing gap between arrivals
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
        ids[engine.add_request(prompt, SamplingParams(max_tokens=12))] = prompt
    outs.update(_drain(engine))
    for rid, prompt in ids.items():
        assert outs[rid].token_ids == references[tuple(prompt)]
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks


def test_no_compilation_after_warmup(tiny_llm):
    with count_compilations() as compiled:
        for n in (1, 3, 2, 4, 6):  # every bucket, chunked prompts, mixed phases
            tiny_llm.generate(PROMPTS[:n], SamplingParams(max_tokens=5, temperature=0.8, top_k=5))
        assert compiled() == 0


def test_lazy_llm_compiles_what_it_uses_and_warmup_the_rest(tiny_model, references):
    """Without warmup=True an LLM compiles a shape when a batch first needs it: repeating a
    run compiles nothing, `warmup()` compiles the shapes not used yet, and after it mixed
    batches compile nothing."""
    params = SamplingParams(max_tokens=12)
    with count_compilations() as compiled:
        llm = specjax.LLM(tiny_model, max_batch_size=4, tokens_per_block=4, prefill_chunk=8,
                          max_prefill_rows=2, progress=False)
        built = compiled()  # the state's arrays; no step yet
        assert llm.generate(PROMPTS[0], params)[0].token_ids == references[tuple(PROMPTS[0])]
        first = compiled()
        assert first > built
        llm.generate(PROMPTS[0], params)
        assert compiled() == first
        llm.warmup()
        assert compiled() > first  # buckets 2 and 4 and the two-row prefill were left
        warmed = compiled()
        for n in (3, 1, 6, 2):
            outs = llm.generate(PROMPTS[:n], params)
            assert [o.token_ids for o in outs] == [references[tuple(p)] for p in PROMPTS[:n]]
        assert compiled() == warmed


def test_seeded_request_is_batch_invariant(tiny_llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42)
    alone = tiny_llm.generate([PROMPTS[2]], params)[0].token_ids
    others = SamplingParams(max_tokens=10, temperature=1.0)
    batched = tiny_llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[3]], [others, params, others])
    assert batched[1].token_ids == alone
    batched = tiny_llm.generate([PROMPTS[1], PROMPTS[4], PROMPTS[2]], [others, others, params])
    assert batched[2].token_ids == alone
    other_seed = tiny_llm.generate([PROMPTS[2]], SamplingParams(max_tokens=10, temperature=1.0,
                                                                 top_p=0.9, seed=43))[0]
    assert other_seed.token_ids != alone


def test_stop_token_ids_and_eos(tiny_model, tiny_llm, references):
    ref = references[tuple(PROMPTS[0])]
    stop = ref[4]
    out = tiny_llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, stop_token_ids=(stop,)))[0]
    assert out.token_ids == ref[:ref.index(stop) + 1] and out.finish_reason == "stop"
    # The same weights with that token as the model's EOS: greedy decoding ends on it, unless
    # the request ignores EOS; the other row never emits it and runs to its length.
    eos_model = Llama(TINY.replace(eos_token_id=stop), rngs=nnx.Rngs(0))
    nnx.update(eos_model, nnx.state(tiny_model))
    llm = specjax.LLM(eos_model, max_batch_size=2, tokens_per_block=4, prefill_chunk=8,
                      progress=False)
    other = references[tuple(PROMPTS[2])]
    assert stop not in other
    outs = llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[2]],
                        [SamplingParams(max_tokens=12),
                         SamplingParams(max_tokens=12, ignore_eos=True),
                         SamplingParams(max_tokens=12)])
    assert [(o.token_ids, o.finish_reason) for o in outs] == [
        (ref[:ref.index(stop) + 1], "stop"), (ref, "length"), (other, "length")]
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


def test_cancel_frees_blocks(tiny_llm):
    engine = tiny_llm.engine
    rid = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=50))
    keep = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3))
    engine.step()
    engine.step()
    assert engine.allocator.num_free_blocks < engine.allocator.total_blocks
    engine.abort(rid)
    outs = _drain(engine)
    assert rid not in outs and len(outs[keep].token_ids) == 3
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks
    engine.abort(rid)  # aborting twice is harmless


def test_cancel_waiting_request(tiny_llm):
    engine = tiny_llm.engine
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3))
    engine.abort(rid)
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def small_pool_llm(tiny_model):
    # 12 usable blocks of 4 tokens: room for about two requests of 20 tokens at once.
    return specjax.LLM(tiny_model, max_batch_size=4, tokens_per_block=4, prefill_chunk=8,
                       num_kv_blocks=13, max_model_len=48, progress=False)


def test_admission_waits_when_pool_is_full(small_pool_llm, tiny_model):
    engine = small_pool_llm.engine
    prompts = [[i + 1] * 14 for i in range(6)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts]
    engine.step()
    assert len(engine.running) < 4 and engine.waiting  # slots free, blocks not
    outs = _drain(engine)
    for rid, prompt in zip(ids, prompts):
        assert outs[rid].token_ids == dense_greedy(tiny_model, prompt, 12)
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks


def test_preemption_recomputes_exactly(small_pool_llm, tiny_model):
    # Short prompts are admitted together, then outgrow the pool while decoding.
    engine = small_pool_llm.engine
    prompts = [[i + 2, i + 3] for i in range(4)]
    greedy = SamplingParams(max_tokens=30)
    sampled = SamplingParams(max_tokens=30, temperature=1.0, seed=7)
    ids = [engine.add_request(p, greedy if i % 2 == 0 else sampled) for i, p in enumerate(prompts)]
    outs = _drain(engine)
    assert sum(outs[r].stats.num_preemptions for r in ids) > 0
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        if i % 2 == 0:
            assert outs[rid].token_ids == dense_greedy(tiny_model, prompt, 30)
    # The sampled request, recomputed after preemption, matches a run that was never preempted.
    roomy = specjax.LLM(tiny_model, max_batch_size=1, tokens_per_block=4, prefill_chunk=8,
                        max_model_len=48, progress=False)
    assert roomy.generate(prompts[1], sampled)[0].token_ids == outs[ids[1]].token_ids
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks


def test_context_limit_finishes_with_length(small_pool_llm):
    out = small_pool_llm.generate([[5] * 40], SamplingParams(max_tokens=100))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "prompt is empty"),
    ([1, 64], SamplingParams(), "outside the vocabulary"),
    ([-1], SamplingParams(), "outside the vocabulary"),
    ([1] * 48, SamplingParams(), "max_model_len"),
    ([1], "greedy", "sampling_params"),
])
def test_invalid_requests_rejected_before_work(small_pool_llm, prompt, params, match):
    engine = small_pool_llm.engine
    with pytest.raises(ValueError, match=match):
        small_pool_llm.generate([[1, 2], prompt], params)
    assert not engine.has_unfinished()  # the valid prompt was not started either


def test_plain_overlap_on_and_off_agree(tiny_model, tiny_llm, references):
    """Plain decoding dispatches step N+1 before reading step N; stop conditions, sampling and
    the KV ledger must come out exactly as with synchronous steps."""
    stop = references[tuple(PROMPTS[3])][2]  # it ends mid-batch, with its next step in flight
    mixed = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=3),
             SamplingParams(max_tokens=12, temperature=0.9, top_k=7, seed=5),
             SamplingParams(max_tokens=12, stop_token_ids=(stop,)),
             SamplingParams(max_tokens=1), SamplingParams(max_tokens=7)]
    engine = tiny_llm.engine
    assert engine.overlap
    engine.add_request(PROMPTS[0], mixed[0])
    engine.step()  # prefill
    engine.step()  # first generation step: dispatched, left unread
    assert engine.executor.inflight is not None
    _drain(engine)
    sync = specjax.LLM(tiny_model, max_batch_size=4, tokens_per_block=4, prefill_chunk=8,
                       max_prefill_rows=2, num_kv_blocks=80, overlap_scheduler=False,
                       progress=False)
    assert not sync.engine.overlap
    ahead = [(o.token_ids, o.finish_reason) for o in tiny_llm.generate(PROMPTS, mixed)]
    assert ahead == [(o.token_ids, o.finish_reason) for o in sync.generate(PROMPTS, mixed)]
    ref = references[tuple(PROMPTS[3])]
    assert ahead[3] == (ref[:ref.index(stop) + 1], "stop")
    assert engine.allocator.num_free_blocks == engine.allocator.total_blocks


@pytest.mark.parametrize("sizes", [(), (2, 3), (1, 2), (2, 1, 4), (0, 4), (4, 4), [1, 4]])
def test_batch_sizes_are_checked(sizes):
    with pytest.raises(ValueError, match="batch_sizes must be increasing ints"):
        EngineConfig(max_batch_size=4, batch_sizes=sizes)


def test_one_batch_size_pads_every_batch_to_it(tiny_model, references):
    llm = specjax.LLM(tiny_model, max_batch_size=4, batch_sizes=(4,), tokens_per_block=4,
                      prefill_chunk=8, max_prefill_rows=1, num_kv_blocks=80, progress=False)
    assert {b for b, _ in llm.engine.generation_shapes()} == {4}
    outs = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12))   # one row, padded to 4
    assert outs[0].token_ids == references[tuple(PROMPTS[0])]
    with count_compilations() as compiled:   # three rows: the same shape, nothing new
        outs = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]], SamplingParams(max_tokens=12))
        assert compiled() == 0
    assert [o.token_ids for o in outs] == [references[tuple(p)] for p in
                                           (PROMPTS[0], PROMPTS[2], PROMPTS[4])]
    allocator = llm.engine.allocator
    assert allocator.num_free_blocks == allocator.total_blocks


def test_scanned_and_unrolled_layers_give_the_same_tokens(tiny_model, tiny_llm, references):
    """CPU engines unroll the target's layers by default (one weight set per layer);
    `scan_layers=True` runs them under `lax.scan` over stacked weights. Both must emit plain
    greedy decoding's tokens."""
    assert not tiny_llm.engine.config.layers_scanned()
    assert set(tiny_llm.engine.executor.params.target["layers"]) == {0, 1}
    scanned = specjax.LLM(tiny_model, max_batch_size=4, tokens_per_block=4, prefill_chunk=8,
                          max_prefill_rows=2, num_kv_blocks=80, scan_layers=True,
                          progress=False)
    assert "gate_up_proj" in scanned.engine.executor.params.target["layers"]
    outs = scanned.generate(PROMPTS, SamplingParams(max_tokens=12))
    assert [o.token_ids for o in outs] == [references[tuple(p)] for p in PROMPTS]
