"""The draft-length policy on its own (no engine, nothing compiled): the fixed length where
there is no choice, the cost model's choice, exploration, pinned and forced lengths, seeded
rows, and which step shapes it can choose. The engine runs are in test_verify_lengths.py."""
import types

import numpy as np

from specjax import EagleConfig, NGramConfig, SpeculationGate
from specjax.engine.config import bucket
from specjax.engine.costs import CostTable
from specjax.speculative.build import Speculation
from specjax.speculative.length_policy import DraftLengthPolicy

BUCKETS = (1, 4)
D = 4


def policy(config=None, costs=None, gate=None, **kw) -> DraftLengthPolicy:
    """A chain drafter of D drafts (an in-step worker: rejection sampling on by default)."""
    config = config or EagleConfig(max_draft_len=D)
    spec = Speculation(config, worker=types.SimpleNamespace(tree=None))
    return DraftLengthPolicy(spec, costs or CostTable(), lambda n: bucket(n, BUCKETS), gate,
                             **kw)


def priced(p: DraftLengthPolicy, seconds) -> DraftLengthPolicy:
    p.costs = CostTable({(b, p.width(d)): seconds(d) for b in BUCKETS for d in p.candidates})
    return p


def rows(n: int, seed=None, temperature=0.0, grammar=None):
    params = types.SimpleNamespace(seed=seed, temperature=temperature)
    return [types.SimpleNamespace(request_id=i, params=params, grammar=grammar)
            for i in range(n)]


def test_without_measured_costs_the_fixed_length_runs():
    assert policy().choose(rows(2)) == D
    scheduled = policy(EagleConfig(max_draft_len=D, draft_len_schedule={1: 4, 3: 0}))
    assert not scheduled.adaptive
    assert [scheduled.choose(rows(n)) for n in (1, 2, 3)] == [4, 4, 0]


def test_the_cost_model_follows_the_step_costs():
    free = priced(policy(explore_every=10**9), lambda d: 1.0)
    assert {free.choose(rows(2)) for _ in range(5)} == {D}
    costly = priced(policy(explore_every=10**9), lambda d: 1.0 + 100 * d)
    assert {costly.choose(rows(2)) for _ in range(5)} == {0}


def test_exploration_runs_the_stalest_length_for_its_steps():
    p = priced(policy(explore_every=3, explore_steps=2), lambda d: 1.0)
    got = [p.choose(rows(1)) for _ in range(9)]
    # Every third step starts exploring the width seen longest ago (never: the shortest
    # first) and keeps it for two steps; the cost model's choice is the longest.
    assert got == [D, D, 0, 0, D, 1, 1, D, 2], got


def test_a_host_drafters_second_look_stays_within_its_proposals():
    p = priced(policy(NGramConfig(max_draft_len=D), explore_every=10**9), lambda d: 1.0)
    first = p.choose(rows(2))
    assert first == D
    assert p.choose(rows(2), caps=np.asarray([2, 1]), longest=2) == 2
    assert p.choose(rows(2), caps=np.zeros(2, int), longest=first) == 0


def test_seeded_sampled_rows_keep_the_fixed_length_unless_told_otherwise():
    p = priced(policy(explore_every=10**9), lambda d: 1.0 + 100 * d)
    seeded = rows(2, seed=5, temperature=1.0)
    assert p.choose(seeded) == D            # its text must repeat
    assert p.choose(rows(2, temperature=1.0)) == 0
    p.keep_seeded_text = False
    assert p.choose(seeded) == 0


def test_pinned_forced_and_gated_lengths():
    gate = SpeculationGate(1, 0.5)
    p = priced(policy(gate=gate, explore_every=10**9), lambda d: 1.0 + 100 * d)
    grammar = types.SimpleNamespace(forced=lambda limit: [7, 8, 9][:limit])
    assert p.forced_len(rows(2, grammar=grammar)) == 3     # verified whatever was chosen
    p.pinned = 2
    assert p.choose(rows(2)) == 2 and p.forced_len(rows(2, grammar=grammar)) == 0
    p.pinned = None
    gate.record_acceptance_rate(0.0)
    assert gate.disabled and p.choose(rows(2)) == 0 and p.forced_len(rows(2, grammar=grammar)) == 0


def test_shapes_cover_every_length_it_can_choose_first_needs_first():
    p = policy(gate=SpeculationGate(4, 0.1))
    # By bucket; in each, the fixed length (the longest here), then plain, then the rest:
    # what a background warm-up compiles first.
    assert p.shapes(BUCKETS, 4) == [(b, w) for b in sorted(BUCKETS) for w in (5, 1, 2, 3, 4)]
    fixed = policy(EagleConfig(max_draft_len=D, draft_len_schedule={1: 4, 3: 0}))
    assert fixed.shapes(BUCKETS, 4) == [(1, 5), (4, 5), (4, 1)]


def test_observed_costs_come_from_the_steady_state_of_one_shape():
    """An interval counts only from the STEADY_AFTER-th read of its shape in a row (the
    first after a switch still carry the other shape's work), with no prompt chunk between
    and no step skipped."""
    from specjax.speculative.length_policy import STEADY_AFTER
    p = priced(policy(), lambda d: 1.0)
    seen = []
    p.costs.observe = lambda *args: seen.append(args[:2])
    step = 0
    for _ in range(STEADY_AFTER + 1):   # STEADY_AFTER + 1 reads: two timed intervals
        p.observe(2, D, step_id=step)
        step += 1
    assert seen == [(4, D + 1)] * 2
    p.prefill_ran()
    p.observe(2, D, step_id=step)   # a prompt chunk ran between: the run starts again
    for _ in range(STEADY_AFTER - 2):
        step += 1
        p.observe(2, D, step_id=step)
    assert len(seen) == 2
    step += 1
    p.observe(2, D, step_id=step)   # steady again
    assert seen == [(4, D + 1)] * 3
    p.observe(2, 0, step_id=step + 1)   # another shape: the run starts again
    p.observe(2, 0, step_id=step + 3)   # not the next step: again
    p.observe(2, 0, step_id=step + 4)
    assert len(seen) == 3
