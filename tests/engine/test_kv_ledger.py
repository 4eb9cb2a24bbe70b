"""The KV ledger with in-step drafters and the overlap scheduler: a pool small enough to
preempt, random arrivals, cancellations of requests whose next step is on the device, and
drafts both accepted and rejected. No block is lost or held twice, every running request's
logical length is exactly what its computed tokens and its unread step account for, and the
output stays exactly greedy.

(`test_spec_engine.test_randomized_kv_ledger` does the same for a host drafter, whose steps
never overlap.)
"""
import numpy as np
import pytest

import specjax
from specjax import DraftTargetConfig, EagleConfig, MTPConfig, SamplingParams
from tests.spec_checks import assert_mixed_acceptance, dense_greedy_refs, truncated_copy
from tests.speculative import perm_models

D = 3
MAX_LEN = 40
STEPS = 200
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [7],
           [9, 9, 9, 9, 9], [33, 2]]


@pytest.fixture(scope="module")
def perm():
    return perm_models.perm_target()


@pytest.fixture(scope="module")
def greedy_refs():
    """greedy_refs(target) -> plain greedy after each prompt, to MAX_LEN tokens: once per
    target (three setups share the perm target)."""
    refs = {}

    def get(target):
        if id(target) not in refs:
            refs[id(target)] = dense_greedy_refs(target, PROMPTS, lambda p: MAX_LEN - len(p))
        return refs[id(target)]
    return get


SETUPS = {
    "draft_target": lambda tiny, target, perm: (tiny, DraftTargetConfig(
        max_draft_len=D, speculative_model=truncated_copy(tiny, 1))),
    "eagle3": lambda tiny, target, perm: (target, EagleConfig(
        max_draft_len=D, speculative_model=perm_models.eagle_head(target, perm))),
    "mtp": lambda tiny, target, perm: (target, MTPConfig(
        max_draft_len=D, num_nextn_predict_layers=3, speculative_model=perm_models.mtp_heads(3))),
    # A dynamic tree: T = 6 rows verified, the accepted path's K/V relocated every step.
    "eagle3_tree": lambda tiny, target, perm: (target, EagleConfig(
        max_draft_len=D, use_dynamic_tree=True, dynamic_tree_max_topK=2,
        max_total_draft_tokens=6, speculative_model=perm_models.eagle_head(target, perm))),
}


def _check_ledger(engine) -> bool:
    """Assert the ledger adds up now; returns whether some running request holds the
    reservation of a step that is still unread."""
    alloc, inflight = engine.allocator, engine.executor.inflight
    assert alloc.num_free_blocks + alloc.num_held_blocks == alloc.total_blocks
    # Requests sharing a cached prefix hold its blocks together.
    assert alloc.num_held_blocks == len(set().union(
        *(alloc.blocks(r.request_id) for r in engine.running)))
    assert all(r.request_id not in alloc for r in engine.waiting)
    unread_rows = False
    for r in engine.running:
        # Settled steps leave the computed tokens; a step on the device also holds what it
        # may write past the newest token, until it is read (bookkeeper._give_back).
        unread = inflight is not None and r.latest_step == inflight.step_id
        held = r.num_computed + (r.latest_reserve if unread else 0)
        assert alloc.length(r.request_id) == held, (r.request_id, r.num_computed, unread)
        unread_rows |= unread
    return unread_rows


# A draft model and a tree (whose accepted path's K/V moves) in the default run; the chain
# drafters that read the target's hidden states (~6 s each) in the slow job.
@pytest.mark.parametrize("setup", [pytest.param(s, marks=() if s in ("draft_target",
                                                                       "eagle3_tree")
                                                else pytest.mark.slow) for s in SETUPS])
def test_randomized_kv_ledger_with_overlap(setup, tiny_model, perm, greedy_refs):
    target, spec = SETUPS[setup](tiny_model, *perm)
    refs = greedy_refs(target)
    # 15 usable blocks of 4 tokens; one request may need 12 (40 tokens + 2D reserved; a
    # tree's 13: T + D). One batch bucket and one prompt row a step (neither is what the
    # ledger is about): two programs to compile, not five.
    llm = specjax.LLM(target, speculative_config=spec, max_batch_size=4, batch_sizes=(4,),
                      tokens_per_block=4, prefill_chunk=8, max_prefill_rows=1,
                      num_kv_blocks=16, max_model_len=MAX_LEN, progress=False)
    engine = llm.engine
    assert engine._overlaps(D, [])
    rng = np.random.default_rng(0)
    expected, finished = {}, {}
    cancelled_in_flight = steps_with_unread_rows = 0
    for _ in range(STEPS):
        if rng.random() < 0.3 and len(expected) < 40:
            prompt = PROMPTS[int(rng.integers(len(PROMPTS)))]
            n = int(rng.integers(1, MAX_LEN - len(prompt) + 1))
            expected[engine.add_request(prompt, SamplingParams(max_tokens=n))] = \
                refs[tuple(prompt)][:n]
        inflight = engine.executor.inflight
        if rng.random() < 0.06 and engine.running:
            # Cancel a request whose next step is on the device when there is one.
            on_device = [r for r in engine.running
                         if inflight is not None and r.latest_step == inflight.step_id]
            pool = on_device or engine.running
            victim = pool[int(rng.integers(len(pool)))]
            cancelled_in_flight += bool(on_device)
            engine.abort(victim.request_id)
            expected.pop(victim.request_id)
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        steps_with_unread_rows += _check_ledger(engine)
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        _check_ledger(engine)
    for rid, ref in expected.items():
        assert (finished[rid].token_ids, finished[rid].finish_reason) == (ref, "length"), rid
    alloc = engine.allocator
    assert alloc.num_free_blocks == alloc.total_blocks
    # What the test is for did happen: overlapped steps, preemption, cancellations of rows
    # on the device, drafts accepted and rejected at full depth.
    assert steps_with_unread_rows > STEPS // 2
    assert llm.stats.num_preemptions > 0
    assert cancelled_in_flight > 0
    assert_mixed_acceptance(llm.stats, D)
