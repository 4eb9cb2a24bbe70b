"""The cost model inside the engine (the bundled target with its EAGLE-3 head, NGram, a user
drafter): whatever draft lengths it picks, greedy output is plain decoding's and sampled output
follows the target at every depth; its choices follow the step costs; the pool ends full.

The step costs here are set by the test (`CostTable.observe` frozen, so real timings cannot
move them) and exploration is made frequent (the length policy's `explore_every`), so a short
run switches lengths many times.
"""
import dataclasses

import pytest

from specjax import NGramConfig, SamplingParams, UserProvidedConfig
from specjax.bench.sampling import (depth_groups, in_step_configs, judge_groups, make_llm,
                                    sample_and_tag, target_probs)
from specjax.engine.costs import CostTable
from specjax.llm import LLM
from specjax.models.registry import BUNDLED_TARGET, CHECKPOINTS_DIR
from specjax.speculative.drafters import Drafter

EAGLE3 = in_step_configs(4).get("eagle3_one_model")
pytestmark = pytest.mark.skipif(EAGLE3 is None, reason="no bundled EAGLE-3 head")
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\ndef main():",
           "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self",
           "The history of the Roman Empire"]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def set_costs(llm: LLM, seconds) -> None:
    """A table for every bucket: draft length d's step costs seconds(d)."""
    lengths = llm.engine.length_policy
    lengths.costs = CostTable({(b, lengths.width(d)): seconds(d)
                               for b in llm.engine.executor.decode_buckets
                               for d in lengths.candidates})


def explore(llm: LLM, every: int, steps: int = 1, keep_seeded_text: bool = True) -> None:
    """Every `every` steps the length policy explores, for `steps` steps; with
    `keep_seeded_text=False` seeded sampled rows let the lengths switch too."""
    lengths = llm.engine.length_policy
    lengths.explore_every, lengths.explore_steps = every, steps
    lengths.keep_seeded_text = keep_seeded_text


@pytest.fixture
def frozen(monkeypatch):
    monkeypatch.setattr(CostTable, "observe", lambda self, *args: None)
    return monkeypatch


def _llm(spec, **kw):
    # One prompt row a prefill step: one prefill program (prefill batching is not the subject).
    kw = {**dict(max_batch_size=4, batch_sizes=(4,), max_model_len=128, prefill_chunk=16,
                 max_prefill_rows=1, progress=False), **kw}
    return LLM(str(CHECKPOINTS_DIR / BUNDLED_TARGET), speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain_outputs():
    return [o.token_ids for o in _llm(None).generate(PROMPTS, GREEDY)]


class Silent(Drafter):
    """Never proposes anything."""

    def propose(self, token_ids, max_draft_len):
        return []


TREE = None if EAGLE3 is None else dataclasses.replace(
    EAGLE3, use_rejection_sampling=None, use_dynamic_tree=True, dynamic_tree_max_topK=2,
    max_total_draft_tokens=8)


# The EAGLE-3 chain in the default run; its tree and NGram (a host drafter: its second look,
# `choose(..., caps, longest)`) in the slow job (~13 s each here).
@pytest.mark.parametrize("spec", [EAGLE3, pytest.param(TREE, marks=pytest.mark.slow),
                                  pytest.param(NGramConfig(max_draft_len=4),
                                               marks=pytest.mark.slow)],
                         ids=["eagle3", "eagle3-tree", "ngram"])
def test_switching_lengths_every_step_keeps_greedy_output_exact(frozen, plain_outputs, spec):
    llm = _llm(spec)
    set_costs(llm, lambda d: 1.0)      # verifying is free: the choice is the longest ...
    explore(llm, every=2)              # ... and every other step explores
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    used = [d for d, n in enumerate(llm.stats.draft_len_histogram) if n]
    # Chains choose among 0..4; a tree between plain steps and its full depth.
    assert used == ([0, 4] if spec is TREE else [0, 1, 2, 3, 4]), llm.stats.draft_len_histogram
    stats = llm.stats
    assert stats.accepted_draft_tokens <= stats.drafted_tokens <= stats.proposed_tokens
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks


@pytest.mark.parametrize("costly", [True, False])
def test_the_choice_follows_the_step_costs(frozen, plain_outputs, costly):
    llm = _llm(EAGLE3)
    set_costs(llm, (lambda d: 1.0 + 100 * d) if costly else (lambda d: 1.0))
    explore(llm, every=10**9)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    histogram = llm.stats.draft_len_histogram
    if costly:   # drafts cost 100x a step: plain decoding only
        assert sum(histogram[1:]) == 0 and llm.stats.drafted_tokens == 0, histogram
    else:        # drafts cost nothing: every step verifies the longest
        assert histogram == [0, 0, 0, 0, sum(histogram)], histogram
        assert llm.stats.acceptance_length > 1.5


def test_rows_without_proposals_run_plain_steps(frozen):
    llm = _llm(UserProvidedConfig(max_draft_len=4, drafter=Silent()))
    set_costs(llm, lambda d: 1.0 + 0.01 * d)  # drafts nearly free, but there are none
    explore(llm, every=10**9)
    llm.generate(PROMPTS[:2], GREEDY)
    assert sum(llm.stats.draft_len_histogram[1:]) == 0, llm.stats.draft_len_histogram


class Counting(Drafter):
    """Never proposes anything; counts its proposals and the pre-checks, which answer
    `expects` whatever the tokens."""

    def __init__(self, expects: bool):
        self.expects, self.asked, self.proposed = expects, 0, 0

    def propose(self, token_ids, max_draft_len):
        self.proposed += 1
        return []

    def may_propose(self, request_id, token_ids):
        self.asked += 1
        return self.expects


def test_a_step_waits_for_proposals_only_where_a_row_expects_one(frozen, plain_outputs):
    """While a plain step is in flight the planner asks `may_propose`; where no row says yes
    it dispatches the next plain step at once (no proposal: the overlap kept), where one does
    it reads the step in flight first and asks for proposals. Output is plain decoding's."""
    runs = {}
    for expects in (False, True):
        drafter = Counting(expects)
        llm = _llm(UserProvidedConfig(max_draft_len=4, drafter=drafter))
        set_costs(llm, lambda d: 1.0)      # drafting would be free: the policy wants drafts
        explore(llm, every=10**9)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == plain_outputs
        histogram = llm.stats.draft_len_histogram
        assert sum(histogram[1:]) == 0, histogram
        runs[expects] = drafter, sum(histogram)
        assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks
    (no, steps_no), (yes, steps_yes) = runs[False], runs[True]
    # Told no: asked at nearly every step, proposing only where nothing was in flight.
    assert no.asked > steps_no // 2 and no.proposed < steps_no // 4, (no.asked, no.proposed)
    # Told yes: every step waits and proposes for each of its rows.
    assert yes.proposed >= steps_yes, (yes.proposed, steps_yes)


def test_a_named_seed_keeps_its_text_so_its_steps_verify_the_configured_length(frozen):
    """Under rejection sampling a chain's draws depend on where chains start: a sampled
    request that names its seed must give the same text every time, so steps holding one run
    the configured length; a request without a seed lets the cost model choose."""
    llm = _llm(EAGLE3)
    set_costs(llm, lambda d: 1.0)
    explore(llm, every=2)
    seeded = SamplingParams(max_tokens=32, temperature=1.0, seed=5, ignore_eos=True)
    first = llm.generate(PROMPTS[:2], seeded)
    histogram = llm.stats.draft_len_histogram
    assert histogram == [0, 0, 0, 0, sum(histogram)], histogram
    llm.reset_stats()
    llm.generate(PROMPTS[:2], dataclasses.replace(seeded, seed=None))
    assert sum(n > 0 for n in llm.stats.draft_len_histogram) >= 3
    again = llm.generate(PROMPTS[:2], seeded)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


def test_without_measured_costs_steps_verify_the_configured_length(plain_outputs):
    llm = _llm(EAGLE3)    # no warm-up: nothing measured
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    histogram = llm.stats.draft_len_histogram
    assert histogram == [0, 0, 0, 0, sum(histogram)], histogram


def test_warmup_measures_every_candidate_shape_and_stats_report_it(frozen):
    # Buckets 1 and 4: bucket 4's programs are the other tests' (compiled once, in-process).
    llm = _llm(EAGLE3, batch_sizes=(1, 4), warmup=True)
    widths = {w for _, w in llm.engine.length_policy.costs.seconds}
    assert widths == {1, 2, 3, 4, 5}
    assert {b for b, _ in llm.engine.length_policy.costs.seconds} == {1, 4}
    assert all(t > 0 for t in llm.engine.length_policy.costs.seconds.values())
    assert llm.stats.step_costs is llm.engine.length_policy.costs
    snapshot = llm.engine.snapshot()
    assert dict(snapshot.step_costs) == llm.engine.length_policy.costs.seconds


# Sampled output under switching lengths, at the standard of test_rejection_sampling_e2e.py:
# 128 sequences x 32 tokens at temperature 0.8, D = 3, every token judged against the target's
# exact distribution at its prefix, per depth, alpha = 1e-5 per group (fixed seeds).
N, MAX_TOKENS, TEMPERATURE, D = 128, 32, 0.8, 3


@pytest.fixture(scope="module")
def switching_run():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CostTable, "observe", lambda self, *args: None)
        llm = make_llm(dataclasses.replace(EAGLE3, max_draft_len=D))
        set_costs(llm, lambda d: 1.0)
        # The tagged rows are seeded (a deterministic test), which would pin their steps at
        # the configured length (test_a_named_seed_keeps_its_text...): let lengths switch.
        explore(llm, every=2, keep_seeded_text=False)
        tags = sample_and_tag(llm, D, N, MAX_TOKENS, TEMPERATURE, seed_offset=3 * 10**6)
    return llm, tags, target_probs(llm, tags.sequences, TEMPERATURE)


@pytest.mark.slow   # 128 sequences sampled and judged: ~30 s here (greedy switching: above)
def test_sampled_tokens_follow_the_target_at_every_depth_under_switching_lengths(
        switching_run):
    llm, tags, p = switching_run
    used = [d for d, n in enumerate(llm.stats.draft_len_histogram) if n]
    assert used == [0, 1, 2, 3], llm.stats.draft_len_histogram
    groups = depth_groups(tags, D)
    for name in ("plain", "depth 1", "depth 2", "depth 3", "bonus (short chain)"):
        assert len(groups[name]) >= 100, (name, len(groups[name]))
    for r in judge_groups(tags, p, D):
        if r.count:
            assert not r.differs, (f"{r.name}: chi2 {r.stat:.1f} > {r.critical:.1f} "
                                   f"(df {r.df}, n {r.count})")
    for r in judge_groups(tags, p, D, drafted=True):   # the power check
        assert r.differs, f"{r.name}: chi2 {r.stat:.1f} <= {r.critical:.1f}"
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.total_blocks
