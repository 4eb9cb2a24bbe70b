"""Timing the bare generation step on an engine that goes on serving afterwards."""
import pytest

import specjax
from specjax import SamplingParams
from specjax.analysis.timing import time_generation_steps


def test_timing_the_step_leaves_cached_prompts_and_the_pool_intact(tiny_model):
    # A fresh engine: its first prompt takes the lowest block ids, which the timing once
    # overwrote (it picked blocks by number), so the repeat below read garbage from the cache.
    llm = specjax.LLM(tiny_model, max_batch_size=2, tokens_per_block=4, num_kv_blocks=40,
                      progress=False, seed=0)
    alloc = llm.engine.allocator
    prompt = list(range(3, 30))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = llm.generate([prompt], params)[0].token_ids
    cached = alloc.num_cached_blocks
    assert cached >= 6
    times = time_generation_steps(llm.engine, 2, [1, 3], start_pos=20, iters=4, rounds=1)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert alloc.num_free_blocks == alloc.total_blocks   # every timing block given back
    assert alloc.num_cached_blocks == cached             # free blocks were enough: none evicted
    again = llm.generate([prompt], params)[0]
    assert again.stats.num_cached_tokens > 0             # the repeat did read the cache
    assert again.token_ids == first
    with pytest.raises(ValueError, match="free KV blocks"):
        time_generation_steps(llm.engine, 2, [1], start_pos=100, iters=4, rounds=1)
