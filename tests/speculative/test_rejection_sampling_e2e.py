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
import collections
import math

import pytest

import specjax
from specjax import SamplingParams
from specjax.models.registry import CHECKPOINTS_DIR
from specjax.speculative.config import DraftTargetConfig

DRAFT = CHECKPOINTS_DIR / "stdlib-draft"
PROMPT = "def fibonacci(n):"
N = 400
pytestmark = pytest.mark.skipif(not (DRAFT / "config.json").exists(), reason="no bundled draft")


def _llm(model, spec=None):
    # Compiled lazily: only the shapes these runs use (other tests check warm-up).
    return specjax.LLM(model, max_batch_size=8, max_prefill_rows=4, prefill_chunk=16,
                       max_model_len=64, speculative_config=spec, warmup=False, progress=False)


def _spec(rejection_sampling: bool):
    return DraftTargetConfig(max_draft_len=3, speculative_model=str(DRAFT),
                             use_rejection_sampling=rejection_sampling)


def _observations(llm, seed_offset: int) -> list[tuple[int, int]]:
    """(token 3, token 4) of each of N sequences sampled at temperature 1, top-k 8. Token 3
    onwards is decided by verification (token 1 by prefill, token 2 by the first generation
    step, which has no drafts yet)."""
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=8, seed=seed_offset + i,
                             ignore_eos=True) for i in range(N)]
    return [tuple(o.token_ids[2:4]) for o in llm.generate([PROMPT] * N, params)]


def chi_square_exceeds(a: list, b: list, z: float = 3.719) -> tuple[bool, float, float]:
    """Two-sample chi-square homogeneity test; True when the samples differ at the level
    whose standard normal quantile is z (3.719: alpha = 1e-4)."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    na, nb = len(a), len(b)
    keys = set(ca) | set(cb)
    big = {k for k in keys if (ca[k] + cb[k]) * min(na, nb) / (na + nb) >= 5}
    rows = [(ca[k], cb[k]) for k in big]
    rows.append((sum(ca[k] for k in keys - big), sum(cb[k] for k in keys - big)))
    rows = [r for r in rows if sum(r)]
    stat = 0.0
    for x, y in rows:
        ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = len(rows) - 1
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical, stat, critical


@pytest.fixture(scope="module")
def plain_llm():
    return _llm("bundled")


@pytest.fixture(scope="module")
def rs_llm():
    return _llm("bundled", _spec(rejection_sampling=True))


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
    for rejection_sampling, llm in [(False, _llm("bundled", _spec(False))), (True, rs_llm)]:
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
