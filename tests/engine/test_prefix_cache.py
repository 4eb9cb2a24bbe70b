"""The prefix cache publishes only what a prefill would have written, and gives it back.

Each block is checked the moment it is published: its K/V -- the target's and the drafter's
-- must equal what a cache-off engine's prefill of its chain's tokens writes. A block holding
a position of a draft that was rejected (or of the newest token, whose K/V the next step
computes) differs by far more than the numerical noise between a chunked prefill and decode
steps. Engines here read each step before the next one (no overlap), so a published block is
seen before any later step could overwrite it; the check's power is shown on a policy that
publishes one position too far.
"""
import jax
import numpy as np
import pytest

import specjax
from specjax import DraftTargetConfig, EagleConfig, SamplingParams
from specjax.engine.prefix_cache import PrefixCachePolicy

# One batch bucket and one prompt row a step (neither is what publication is about): two
# programs a drafter, not four.
SIZES = dict(max_batch_size=2, batch_sizes=(2,), prefill_chunk=32, max_prefill_rows=1,
             max_model_len=192, tokens_per_block=8, overlap_scheduler=False, progress=False)
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef read_config(path):\n", "class Stack:\n"]
PARAMS = SamplingParams(max_tokens=40)
CONFIGS = {"eagle3": EagleConfig(max_draft_len=4),   # its K/V at t read the token at t+1
           "draft_target": DraftTargetConfig(max_draft_len=4, speculative_model="bundled-draft")}


@pytest.fixture(scope="module", params=list(CONFIGS))
def engines(request):
    config = CONFIGS[request.param]
    on = specjax.LLM("bundled", speculative_config=config, **SIZES)
    off = specjax.LLM("bundled", speculative_config=config, enable_prefix_cache=False, **SIZES)
    return request.param, on, off


def _block(engine, block: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    state = jax.device_get(engine.state)
    return {name: (np.asarray(p.k[:, block], np.float32), np.asarray(p.v[:, block], np.float32))
            for name, p in (("target", state.target), ("draft", state.draft))}


def _prefilled_block(ref, chain: list[int], index: int):
    """Block `index` of a cache-off engine's prefill of `chain`."""
    engine = ref.engine
    rid = engine.add_request(chain, SamplingParams(max_tokens=2, ignore_eos=True))
    request = engine.requests[rid]
    while not request.prefilled:
        engine.step()
    expected = _block(engine, engine.allocator.blocks(rid)[index])
    engine.abort(rid)
    return expected


def check_every_publication(llm, ref, monkeypatch) -> list:
    """Compare each block with a prefill's as it is published; returns [(block, pool, error)]
    for the blocks that differ, and the number checked."""
    alloc = llm.engine.allocator
    publish, bad, checked = alloc.publish, [], []

    def checked_publish(seq_id, tokens, num_blocks):
        before = set(alloc._key_of)
        publish(seq_id, tokens, num_blocks)
        chains = alloc.cached_chains()
        for block in set(alloc._key_of) - before:
            chain, index = chains[block]
            checked.append(block)
            got = _block(llm.engine, block)
            for name, (k, v) in _prefilled_block(ref, chain, index).items():
                err = max(np.abs(got[name][0] - k).max(), np.abs(got[name][1] - v).max())
                if err > 0.05:
                    bad.append((block, name, float(err)))

    monkeypatch.setattr(alloc, "publish", checked_publish)
    first = llm.generate(PROMPTS, PARAMS)
    # Later turns extend earlier ones: their prefixes hold blocks written while drafts were
    # being rejected mid-block.
    llm.generate([o.prompt_token_ids + o.token_ids[:27] + [5] for o in first], PARAMS)
    return bad, len(checked)


def test_published_blocks_hold_only_committed_kv(engines, monkeypatch):
    _, on, off = engines
    bad, checked = check_every_publication(on, off, monkeypatch)
    stats = on.stats
    assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens   # drafts were rejected
    assert stats.prefix_cache_hits > 0
    assert checked >= 20 and not bad, bad
    alloc = on.engine.allocator
    assert alloc.num_free_blocks == alloc.total_blocks


def test_the_check_catches_a_block_published_past_the_committed_tokens(engines, monkeypatch):
    name, on, off = engines
    if name != "draft_target":
        pytest.skip("one drafter shows the check's power")
    on.engine.allocator.clear_cache()

    def too_far(self, request):   # the newest token's position counted as computed
        alloc, rid = self.allocator, request.request_id
        if rid in alloc:
            n = request.num_tokens // alloc.tokens_per_block
            if n > len(alloc.entries(rid)):
                alloc.publish(rid, request.all_ids, n)

    monkeypatch.setattr(PrefixCachePolicy, "publish", too_far)
    bad, _ = check_every_publication(on, off, monkeypatch)
    assert bad, "a block holding a position nothing committed was not caught"
    on.engine.allocator.clear_cache()
