"""Rejection sampling in the one-model step, end to end on the bundled target with every shipped
in-step drafter (draft model, EAGLE-3 head, MTP modules, PARD, DFlash), at every draft depth.

Sampled output must follow the target's distribution. 128 sequences of 32 tokens at
temperature 0.8 with D = 3, so steps verify full chains: every generated token is tagged with
what decided it (a step without drafts; the draft at depth k, accepted or corrected; the bonus
after a full or a shorter chain), and each group is compared with the target's exact
distribution at that token's prefix (a dense forward of the target) by the generalized
chi-square test of `specjax.bench.sampling`, at alpha = 1e-5 per group. The seeds are fixed, so
the outcome is deterministic; over 5 drafters x 6 groups a correct implementation fails for a
random seed set with probability about 3e-4. The same statistic judging the draft tokens
themselves (drawn from q) must fail -- the test has the power to see a sampler that leaks the
draft distribution. `tests/mutants.py` plants bugs in the acceptance code and checks that these
tests catch them.
"""
import dataclasses

import pytest

from specjax.bench.sampling import (PROMPT, acceptance_rate, depth_groups, in_step_configs,
                                    judge_groups, judge_tree_groups, make_llm, sample_and_tag,
                                    sample_and_tag_tree, target_probs)
from specjax.sampling_params import SamplingParams

N, MAX_TOKENS, TEMPERATURE, D = 128, 32, 0.8, 3
CONFIGS = in_step_configs(D)
# The default run judges the draft model (whose groups the acceptance mutants run against,
# tests/mutants.py): the acceptance code every in-step drafter shares. The other drafters'
# runs, the same test on the way each proposes its q, are in the slow job (each sampling run
# is about 30 s here).
DEFAULT_RUN = ("draft_target_one_model",)
DRAFTERS = [pytest.param(name, marks=() if name in DEFAULT_RUN else pytest.mark.slow)
            for name in sorted(CONFIGS)]
FIRST = next((name for name in DEFAULT_RUN if name in CONFIGS), None)
GROUPS = ["plain", "depth 1", "depth 2", "depth 3", "bonus (full chain)", "bonus (short chain)"]
pytestmark = pytest.mark.skipif(FIRST is None, reason="no bundled in-step drafter")


@pytest.fixture(scope="module")
def runs():
    """drafter -> (llm, tags, p), sampled on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            llm = make_llm(CONFIGS[name])
            tags = sample_and_tag(llm, CONFIGS[name].max_draft_len, N, MAX_TOKENS, TEMPERATURE,
                                  seed_offset=10**6)
            cache[name] = llm, tags, target_probs(llm, tags.sequences, TEMPERATURE)
        return cache[name]

    return get


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_depth_and_the_bonus_are_decided_many_times(runs, drafter):
    llm, tags, _ = runs(drafter)
    assert CONFIGS[drafter].max_draft_len == D
    groups = depth_groups(tags, D)
    for name in GROUPS:
        assert len(groups[name]) >= (100 if name != "bonus (short chain)" else 20), \
            (name, len(groups[name]))
    for k in range(1, D + 1):  # at every depth some drafts are accepted and some corrected
        idx = groups[f"depth {k}"]
        accepted = sum(tags.sequences[s][t] == tags.draft[j]
                       for j, s, t in zip(idx, tags.seq[idx], tags.pos[idx]))
        assert 0.05 * len(idx) < accepted < 0.95 * len(idx), (k, accepted, len(idx))
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_tokens_decided_at_each_depth_follow_the_target(runs, drafter, group):
    _, tags, p = runs(drafter)
    result = next(r for r in judge_groups(tags, p, D) if r.name == group)
    assert result.count > 0
    assert not result.differs, (f"{drafter}, {group}: chi2 {result.stat:.1f} > "
                                f"{result.critical:.1f} (df {result.df}, n {result.count})")


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_the_statistic_detects_the_draft_distribution(runs, drafter):
    """Draft tokens are drawn from q, not p: judged as if emitted, every depth must fail."""
    _, tags, p = runs(drafter)
    for r in judge_groups(tags, p, D, drafted=True):
        assert r.differs, f"{drafter}, {r.name}: chi2 {r.stat:.1f} <= {r.critical:.1f}"


def test_rejection_sampling_accepts_more_than_strict_matching(runs):
    name = FIRST
    llm = runs(name)[0]
    strict = make_llm(dataclasses.replace(CONFIGS[name], use_rejection_sampling=False),
                      max_batch_size=8)
    rates = {True: acceptance_rate(llm, 8, 24), False: acceptance_rate(strict, 8, 24)}
    assert rates[True] > rates[False] + 0.1, rates


def test_greedy_rows_stay_exact_beside_sampled_ones(runs):
    llm = runs(FIRST)[0]
    greedy = SamplingParams(max_tokens=20)
    mixed = [greedy, SamplingParams(max_tokens=20, temperature=1.0, seed=1), greedy]
    outs = llm.generate([PROMPT, PROMPT, "import os\n"], mixed)
    plain = make_llm(None, max_batch_size=2).generate([PROMPT, "import os\n"], greedy)
    assert [outs[0].token_ids, outs[2].token_ids] == [o.token_ids for o in plain]


# ---- draft trees: siblings drawn without replacement, recursive rejection sampling --------
# The EAGLE-3 head's trees of depth D (K = 3 children per node, 8 nodes), every step at full
# depth. Each emitted token is judged against the residual it must follow given the siblings
# its decision went past (`specjax.bench.sampling.TreeDecided`), per (depth, sibling) group
# of at least 60 tokens; 128 sequences x 32 tokens. With 11 groups at alpha = 1e-5, a correct
# implementation fails for a random seed set with probability about 1.1e-4.
TREE_K, TREE_T = 3, 8
# The shape sampled rows get (`SIBLING_ACCEPTANCE`): three children under the root and under
# its first child, one under the first grandchild and one under the second child. Sibling
# n + 1 of a node with n children is the correction after all n were rejected.
TREE_GROUPS = ([f"depth {k}, sibling {i}" for k in (1, 2) for i in (1, 2, 3, 4)]
               + ["depth 3, sibling 1", "depth 3, sibling 2", f"depth {D + 1}, sibling 1"])
TREE_DRAFTED = [f"depth {k}, sibling {i}" for k in (1, 2) for i in (1, 2, 3)] + [
    "depth 3, sibling 1"]


@pytest.fixture(scope="module")
def tree_run():
    spec = dataclasses.replace(CONFIGS["eagle3_one_model"], use_dynamic_tree=True,
                               dynamic_tree_max_topK=TREE_K, max_total_draft_tokens=TREE_T,
                               draft_len_schedule={1: D})
    llm = make_llm(spec)
    tags = sample_and_tag_tree(llm, N, MAX_TOKENS, TEMPERATURE, seed_offset=2 * 10**6)
    return llm, tags, target_probs(llm, tags.sequences, TEMPERATURE)


@pytest.mark.slow   # sampled trees stay in the default run through tests/core/test_tree.py
@pytest.mark.skipif("eagle3_one_model" not in CONFIGS, reason="no bundled EAGLE-3 head")
def test_tree_tokens_follow_the_target_at_every_depth_and_sibling(tree_run):
    llm, tags, p = tree_run
    results = {r.name: r for r in judge_tree_groups(tags, p, min_count=60)}
    missing = [g for g in TREE_GROUPS if g not in results]
    assert not missing, (missing, sorted(results))
    for r in results.values():
        assert not r.differs, (f"{r.name}: chi2 {r.stat:.1f} > {r.critical:.1f} "
                               f"(df {r.df}, n {r.count})")
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


@pytest.mark.slow
@pytest.mark.skipif("eagle3_one_model" not in CONFIGS, reason="no bundled EAGLE-3 head")
def test_the_tree_statistic_detects_the_draft_distribution(tree_run):
    """The siblings' own tokens (drawn from q_i) judged against p_i must fail."""
    _, tags, p = tree_run
    drafted = judge_tree_groups(tags, p, drafted=True, min_count=60)
    assert set(TREE_DRAFTED) <= {r.name for r in drafted}, sorted(r.name for r in drafted)
    for r in drafted:
        assert r.differs, f"drafts, {r.name}: chi2 {r.stat:.1f} <= {r.critical:.1f}"


@pytest.mark.slow
@pytest.mark.skipif("eagle3_one_model" not in CONFIGS, reason="no bundled EAGLE-3 head")
def test_greedy_rows_of_a_sampled_tree_batch_stay_exact(tree_run):
    llm = tree_run[0]
    greedy = SamplingParams(max_tokens=20)
    mixed = [greedy, SamplingParams(max_tokens=20, temperature=1.0, seed=1), greedy]
    outs = llm.generate([PROMPT, PROMPT, "import os\n"], mixed)
    plain = make_llm(None, max_batch_size=2).generate([PROMPT, "import os\n"], greedy)
    assert [outs[0].token_ids, outs[2].token_ids] == [o.token_ids for o in plain]
