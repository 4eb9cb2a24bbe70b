"""SA inside the engine: greedy output equal to plain decoding for SA alone and for every
in-step drafter with the SA enhancer (batch 1 and 4, overlap on and off, nothing compiled after
warm-up, the pool back to full), the enhancer choosing per request, seeded sampling equal to
plain sampling (SA's drafts are accepted by strict matching), the global pool, and configs.

The prompts repeat spans of the perm target's own greedy text, so SA finds matches that are
right for a while and then wrong (the target's layers perturb its permutation by context).
"""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax import SamplingParams
from specjax.core.sampling import sample, sampling_keys
from specjax.engine.compile_counter import count_compilations
from specjax.models import Llama
from specjax.models.dense_greedy import dense_greedy
from specjax.speculative.config import (AutoConfig, DFlashConfig, DraftTargetConfig, EagleConfig,
                                        MTPConfig, NGramConfig, PARDConfig, SAConfig,
                                        SAEnhancerConfig, SpeculativeConfig)
from specjax.speculative.defaults import resolve_auto
from tests.spec_checks import assert_mixed_acceptance, truncated_copy
from tests.speculative.perm_models import (CFG, PROMPTS, eagle_head, mtp_heads,
                                           trained_parallel_drafter)

D = 4
MAX_TOKENS = 24


def _llm(target, spec, **kw):
    # One prompt chunk per prefill step: one prefill shape to compile per engine.
    kw = {**dict(max_batch_size=4, tokens_per_block=4, prefill_chunk=8, max_prefill_rows=1,
                 progress=False), **kw}
    return specjax.LLM(target, speculative_config=spec, **kw)


def _full_pool(llm):
    return llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


@pytest.fixture(scope="module")
def repetitive(perm_target):
    """Prompts that repeat the target's own text: [p, g[:12], p, g[:2]] with g plain greedy's
    continuation of p, and a short one whose repeat starts mid-prompt; with plain greedy's
    continuations."""
    target, _ = perm_target
    prompts = []
    for p in PROMPTS[:4]:
        g = dense_greedy(target, p, 12)
        prompts.append(p + g + p + g[:2])
    prompts.append([5, 6, 7, 8, 5, 6])
    return prompts, {tuple(p): dense_greedy(target, p, MAX_TOKENS) for p in prompts}


def _greedy(llm, prompts, batch):
    return [out for i in range(0, len(prompts), batch)
            for out in llm.generate(prompts[i:i + batch], SamplingParams(max_tokens=MAX_TOKENS))]


def _built_on_first_use(make):
    """kind -> make(kind), each made once (`.made` holds them)."""
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = make(kind)
        return made[kind]

    get.made = made
    return get


@pytest.fixture(scope="module")
def drafters(perm_target, tmp_path_factory):
    target, perm = perm_target
    return _built_on_first_use(lambda kind: trained_parallel_drafter(
        kind, target, perm, tmp_path_factory.mktemp(kind), depth=D))


def _enhanced(kind, target, perm, drafters, threshold=4, **kw):
    sa = SAEnhancerConfig(threshold=threshold)
    if kind == "eagle3":
        return EagleConfig(max_draft_len=D, speculative_model=eagle_head(target, perm),
                           sa_config=sa, **kw)
    if kind == "eagle3-tree":
        return EagleConfig(max_draft_len=D, speculative_model=eagle_head(target, perm),
                           use_dynamic_tree=True, dynamic_tree_max_topK=2,
                           max_total_draft_tokens=8, sa_config=sa, **kw)
    if kind == "mtp":
        return MTPConfig(max_draft_len=D, num_nextn_predict_layers=1, speculative_model=mtp_heads(1),
                         sa_config=sa, **kw)
    if kind == "draft_target":
        return DraftTargetConfig(max_draft_len=D, speculative_model=truncated_copy(target, 1),
                                 sa_config=sa, **kw)
    if kind == "pard":
        return PARDConfig(max_draft_len=D, speculative_model=drafters("pard"),
                          mask_token_id=CFG.vocab_size, sa_config=sa, **kw)
    return DFlashConfig(max_draft_len=D, speculative_model=drafters("dflash"), sa_config=sa, **kw)


@pytest.fixture(scope="module")
def llms(perm_target, drafters):
    """One warmed-up engine per configuration, built on first use; every pool full at the end."""
    target, perm = perm_target
    get = _built_on_first_use(lambda kind: _llm(
        target, SAConfig(max_draft_len=D) if kind == "sa"
        else _enhanced(kind, target, perm, drafters), warmup=True))
    yield get
    for llm in get.made.values():
        assert _full_pool(llm)


def _check_greedy(llm, repetitive, batch, overlap):
    """The repetitive prompts, `batch` at a time: plain greedy's tokens, nothing compiled (the
    engine was warmed up), the pool full again; -> the run's statistics."""
    prompts, refs = repetitive
    llm.engine.overlap = overlap
    llm.reset_stats()
    with count_compilations() as compiled:
        outs = _greedy(llm, prompts, batch)
        assert compiled() == 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == refs[tuple(prompt)], prompt
    assert _full_pool(llm)
    return llm.stats


@pytest.mark.parametrize("batch,overlap", [(1, True), (4, True), (4, False)])
def test_sa_greedy_output_equals_plain_decoding(llms, repetitive, batch, overlap):
    assert_mixed_acceptance(_check_greedy(llms("sa"), repetitive, batch, overlap), D)


ENHANCED = ["eagle3", "eagle3-tree", "mtp", "draft_target", "pard", "dflash"]


@pytest.mark.parametrize("kind", ENHANCED)
@pytest.mark.parametrize("batch,overlap", [(1, True), (4, True), (4, False)])
def test_enhanced_greedy_output_equals_plain_decoding(llms, repetitive, kind, batch, overlap):
    stats = _check_greedy(llms(kind), repetitive, batch, overlap)
    assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens, kind


def _wrong_drafter(target):
    """A draft model of random weights: its drafts are almost never the target's."""
    return Llama(target.config.replace(num_layers=1), rngs=nnx.Rngs(7))


def test_the_enhancer_switches_per_request(perm_target, repetitive):
    """One batch: a request whose context repeats and one whose does not, with a drafter
    that is always wrong. Only the repeating request accepts drafts -- SA's, which replace the
    drafter's for it alone -- and the other verifies the drafter's (all rejected)."""
    target, _ = perm_target
    prompts, refs = repetitive
    rng = np.random.default_rng(5)
    fresh = rng.permutation(CFG.vocab_size)[:6].tolist()  # no token repeats: no match at first
    params = [SamplingParams(max_tokens=MAX_TOKENS), SamplingParams(max_tokens=8)]
    spec = DraftTargetConfig(max_draft_len=D, speculative_model=_wrong_drafter(target),
                             sa_config=SAEnhancerConfig(threshold=3))
    llm = _llm(target, spec, max_batch_size=2)
    outs = llm.generate([prompts[1], fresh], params)
    assert outs[0].token_ids == refs[tuple(prompts[1])]
    assert outs[1].token_ids == dense_greedy(target, fresh, 8)
    accepted = [o.stats.num_accepted_draft_tokens for o in outs]
    drafted = [o.stats.num_draft_tokens for o in outs]
    assert accepted[0] >= 6 and accepted[1] == 0 and drafted[1] >= 4, (accepted, drafted)
    assert _full_pool(llm)


def test_strict_rows_and_rejection_rows_in_one_step(perm_target, repetitive):
    """Greedy and sampled requests together with EAGLE-3 + SA under rejection sampling: the
    greedy ones stay plain greedy's, every request finishes, and the pool is full again."""
    target, perm = perm_target
    prompts, refs = repetitive
    llm = _llm(target, _enhanced("eagle3", target, perm, None))
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8 * (i % 2), seed=i)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert len(out.token_ids) == MAX_TOKENS
        if i % 2 == 0:
            assert out.token_ids == refs[tuple(prompt)]
    assert llm.engine.state.slots.strict is not None
    assert _full_pool(llm)


def test_sa_rows_are_accepted_strictly_under_rejection_sampling(llms, perm_target, repetitive):
    """EAGLE-3 + SA with rejection sampling, sampled: every token emitted by a step that
    verified SA's drafts is the target's own draw for its position -- the request's key at
    that position applied to the target's distribution given the tokens before it -- as
    strict matching makes it. (Rejection sampling would judge SA's drafts against the head's
    distribution, which did not draw them, and emit other tokens.)"""
    prompts, _ = repetitive
    llm = llms("eagle3")  # EAGLE-3 with rejection sampling (the default) + SA (threshold 4)
    llm.engine.overlap = False  # the slot state read after a step is what the next verifies
    engine = llm.engine
    requests = [engine.requests[engine.add_request(
        p, SamplingParams(max_tokens=20, temperature=1.0, seed=i))] for i, p in enumerate(prompts)]
    from_sa = {}
    checked = []  # (request, position in prompt + output) of tokens from SA-verifying steps
    while engine.has_unfinished():
        before = [len(r.output_ids) for r in requests]
        engine.step()
        for i, r in enumerate(requests):
            if from_sa.get(i):
                checked += [(i, len(r.prompt_ids) + k) for k in range(before[i],
                                                                       len(r.output_ids))]
        slots = engine.executor.state.slots
        strict, num = np.asarray(slots.strict), np.asarray(slots.num_drafts)
        for i, r in enumerate(requests):
            from_sa[i] = (r.finish_reason is None and r.slot is not None
                          and bool(strict[r.slot]) and num[r.slot] > 0)
    assert len(checked) >= 20, len(checked)
    target, _ = perm_target
    sampled_rows = 0
    for i, r in enumerate(requests):
        seq = r.prompt_ids + r.output_ids
        logits = target(jnp.asarray([seq], jnp.int32))[0]
        positions = [t for j, t in checked if j == i]
        if not positions:
            continue
        t = jnp.asarray(positions)
        want = sample(logits[t - 1], jnp.ones(len(t)), jnp.zeros(len(t), jnp.int32),
                      jnp.ones(len(t)), jnp.zeros(len(t)),
                      sampling_keys(jnp.full(len(t), r.seed, jnp.uint32), t))
        assert [seq[p] for p in positions] == want.tolist(), i
        sampled_rows += 1
    assert sampled_rows >= 3
    assert _full_pool(llm)


def test_sa_sampled_output_equals_plain_sampling(perm_target, repetitive):
    """SA's drafts are accepted by strict matching: a seeded sampled request emits the target's
    own draws, token for token what plain sampling emits."""
    target, _ = perm_target
    prompts, _ = repetitive
    params = [SamplingParams(max_tokens=16, temperature=0.7, seed=s) for s in range(4)]
    plain = _llm(target, None).generate(prompts[:4], params)
    llm = _llm(target, SAConfig(max_draft_len=D))
    outs = llm.generate(prompts[:4], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.stats.accepted_draft_tokens > 0
    assert _full_pool(llm)


def test_global_pool_drafts_from_a_finished_request(perm_target, repetitive):
    """A request that continues text an earlier request produced: with the global pool its
    drafts come from that request's history and it accepts more; output stays exact."""
    target, _ = perm_target
    first = PROMPTS[1]
    text = dense_greedy(target, first, 20)
    second = [60, 61] + first + text[:3]  # its own context has little to match
    want = dense_greedy(target, second, 12)
    accepted = {}
    for pool in (False, True):
        llm = _llm(target, SAConfig(max_draft_len=D, enable_global_pool=pool,
                                    global_pool_size=2 if pool else None), max_batch_size=1)
        llm.generate([first], SamplingParams(max_tokens=20))
        out = llm.generate([second], SamplingParams(max_tokens=12))[0]
        assert out.token_ids == want, pool
        accepted[pool] = out.stats.num_accepted_draft_tokens
        assert _full_pool(llm)
    assert accepted[True] > accepted[False] + 3, accepted


def test_sa_configs_are_checked_and_round_trip():
    config = SAConfig(max_draft_len=8, max_matching_ngram_size=3, enable_global_pool=True,
                      global_pool_size=4)
    assert SpeculativeConfig.from_json(config.to_json()) == config
    assert config.use_rejection_sampling is False
    for kw, fragment in [(dict(use_rejection_sampling=True), "no draft distribution"),
                         (dict(max_matching_ngram_size=0), "max_matching_ngram_size"),
                         (dict(max_matching_ngram_size=65), "max_matching_ngram_size"),
                         (dict(global_pool_size=3), "enable_global_pool"),
                         (dict(enable_global_pool=True, global_pool_size=0), "global_pool_size")]:
        with pytest.raises(ValueError, match=fragment):
            SAConfig(**kw)
    eagle = EagleConfig(speculative_model="head", sa_config={"threshold": 6})
    assert eagle.sa_config == SAEnhancerConfig(threshold=6)
    assert SpeculativeConfig.from_json(eagle.to_json()) == eagle
    for bad, fragment in [({"threshold": 0}, "threshold"), ({"threshold": 65}, "threshold"),
                          ({"thresh": 4}, "unknown field"), (4, "sa_config must be")]:
        with pytest.raises(ValueError, match=fragment):
            EagleConfig(speculative_model="head", sa_config=bad)
    with pytest.raises(ValueError, match="unknown field"):
        SpeculativeConfig.from_dict({"mode": "ngram", "sa_config": {"threshold": 4}})


def test_auto_resolves_by_the_heuristic_and_is_visible(perm_target, caplog):
    target, _ = perm_target
    small = resolve_auto(AutoConfig(), None, 4)
    assert isinstance(small, NGramConfig)
    assert (small.max_draft_len, small.max_matching_ngram_size) == (5, 3)
    large = resolve_auto(AutoConfig(), None, 64)
    assert (large.max_draft_len, large.max_matching_ngram_size) == (3, 5)
    assert large.schedule == {1: 3, 33: 0}
    assert resolve_auto(AutoConfig(max_concurrency=8), None, 16).schedule == {1: 3, 9: 0}
    bundled = resolve_auto(AutoConfig(), "bundled", 4)
    assert isinstance(bundled, (EagleConfig, DraftTargetConfig))  # the shipped drafter
    assert SpeculativeConfig.from_dict({"mode": "auto"}) == AutoConfig()
    with caplog.at_level("INFO", logger="specjax"):
        llm = _llm(target, AutoConfig(), max_batch_size=2)
    assert llm.speculative_config == small
    assert "AUTO" in caplog.text
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8))[0]
    assert out.token_ids == dense_greedy(target, PROMPTS[1], 8)
