"""Rejection sampling in the one-model step, end to end on the bundled target and draft.

Sampled output must follow the target's distribution. Each sampled sequence contributes one
independent observation (its tokens at fixed generated positions), and the speculative and
plain samples are compared with a chi-square homogeneity test: categories with a pooled
expected count below 5 are merged, and the test fails when the statistic exceeds the
alpha = 1e-4 critical value (Wilson-Hilferty approximation). The seeds are fixed, so the
outcome is deterministic; a correct implementation would fail for a random seed set with
probability about 1e-4. The same test run against the draft model's own samples must fail,
which shows it has the power to catch a sampler that leaks the draft distribution.
"""
import pytest

from specjax.bench.sampling import BUNDLED_DRAFT, PROMPT, chi_square, make_llm, observations
from specjax.models.registry import CHECKPOINTS_DIR
from specjax.sampling_params import SamplingParams

DRAFT = CHECKPOINTS_DIR / BUNDLED_DRAFT
N = 400
pytestmark = pytest.mark.skipif(not (DRAFT / "config.json").exists(), reason="no bundled draft")


def _llm(model, rejection_sampling=None):
    return make_llm(model, 0 if rejection_sampling is None else 3, bool(rejection_sampling))


def _observations(llm, seed_offset: int) -> list[tuple[int, int]]:
    return observations(llm, N, seed_offset, top_k=8)


def chi_square_exceeds(a: list, b: list) -> tuple[bool, float, float]:
    stat, _, critical = chi_square(a, b)
    return stat > critical, stat, critical


@pytest.fixture(scope="module")
def plain_llm():
    return _llm("bundled")


@pytest.fixture(scope="module")
def rs_llm():
    return _llm("bundled", rejection_sampling=True)


@pytest.fixture(scope="module")
def plain_samples(plain_llm):
    return _observations(plain_llm, seed_offset=0)


def test_rejection_sampling_follows_the_target_distribution(plain_samples, rs_llm):
    llm = rs_llm
    speculative = _observations(llm, seed_offset=10**6)
    assert llm.stats.accepted_draft_tokens > 0  # the drafts really were verified
    for name, pick in [("unigram", lambda t: t[0]), ("bigram", lambda t: t)]:
        differs, stat, critical = chi_square_exceeds([pick(t) for t in plain_samples],
                                                     [pick(t) for t in speculative])
        assert not differs, f"{name}: chi2 {stat:.1f} > {critical:.1f}"
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


def test_the_statistic_detects_the_draft_distribution(plain_samples):
    draft_samples = _observations(_llm(str(DRAFT)), seed_offset=10**6)
    differs, stat, critical = chi_square_exceeds([t[0] for t in plain_samples],
                                                 [t[0] for t in draft_samples])
    assert differs, f"chi2 {stat:.1f} <= {critical:.1f}: the test has no power"


def test_rejection_sampling_accepts_more_than_strict_matching(rs_llm):
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=i) for i in range(8)]
    rates = {}
    for rejection_sampling, llm in [(False, _llm("bundled", rejection_sampling=False)), (True, rs_llm)]:
        before = (llm.stats.accepted_draft_tokens, llm.stats.drafted_tokens)
        llm.generate([PROMPT] * len(params), params)
        accepted = llm.stats.accepted_draft_tokens - before[0]
        rates[rejection_sampling] = accepted / (llm.stats.drafted_tokens - before[1])
    assert rates[True] > rates[False] + 0.1, rates


def test_greedy_rows_stay_exact_beside_sampled_ones(rs_llm, plain_llm):
    greedy = SamplingParams(max_tokens=20)
    mixed = [greedy, SamplingParams(max_tokens=20, temperature=1.0, seed=1), greedy]
    outs = rs_llm.generate([PROMPT, PROMPT, "import os\n"], mixed)
    plain = plain_llm.generate([PROMPT, "import os\n"], greedy)
    assert [outs[0].token_ids, outs[2].token_ids] == [o.token_ids for o in plain]
