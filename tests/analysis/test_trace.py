"""A trace's views of its step records, and the context manager that keeps one (engine-level
records of real runs are checked in tests/speculative/test_spec_engine.py)."""
import numpy as np
import pytest

from specjax import NGramConfig, SamplingParams
from specjax.analysis import Trace, trace
from specjax.engine.stats import StepRecord
from tests.spec_checks import spec_llm


def record(ids, verified, accepted, mean=None, off=False, t=0.0, draft=0.0, D=3):
    return StepRecord(D, tuple(ids), tuple(verified), tuple(accepted), mean, off, t, draft)


def test_views_of_the_records():
    t = Trace([record([0, 1], [3, 0], [2, 0], t=1.0, draft=0.1),
               record([0, 1], [3, 2], [0, 2], 0.5, t=1.5, draft=0.3),
               record([1], [0], [0], 0.1, True, t=2.5, draft=0.3, D=0)])
    assert t.accepted().tolist() == [2, 0, 2]  # request-steps with drafts only
    assert t.accepted([1]).tolist() == [2]
    assert t.accepted_histogram() == [1, 0, 2]
    assert {k: v.tolist() for k, v in t.per_request().items()} == {0: [2, 0], 1: [2]}
    acc = t.step_acceptance()
    assert acc[:2] == pytest.approx([2 / 3, 2 / 5]) and np.isnan(acc[2])
    means = t.gate_means()
    assert np.isnan(means[0]) and means[1:] == pytest.approx([0.5, 0.1])
    assert t.gate_tripped_at() == 2 and t.draft_lens().tolist() == [3, 3, 0]
    assert t.step_seconds() == pytest.approx([0.5, 1.0])
    assert t.draft_seconds() == pytest.approx([0.2, 0.0])
    assert Trace().gate_tripped_at() is None


def test_trace_records_only_inside_the_block_and_empties_with_the_stats(tiny_model):
    llm = spec_llm(tiny_model, NGramConfig(max_draft_len=2), max_batch_size=2)
    params = SamplingParams(max_tokens=6)
    with trace(llm) as t:
        llm.generate([[1, 2, 3, 1, 2, 3]], params)
        assert t.records and llm.stats.trace is t.records
        llm.reset_stats()  # the trace starts again with the statistics
        assert t.records == [] and llm.stats.trace is t.records
        outs = llm.generate([[1, 2, 3, 1, 2, 3], [5, 6]], params)
        with pytest.raises(RuntimeError, match="already being traced"):
            with trace(llm):
                pass
    assert llm.stats.trace is None
    # One row per request per generation step (the prompt's prefill gave the first token).
    assert sum(len(r.request_ids) for r in t.records) == sum(
        o.stats.decoding_iterations - 1 for o in outs) > 0
    assert t.accepted_histogram() == llm.stats.accepted_histogram
    n = len(t.records)
    llm.generate([[1, 2]], params)
    assert len(t.records) == n  # nothing is recorded outside the block
