"""The scheduler under a KV pool far too small for its load, driven by hypothesis: random
arrivals, prompt and output lengths, greedy and seeded sampled requests, cancellations, and (in
the NGram engine) draft lengths that change with the batch size and drafts both accepted and
rejected. The pool holds barely one full-length request, so admission waits and preemption
is constant.

After every rule: the block ledger adds up (free + held = total, only running requests hold
blocks, slots are distinct). After every run: nothing raised, every block is back, and every
request that was not cancelled produced exactly what an unconstrained engine (a pool with room
for everything) produces for it -- outputs depend on (seed, position) only, never on when a
request ran, how often it was preempted or what else shared its steps.
"""
import dataclasses

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

import specjax
from specjax import SamplingParams
from specjax.engine.request import Status
from tests.spec_checks import assert_mixed_acceptance

MAX_LEN = 40
TIGHT = dict(max_batch_size=4, tokens_per_block=4, prefill_chunk=8, max_prefill_rows=2,
             max_model_len=MAX_LEN, progress=False, seed=0)
NGRAM = dict(max_draft_len=3, draft_len_schedule={1: 3, 2: 2, 4: 1})


@dataclasses.dataclass
class Totals:
    """What the runs exercised, summed over every example (positive controls)."""

    finished: int = 0
    preemptions: int = 0
    drafted: int = 0
    accepted: int = 0
    cancelled_running: int = 0
    steps: int = 0


def _engines(tiny_model, speculation):
    spec = specjax.NGramConfig(**NGRAM) if speculation else None
    # The tightest pool the engine accepts: one full-length request (+ the null block).
    tight = specjax.LLM(tiny_model, num_kv_blocks=None, speculative_config=spec, warmup=False,
                        **TIGHT)
    blocks = tight.engine.executor.blocks_per_seq + 1
    tight = specjax.LLM(tiny_model, num_kv_blocks=blocks, speculative_config=spec, **TIGHT)
    roomy = specjax.LLM(tiny_model, speculative_config=spec, **TIGHT)
    return tight.engine, roomy


def _machine(engine, roomy, references: dict, totals: Totals):
    class Scheduling(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            for request_id in list(engine.requests):  # left by a failed example (shrinking)
                engine.abort(request_id)
            self.live: dict[int, tuple[tuple[int, ...], SamplingParams]] = {}
            # Every id submitted, finished or not: which requests exist when a rule is drawn
            # must not depend on timing (drafts change how fast requests finish).
            self.submitted: list[int] = []
            self.finished: dict[int, tuple[tuple, SamplingParams, list[int]]] = {}

        @rule(prompt=st.lists(st.integers(1, 63), min_size=1, max_size=MAX_LEN - 10),
              max_tokens=st.integers(1, 24), sampled=st.booleans(), seed=st.integers(0, 3))
        def arrive(self, prompt, max_tokens, sampled, seed):
            params = SamplingParams(max_tokens=max_tokens, seed=seed,
                                    temperature=0.9 if sampled else 0.0,
                                    top_k=20 if sampled else 0)
            request_id = engine.add_request(prompt, params)
            self.live[request_id] = (tuple(prompt), params)
            self.submitted.append(request_id)

        @rule(steps=st.integers(1, 12))
        def run(self, steps):
            for _ in range(steps):
                self._step()

        @precondition(lambda self: self.submitted)
        @rule(data=st.data())
        def cancel(self, data):
            """Cancel a request wherever it is (a no-op once it has finished)."""
            request_id = data.draw(st.sampled_from(self.submitted))
            request = engine.requests.get(request_id)
            if request is not None and request.status is Status.RUNNING:
                totals.cancelled_running += 1
            engine.abort(request_id)
            self.live.pop(request_id, None)

        def _step(self):
            for out in engine.step():
                if out.finished and out.request_id in self.live:
                    assert out.finish_reason in ("stop", "length"), out.error
                    prompt, params = self.live.pop(out.request_id)
                    self.finished[out.request_id] = (prompt, params, out.token_ids)
                    totals.finished += 1
                    totals.preemptions += out.stats.num_preemptions
                    totals.drafted += out.stats.num_draft_tokens
                    totals.accepted += out.stats.num_accepted_draft_tokens
            totals.steps += 1

        @invariant()
        def ledger_adds_up(self):
            allocator, scheduler = engine.allocator, engine.scheduler
            held = sum(len(allocator.blocks(r.request_id)) for r in scheduler.running)
            assert allocator.num_free_blocks + held == allocator.total_blocks
            assert all(r.request_id not in allocator for r in scheduler.waiting)
            slots = [r.slot for r in scheduler.running]
            assert None not in slots and len(set(slots)) == len(slots)

        def teardown(self):
            while engine.has_unfinished():
                self._step()
            assert not self.live, "a request neither finished nor was cancelled"
            assert engine.allocator.num_free_blocks == engine.allocator.total_blocks
            todo = {(p, params) for p, params, _ in self.finished.values()} - references.keys()
            if todo:
                todo = sorted(todo, key=repr)
                outs = roomy.generate([list(p) for p, _ in todo], [params for _, params in todo])
                references.update({key: out.token_ids for key, out in zip(todo, outs)})
            for prompt, params, tokens in self.finished.values():
                assert tokens == references[(prompt, params)], (prompt, params)

    return Scheduling


# Speculating (NGram) in the default run, plain decoding (~11 s) in the slow job.
@pytest.mark.parametrize("speculation", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["plain-overlap", "ngram"])
def test_tiny_pool_scheduling_is_exact_and_leak_free(tiny_model, speculation):
    engine, roomy = _engines(tiny_model, speculation)
    totals = Totals()
    machine = _machine(engine, roomy, {}, totals)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=40, stateful_step_count=40, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
    # The load did what this test is for: thousands of steps, constant preemption, requests
    # cancelled while holding blocks, and (NGram) drafts both accepted and rejected.
    assert totals.steps >= 2000 and totals.finished >= 200, totals
    assert totals.preemptions >= 20 and totals.cancelled_running >= 3, totals
    if speculation:
        assert 0 < totals.accepted < totals.drafted, totals
        assert_mixed_acceptance(engine.stats, NGRAM["max_draft_len"])
