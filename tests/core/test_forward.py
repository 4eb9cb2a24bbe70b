"""Attention reads the pool a chunk of blocks at a time, as far as the batch's context goes,
and the output stays exact when a batch's contexts span one chunk or many."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from pallas_kernels.paged_attention import paged_attention_chunks, paged_attention_reference
from specjax import DraftTargetConfig, NGramConfig, SamplingParams
from specjax.engine.compile_counter import count_compilations
from specjax.core import empty_batch, set_row
from specjax.core.forward import paged_forward
from specjax.models import Llama
from specjax.models.dense_greedy import dense_greedy
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig
from specjax.speculative.config import EagleConfig
from tests.conftest import TINY
from tests.spec_checks import full_depth, is_dense_greedy


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("window", [2**30, 7])
def test_chunked_reads_equal_the_whole_table(tree, window):
    """Chunks of 3 blocks of 4 tokens over a 10-block table (the last chunk padded): every
    mix of context lengths -- none, inside the first chunk, at a chunk's edge, across the
    padding -- gives the whole-table oracle's attention, trees and windows included."""
    B, T, H, KV, hd, bs, M, N = 3, 4, 4, 2, 8, 4, 10, 40
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, H, hd))
    k_pool = jax.random.normal(keys[1], (2, N, KV, bs, hd))
    v_pool = jax.random.normal(keys[2], (2, N, KV, bs, hd))
    tables = 1 + jax.random.permutation(keys[3], N - 1)[:B * M].reshape(B, M)
    tree_mask = jnp.asarray([[1, 3, 5, 9]] * B, jnp.int32) if tree else None
    read = jax.jit(lambda lens, pos: paged_attention_chunks(
        q, k_pool, v_pool, 1, tables, pos, lens, window, tree_mask, chunk_blocks=3)[0])
    for lens in ([0, 0, 0], [4, 0, 1], [12, 13, 0], [36, 40, 3], [25, 12, 11]):
        lens = jnp.asarray(lens, jnp.int32)
        start = jnp.maximum(lens - T, 0)
        pos = start[:, None] + (jnp.asarray([0, 1, 1, 2]) if tree else jnp.arange(T))
        want = paged_attention_reference(q, k_pool, v_pool, 1, tables, pos, lens, window,
                                         tree_mask)
        np.testing.assert_allclose(np.asarray(read(lens, pos)), np.asarray(want), atol=2e-6,
                                   err_msg=str(lens))


def test_a_sliding_window_layer_reads_no_chunk_wholly_before_its_window():
    """Every chunk (2 blocks) wholly before a row's window, or wholly past its context, holds
    NaN: a read of any of it would turn the output NaN (a NaN V times a zero weight), so the
    chunked reader must start each row at its window's chunk; its attention equals the
    oracle's on the clean pool. Rows at different depths: each starts at its own chunk."""
    B, T, H, KV, hd, bs, M, N, window = 3, 2, 4, 2, 8, 4, 12, 40, 6
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (B, T, H, hd))
    clean = jax.random.normal(keys[1], (2, 2, N, KV, bs, hd))
    tables = np.arange(1, 1 + B * M).reshape(B, M)
    lens = np.asarray([46, 9, 30], np.int32)
    pos = (lens - T)[:, None] + np.arange(T)
    poisoned = np.asarray(clean).copy()
    chunk = 2 * bs
    for b in range(B):
        for j in range(M):
            c = j * bs // chunk
            if (c + 1) * chunk <= pos[b, 0] - window + 1 or c * chunk >= lens[b]:
                poisoned[:, 1, tables[b, j]] = np.nan
    assert np.isnan(poisoned).any(axis=(0, 1, 3, 4, 5))[tables].sum() >= 12
    k, v = jnp.asarray(poisoned[0]), jnp.asarray(poisoned[1])
    got = paged_attention_chunks(q, k, v, 1, jnp.asarray(tables), jnp.asarray(pos),
                                 jnp.asarray(lens), window, chunk_blocks=2)[0]
    want = paged_attention_reference(q, clean[0], clean[1], 1, jnp.asarray(tables),
                                     jnp.asarray(pos), jnp.asarray(lens), window)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


LONG = TINY.replace(max_position_embeddings=1024, num_layers=8)  # EAGLE-3 needs > 5
# Prompts whose contexts, with MAX_TOKENS more, span 1, 2, 3 and 6 chunks of 128 tokens: a
# batch's chunk count is set by its longest row, the short rows ride along.
LENGTHS = (5, 140, 300, 700)
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def long_model():
    return Llama(LONG, rngs=nnx.Rngs(3))


class DenseGreedy:
    """Plain greedy's continuation of each prompt (`dense_greedy`'s, one dense forward per
    token), proven with one forward (`is_dense_greedy`): the first continuation seen for a
    prompt is proven so, every later one must equal it."""

    def __init__(self, model, prompts):
        self.model, self.prompts, self.proven = model, prompts, {}

    def check(self, i: int, tokens: list[int], context) -> None:
        if i not in self.proven:
            assert is_dense_greedy(self.model, self.prompts[i], tokens, MAX_TOKENS), (
                context, tokens)
            self.proven[i] = tokens
        assert tokens == self.proven[i], context


@pytest.fixture(scope="module")
def prompts_and_refs(long_model):
    prompts = [[(7 * i + 3 * n) % 61 + 1 for i in range(n)] for n in LENGTHS]
    return prompts, DenseGreedy(long_model, prompts)


def test_the_dense_check_is_dense_greedy(long_model, prompts_and_refs):
    """`DenseGreedy` proves what `dense_greedy` decodes (the short prompt's, one loop), and
    refuses a continuation that is not greedy."""
    prompts, refs = prompts_and_refs
    want = dense_greedy(long_model, prompts[0], MAX_TOKENS)
    wrong = want[:5] + [(want[5] + 1) % LONG.vocab_size] + want[6:]
    with pytest.raises(AssertionError):
        DenseGreedy(long_model, prompts).check(0, wrong, "wrong")
    refs.check(0, want, "dense_greedy")


def _head(model):
    return Eagle3Head(Eagle3HeadConfig.for_target(LONG), nnx.Rngs(4))


SPECS = {
    "plain": lambda model: None,
    "ngram": lambda model: NGramConfig(max_draft_len=3),
    "draft_target_self": lambda model: DraftTargetConfig(max_draft_len=3,
                                                         speculative_model=model),
    "eagle3": lambda model: EagleConfig(max_draft_len=3, speculative_model=_head(model)),
}


# Plain steps and a hidden-state drafter in the default run; NGram (a host drafter: the same
# verify widths as EAGLE-3's) and the self-drafting draft model (~10 s) in the slow job.
@pytest.mark.parametrize("mode", [pytest.param(m, marks=() if m in ("plain", "eagle3") else
                                               pytest.mark.slow) for m in SPECS])
def test_contexts_across_widths_are_exact(mode, long_model, prompts_and_refs):
    prompts, refs = prompts_and_refs
    spec = SPECS[mode](long_model)
    # One batch bucket, one prompt row a step: batches of 1, 2 and 4 rows run padded to 4
    # (the chunk count still set by the longest row), half the programs to warm up.
    llm = specjax.LLM(long_model, speculative_config=spec and full_depth(spec), max_batch_size=4,
                      batch_sizes=(4,), max_prefill_rows=1, tokens_per_block=16,
                      prefill_chunk=64, progress=False, warmup=True)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    outputs = []
    with count_compilations() as compiled:
        for batch in ([0], [1], [2], [3], [0, 1], [0, 3], [0, 1, 2, 3]):
            outs = llm.generate([prompts[i] for i in batch], params)
            outputs += [(i, out.token_ids, batch) for i, out in zip(batch, outs)]
        assert compiled() == 0
    for i, tokens, batch in outputs:  # the dense check compiles: after the count
        refs.check(i, tokens, (mode, LENGTHS[i], batch))
    allocator = llm.engine.allocator
    assert allocator.num_free_blocks == allocator.total_blocks
    if mode == "draft_target_self":  # reading the drafter's pool wrongly would reject drafts
        assert llm.stats.acceptance_rate == 1.0


def test_the_step_holds_one_layer_and_one_attention_body():
    """Scanned layers (`scan_layers=True`, the default off CPU) and chunked table reads: the
    generation step's program does not grow with the model's depth, nor with its maximum
    length (a branch per table width would); unrolled layers (the CPU default) grow with
    depth alone."""
    def program(layers: int, max_len: int, scan: bool) -> int:
        model = Llama(TINY.replace(num_layers=layers, max_position_embeddings=max_len),
                      rngs=nnx.Rngs(0))
        llm = specjax.LLM(model, max_batch_size=2, tokens_per_block=4, scan_layers=scan,
                          progress=False)
        ex = llm.engine.executor
        batch = empty_batch(2, 3, ex.blocks_per_seq, ex.spare_slot)
        return len(ex.steps["generation"].lower(ex.params, ex.state, batch).as_text()
                   .splitlines())

    base = program(2, 256, True)
    assert program(6, 256, True) == base
    assert program(2, 2048, True) == base
    assert program(2, 2048, False) == program(2, 256, False)


def test_padding_rows_stay_zero_through_the_layers_and_real_rows_are_untouched():
    """Padding tokens leave the paged forward as zeros after every layer, even with q/k/v
    biases (Qwen's): their embedding and attention output are zeroed, and the CPU kernel
    skips zero rows. A real row's hidden states are bit for bit the same with a padding row
    or a real one beside it, and within float32 rounding of a narrower step's: XLA:CPU picks
    the attention dots' accumulation order by shape and host (an AVX2-only EPYC differed by
    3.7e-9 between widths 4 and 2), so across widths only closeness is promised."""
    model = Llama(TINY.replace(qkv_bias=True, max_position_embeddings=64), rngs=nnx.Rngs(0))
    llm = specjax.LLM(model, max_batch_size=2, tokens_per_block=4, progress=False)
    ex = llm.engine.executor
    blocks = [1, 2]
    forward = jax.jit(lambda params, pool, batch: paged_forward(
        nnx.merge(ex.graphdef, params), pool, batch, capture_layers=(0,))[1:])

    def run(width, neighbour=None):
        batch = empty_batch(2, width, ex.blocks_per_seq, ex.spare_slot)
        set_row(batch, 0, run=[5, 6], start_pos=0, slot=0, blocks=blocks, max_len=64)
        if neighbour is not None:
            set_row(batch, 1, run=neighbour, start_pos=0, slot=1, blocks=[3, 4], max_len=64)
        return forward(ex.params.target, ex.state.target, batch)

    hidden, captured = run(4)   # row 0: two tokens, two padding; row 1: all padding
    assert np.all(np.asarray(hidden[0, 2:]) == 0) and np.all(np.asarray(hidden[1]) == 0)
    assert np.all(np.asarray(captured[:, 0, 2:]) == 0)
    assert np.any(np.asarray(hidden[0, :2]) != 0)
    beside_real, _ = run(4, neighbour=[7, 8, 9, 10])
    assert np.any(np.asarray(beside_real[1]) != 0)
    np.testing.assert_array_equal(np.asarray(hidden[0]), np.asarray(beside_real[0]))
    narrower, _ = run(2)
    np.testing.assert_allclose(np.asarray(hidden[0, :2]), np.asarray(narrower[0]),
                               rtol=1e-5, atol=1e-7)


def test_a_batch_of_the_wrong_shape_is_refused_by_name():
    """Shapes are checked while a step is traced: a field that disagrees with the batch's
    tokens is named before anything compiles."""
    model = Llama(TINY.replace(max_position_embeddings=64), rngs=nnx.Rngs(0))
    llm = specjax.LLM(model, max_batch_size=2, tokens_per_block=4, progress=False)
    ex = llm.engine.executor
    good = empty_batch(2, 3, ex.blocks_per_seq, ex.spare_slot)
    ex.steps["generation"].lower(ex.params, ex.state, good)   # the good one traces
    for field, bad in (("query_lens", np.zeros(3, np.int32)),
                       ("temperature", np.zeros(2, np.int32)),
                       ("block_tables", np.zeros((2,), np.int32))):
        with pytest.raises(ValueError, match=f"StepBatch.{field} has shape"):
            ex.steps["generation"].lower(ex.params, ex.state, good.replace(**{field: bad}))


def test_step_outputs_of_the_wrong_shape_are_refused():
    """The steps assert their outputs' shapes while traced (`GenerationOutput.check`,
    `PrefillOutput.check`): an output that disagrees with its batch is an error, not a
    silently misread row."""
    from specjax.core.batch import GenerationOutput, PrefillOutput
    from specjax.core.logits import logprobs_of

    B, D, V = 3, 2, 16
    tokens = jnp.zeros((B, D + 1), jnp.int32)
    lens = jnp.ones((B,), jnp.int32)
    drafts = jnp.zeros((B, D), jnp.int32)
    lp = logprobs_of(jnp.zeros((B, D + 1, V)), tokens)
    GenerationOutput(tokens, lens, drafts, lens, None, lp).check(B, D)
    for bad in (GenerationOutput(tokens[:, :D], lens, drafts, lens),
                GenerationOutput(tokens, lens[:2], drafts, lens),
                GenerationOutput(tokens, lens, drafts, lens.astype(jnp.float32)),
                GenerationOutput(tokens, lens, drafts, lens, None, logprobs_of(
                    jnp.zeros((B, D, V)), tokens[:, :D]))):
        with pytest.raises(AssertionError):
            bad.check(B, D)
    PrefillOutput(lens, jnp.zeros((2, B, 4, 8))).check(B, 4)
    with pytest.raises(AssertionError):
        PrefillOutput(lens, jnp.zeros((2, B, 5, 8))).check(B, 4)
