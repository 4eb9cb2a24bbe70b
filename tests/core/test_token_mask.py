"""Structured output on the device: packed token masks applied to logits, read per token, and
the cut of a row's drafts at the first one its grammar forbids."""
import jax
import jax.numpy as jnp
import numpy as np
from llguidance.numpy import apply_token_bitmask_inplace

from specjax.core.batch import empty_batch, set_row
from specjax.core.logits import apply_token_mask, mask_bits
from specjax.core.steps import clip_to_mask

V = 100   # not a multiple of 32: the last word's high bits lie past the vocabulary
W = (V + 31) // 32


def random_masks(rng, shape) -> np.ndarray:
    return rng.integers(-2**31, 2**31, size=shape + (W,), dtype=np.int64).astype(np.int32)


def test_masked_logits_match_llguidances_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 4, V)).astype(np.float32)
    masks = random_masks(rng, (3, 4))
    masks[1] = -1                                 # an unconstrained row: all ones
    got = np.asarray(jax.jit(apply_token_mask)(logits, masks))
    ref = logits.reshape(12, V).copy()
    apply_token_bitmask_inplace(ref, masks.reshape(12, W))
    np.testing.assert_array_equal(got, ref.reshape(3, 4, V))
    np.testing.assert_array_equal(got[1], logits[1])
    assert np.isinf(got).any() and not np.isinf(got[1]).any()


def test_all_ones_masks_change_nothing_and_none_means_no_input():
    logits = jnp.arange(2 * 3 * V, dtype=jnp.float32).reshape(2, 3, V)
    ones = jnp.full((2, 3, W), -1, jnp.int32)
    np.testing.assert_array_equal(apply_token_mask(logits, ones), logits)
    assert apply_token_mask(logits, None) is logits


def test_mask_bits_read_bit_t_mod_32_of_word_t_div_32():
    rng = np.random.default_rng(1)
    masks = random_masks(rng, (2, 5))
    tokens = rng.integers(0, V, size=(2, 5))
    words = masks.view(np.uint32)[np.arange(2)[:, None], np.arange(5), tokens // 32]
    expected = (words >> (tokens % 32).astype(np.uint32)) & 1 == 1
    np.testing.assert_array_equal(np.asarray(mask_bits(masks, tokens)), expected)


def test_drafts_are_cut_at_the_first_forbidden_one():
    D = 4
    batch = empty_batch(4, D + 1, 2, spare_slot=9, mask_shape=(D + 1, W))
    drafts = [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 2]]
    for row, d in enumerate(drafts):
        set_row(batch, row, run=[3] + d, start_pos=10, blocks=[1], slot=row, max_len=99)

    def forbid(row, pos, token):
        words = batch.token_mask[row, pos].view(np.uint32)
        words[token // 32] &= ~np.uint32(1 << (token % 32))

    forbid(0, 2, 7)          # row 0: draft 3 forbidden -> 2 drafts verified
    forbid(1, 0, 5)          # row 1: the first draft forbidden -> none
    forbid(2, 3, 9)          # row 2: a token it did not draft -> all 4
    forbid(3, 2, 5)          # row 3: past its 2 real drafts -> both
    batch.token_mask[3, 2] = 0   # (the host leaves rows past a row's drafts alone)
    out = clip_to_mask(batch)
    np.testing.assert_array_equal(np.asarray(out.query_lens), [3, 1, 5, 3])
    padded = empty_batch(2, D + 1, 2, spare_slot=9, mask_shape=(D + 1, W))
    padded.token_mask[:] = 0   # padding stays padding whatever its masks say
    np.testing.assert_array_equal(np.asarray(clip_to_mask(padded).query_lens), [0, 0])


def test_rows_the_host_wrote_keep_their_run_where_runs_come_from_slots():
    from specjax.core.state import make_slot_state, write_slots
    from specjax.core.steps import runs_from_slots
    D = 3
    slots = make_slot_state(2, D)
    slots = write_slots(slots, jnp.asarray([0, 1]), jnp.asarray([[9, 1, 2, 3], [8, 4, 5, 6]]),
                        jnp.asarray([20, 30]), jnp.asarray([3, 2]))
    batch = empty_batch(2, D + 1, 2, spare_slot=2, mask_shape=(D + 1, W))
    set_row(batch, 0, run=[9, 7], start_pos=20, blocks=[1], slot=0, max_len=99)
    set_row(batch, 1, run=[8], start_pos=30, blocks=[2], slot=1, max_len=99)
    batch.host_runs[0] = True
    out = runs_from_slots(batch, slots, D)
    np.testing.assert_array_equal(np.asarray(out.tokens), [[9, 7, 0, 0], [8, 4, 5, 6]])
    np.testing.assert_array_equal(np.asarray(out.query_lens), [2, 3])
    np.testing.assert_array_equal(np.asarray(out.start_pos), [20, 30])
