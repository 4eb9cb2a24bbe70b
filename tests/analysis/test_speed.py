"""Speed figures: efficiency, and timed runs over batch sizes on a tiny engine."""
import pytest

from specjax import SamplingParams
from specjax.analysis import efficiency, measure, speed_vs_batch_size


def test_efficiency_matches_the_readme_ngram_row():
    # docs/benchmarks.md, an earlier run of its NGram row: NGram D=4, tokens/step 2.07,
    # decode speedup 1.33x, t(D+1)/t(1) 1.47 -> 0.95
    assert efficiency(1.33, 2.07, 1.0, 1.47) == pytest.approx(0.94, abs=0.01)
    assert efficiency(2.0, 2.0, 1.0, 1.0) == 1.0  # free drafts, free host: 1.0


def test_runs_over_batch_sizes_count_every_token(tiny_llm):
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    runs = speed_vs_batch_size(tiny_llm, [[1, 2, 3], [4, 5]], [1, 3], params, repeats=2)
    assert [len(r.outputs) for r in runs] == [1, 3]
    assert [r.tokens for r in runs] == [5, 15]
    assert all(r.tps == r.tokens / r.seconds > 0 and r.decode_tps > 0 for r in runs)
    # The prompts cycle: the third request repeats the first prompt, and so its tokens.
    assert runs[1].outputs[2].token_ids == runs[1].outputs[0].token_ids
    one = measure(tiny_llm, [[1, 2, 3]], params)
    assert one.outputs[0].token_ids == runs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="max_batch_size"):
        speed_vs_batch_size(tiny_llm, [[1]], [8], params)
