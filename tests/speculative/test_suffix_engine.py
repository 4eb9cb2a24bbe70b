"""SA inside the engine: greedy output equal to plain decoding (batch 1 and 4, overlap on and
off, nothing compiled after warm-up, the pool back to full), seeded sampling equal to plain
sampling (SA's drafts are accepted by strict matching), the global pool, SA and AUTO configs.
The enhancer's tests are in `test_sa_enhancer.py`.

The prompts repeat spans of the perm target's own greedy text (`repetitive`), so SA finds
matches that are right for a while and then wrong (the target's layers perturb its
permutation by context).
"""
import pytest

from specjax import SamplingParams
from specjax.models.dense_greedy import dense_greedy
from specjax.speculative.config import (AutoConfig, DraftTargetConfig, EagleConfig, NGramConfig,
                                        SAConfig, SAEnhancerConfig, SpeculativeConfig)
from specjax.speculative.defaults import resolve_auto
from tests.spec_checks import assert_mixed_acceptance
from tests.speculative.perm_models import PROMPTS
from tests.speculative.sa_engines import D, check_greedy, full_pool, make_llm


@pytest.fixture(scope="module")
def sa_llm(perm_target):
    """SA alone, every shape compiled at the start; the pool full at the end. Full depth
    pinned: warm-up turns on the cost model, whose timing-dependent choices would leave the
    full-depth checks to chance (`test_verify_lengths` tests the choices)."""
    llm = make_llm(perm_target[0], SAConfig(max_draft_len=D, draft_len_schedule={1: D}),
                   warmup=True)
    yield llm
    assert full_pool(llm)


@pytest.mark.parametrize("batch,overlap", [(1, True), (4, True), (4, False)])
def test_sa_greedy_output_equals_plain_decoding(sa_llm, repetitive, batch, overlap):
    assert_mixed_acceptance(check_greedy(sa_llm, repetitive, batch, overlap), D)


def test_sa_sampled_output_equals_plain_sampling(perm_target, repetitive):
    """SA's drafts are accepted by strict matching: a seeded sampled request emits the target's
    own draws, token for token what plain sampling emits."""
    target, _ = perm_target
    prompts, _ = repetitive
    params = [SamplingParams(max_tokens=16, temperature=0.7, seed=s) for s in range(4)]
    plain = make_llm(target, None).generate(prompts[:4], params)
    llm = make_llm(target, SAConfig(max_draft_len=D))
    outs = llm.generate(prompts[:4], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.stats.accepted_draft_tokens > 0
    assert full_pool(llm)


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
        llm = make_llm(target, SAConfig(max_draft_len=D, enable_global_pool=pool,
                                    global_pool_size=2 if pool else None), max_batch_size=1)
        llm.generate([first], SamplingParams(max_tokens=20))
        out = llm.generate([second], SamplingParams(max_tokens=12))[0]
        assert out.token_ids == want, pool
        accepted[pool] = out.stats.num_accepted_draft_tokens
        assert full_pool(llm)
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
        llm = make_llm(target, AutoConfig(), max_batch_size=2)
    assert llm.speculative_config == small
    assert "AUTO" in caplog.text
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8))[0]
    assert out.token_ids == dense_greedy(target, PROMPTS[1], 8)
