"""Block allocator invariants under arbitrary operation sequences (hypothesis)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.engine.allocator import BlockAllocator, OutOfBlocks

OPS = st.lists(st.tuples(st.sampled_from(["allocate", "add", "rewind", "free"]),
                         st.integers(0, 5), st.integers(0, 40)), max_size=120)


def _check(alloc: BlockAllocator, lengths: dict[int, int]) -> None:
    assert alloc.num_free_blocks + alloc.num_held_blocks == alloc.total_blocks
    held = [b for s in lengths for b in alloc.blocks(s)]
    assert len(held) == len(set(held)), "a block is held twice"
    assert 0 not in held, "the null block was handed out"
    for seq, length in lengths.items():
        assert alloc.length(seq) == length
        # Exactly the blocks covering live positions: none freed early, none kept late.
        assert len(alloc.blocks(seq)) == -(-length // alloc.tokens_per_block)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, num_blocks=st.integers(2, 12), bs=st.integers(1, 5))
def test_invariants_hold_after_any_sequence(ops, num_blocks, bs):
    alloc = BlockAllocator(num_blocks, bs)
    lengths: dict[int, int] = {}
    for op, seq, n in ops:
        if op == "allocate" and seq not in lengths:
            alloc.allocate(seq)
            lengths[seq] = 0
        elif op == "add" and seq in lengths:
            before = (alloc.num_free_blocks, list(alloc.blocks(seq)))
            if alloc.can_add(seq, n):
                alloc.add_tokens(seq, n)
                lengths[seq] += n
            else:
                with pytest.raises(OutOfBlocks):
                    alloc.add_tokens(seq, n)
                assert (alloc.num_free_blocks, alloc.blocks(seq)) == before  # all or nothing
        elif op == "rewind" and seq in lengths:
            n = min(n, lengths[seq])
            before = list(alloc.blocks(seq))
            alloc.rewind(seq, n)
            lengths[seq] -= n
            # Only trailing blocks go; the ones still covering live positions stay, in order.
            assert alloc.blocks(seq) == before[:len(alloc.blocks(seq))]
        elif op == "free":
            alloc.free(seq)
            lengths.pop(seq, None)
        _check(alloc, lengths)
    for seq in list(lengths):
        alloc.free(seq)
    assert alloc.num_free_blocks == alloc.total_blocks


def test_rewind_keeps_partially_live_block():
    alloc = BlockAllocator(8, 4)
    alloc.allocate(1)
    alloc.add_tokens(1, 9)   # blocks cover positions 0-3, 4-7, 8
    first_two = alloc.blocks(1)[:2]
    alloc.rewind(1, 3)       # length 6: position 5 still lives in the second block
    assert alloc.blocks(1) == first_two and alloc.num_free_blocks == 5
    alloc.rewind(1, 2)       # length 4: the second block holds nothing live now
    assert alloc.blocks(1) == first_two[:1]


def test_errors():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(1, 4)
    alloc = BlockAllocator(4, 2)
    alloc.allocate(0)
    with pytest.raises(ValueError, match="already allocated"):
        alloc.allocate(0)
    with pytest.raises(ValueError, match="rewind"):
        alloc.rewind(0, 1)
    with pytest.raises(OutOfBlocks, match="needs 4 more KV blocks, 3 free"):
        alloc.add_tokens(0, 7)
    alloc.free(0)
    alloc.free(0)  # idempotent
    assert alloc.num_free_blocks == 3
