"""Attention reads through the narrowest block table that holds the batch's context, and the
output stays exact when a batch's contexts cross from one width to the next."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import specjax
from specjax import DraftTargetConfig, NGramConfig, SamplingParams
from specjax.core.forward import (MAX_TABLE_WIDTHS, MIN_TABLE_TOKENS, table_widths,
                                  with_narrowest_table)
from specjax.engine.compile_counter import count_compilations
from specjax.models import Llama
from specjax.models.dense_greedy import dense_greedy
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.speculative.config import EagleConfig
from tests.conftest import TINY


@pytest.mark.parametrize("max_blocks,tokens_per_block",
                         [(128, 16), (129, 16), (65, 16), (33, 4), (17, 4), (9, 16), (1, 16),
                          (300, 1)])
def test_widths_cover_the_table_a_factor_of_two_apart(max_blocks, tokens_per_block):
    widths = table_widths(max_blocks, tokens_per_block)
    assert widths[-1] == max_blocks and list(widths) == sorted(set(widths))
    assert len(widths) <= MAX_TABLE_WIDTHS
    assert all(b >= 2 * a for a, b in zip(widths, widths[1:]))
    assert all(w * tokens_per_block >= MIN_TABLE_TOKENS for w in widths[:-1])


def test_the_narrowest_covering_width_is_read():
    bs, tables = 16, jnp.zeros((3, 128), jnp.int32)
    widths = table_widths(128, bs)
    assert len(widths) > 2
    pick = jax.jit(lambda lens: with_narrowest_table(lambda t: jnp.int32(t.shape[1]), tables,
                                                     lens, bs))
    for lens in ([0, 0, 0], [1, 0, 0], [0, 0, widths[0] * bs], [widths[0] * bs + 1, 2, 0],
                 [5, widths[1] * bs, 7], [widths[1] * bs + 1, 0, 0], [2048, 0, 0],
                 [1000, 5, 0]):
        want = min(w for w in widths if w * bs >= max(lens))
        assert int(pick(jnp.asarray(lens, jnp.int32))) == want, lens


LONG = TINY.replace(max_position_embeddings=1024, num_layers=8)  # EAGLE-3 needs > 5
# Prompts whose contexts, with MAX_TOKENS more, end in different widths (8, 16, 32, 65 blocks
# of 16 tokens): a batch's width is set by its longest row, the short rows ride along.
LENGTHS = (5, 140, 300, 700)
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def long_model():
    return Llama(LONG, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def prompts_and_refs(long_model):
    prompts = [[(7 * i + 3 * n) % 61 + 1 for i in range(n)] for n in LENGTHS]
    return prompts, [dense_greedy(long_model, p, MAX_TOKENS) for p in prompts]


def _head(model):
    return Eagle3Head(Eagle3HeadConfig.for_target(LONG), nnx.Rngs(4))


SPECS = {
    "plain": lambda model: None,
    "ngram": lambda model: NGramConfig(max_draft_len=3),
    "draft_target_self": lambda model: DraftTargetConfig(max_draft_len=3,
                                                         speculative_model=model),
    "eagle3": lambda model: EagleConfig(max_draft_len=3, speculative_model=_head(model)),
}


@pytest.mark.parametrize("mode", list(SPECS))
def test_contexts_across_widths_are_exact(mode, long_model, prompts_and_refs):
    prompts, refs = prompts_and_refs
    llm = specjax.LLM(long_model, speculative_config=SPECS[mode](long_model), max_batch_size=4,
                      tokens_per_block=16, prefill_chunk=64, progress=False, warmup=True)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    with count_compilations() as compiled:
        for batch in ([0], [1], [2], [3], [0, 1], [0, 3], [0, 1, 2, 3]):
            outs = llm.generate([prompts[i] for i in batch], params)
            for i, out in zip(batch, outs):
                assert out.token_ids == refs[i], (mode, LENGTHS[i], batch)
        assert compiled() == 0
    allocator = llm.engine.allocator
    assert allocator.num_free_blocks == allocator.total_blocks
    if mode == "draft_target_self":  # reading the drafter's pool wrongly would reject drafts
        assert llm.stats.acceptance_rate == 1.0
