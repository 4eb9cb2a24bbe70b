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
    seen: dict[int, tuple[list[int], int]] = {}   # seq -> (its blocks, their version)
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
        # A copy of a block list is stale exactly when its version says so, and versions are
        # never shared between sequences (a slot table keyed by version is never wrong).
        versions = {s: alloc.version(s) for s in lengths}
        assert len(set(versions.values())) == len(versions)
        for s in lengths:
            if s in seen and seen[s][1] == versions[s]:
                assert seen[s][0] == alloc.blocks(s)
            seen[s] = (list(alloc.blocks(s)), versions[s])
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


CACHE_OPS = st.lists(st.tuples(st.sampled_from(["start", "add", "publish", "rewind", "free"]),
                               st.integers(0, 4), st.integers(0, 12)), max_size=150)


@settings(max_examples=200, deadline=None)
@given(ops=CACHE_OPS, num_blocks=st.integers(3, 7), bs=st.integers(1, 3),
       lookahead=st.integers(0, 1), seed=st.integers(0, 2**16))
def test_prefix_cache_shares_only_equal_contents(ops, num_blocks, bs, lookahead, seed):
    """A shadow memory records the token each sequence wrote at each block offset; whatever a
    lookup returns must hold exactly the looked-up tokens, however blocks were shared,
    rewound, freed and evicted, and counts stay consistent (cached-but-free blocks are free)."""
    import random
    rng = random.Random(seed)
    alloc = BlockAllocator(num_blocks, bs, lookahead)
    memory: dict[tuple[int, int], int] = {}      # (block, offset) -> token written there
    seqs: dict[int, list[int]] = {}              # seq -> its tokens (the first `length` live)

    def write(seq, start, end):
        for pos in range(start, end):
            memory[alloc.blocks(seq)[pos // bs], pos % bs] = seqs[seq][pos]

    for op, seq, n in ops:
        if op == "start" and seq not in seqs:
            # Few distinct tokens, so prefixes repeat and the cache gets hits.
            tokens = [rng.randrange(2) for _ in range(n + 1)]
            cached = alloc.match(tokens)
            for i, block in enumerate(cached[0]):
                for off in range(bs):
                    assert memory[block, off] == tokens[i * bs + off], "a block was shared " \
                        "whose contents differ from the tokens looked up"
            alloc.allocate(seq, cached)
            seqs[seq] = tokens
            length = alloc.length(seq)
            assert length == len(cached[0]) * bs <= len(tokens) - 1
            if alloc.can_add(seq, len(tokens) - length):   # its prompt, as admission does
                alloc.add_tokens(seq, len(tokens) - length)
                write(seq, length, len(tokens))
        elif op == "add" and seq in seqs:
            length = alloc.length(seq)
            n = min(n, len(seqs[seq]) - length)
            if alloc.can_add(seq, n):
                alloc.add_tokens(seq, n)
                write(seq, length, length + n)
        elif op == "publish" and seq in seqs:
            # Publish what the engine would: full blocks below the length whose lookahead
            # tokens exist.
            limit = min(alloc.length(seq), len(seqs[seq]) - lookahead)
            alloc.publish(seq, seqs[seq], max(limit, 0) // bs)
        elif op == "rewind" and seq in seqs:
            entries = len(alloc.entries(seq))
            n = min(n, alloc.length(seq) - entries * bs)   # never below what it published
            alloc.rewind(seq, n)
        elif op == "free":
            alloc.free(seq)
            seqs.pop(seq, None)
        held = {b for s in seqs for b in alloc.blocks(s)}
        assert 0 not in held
        assert alloc.num_free_blocks + len(held) == alloc.total_blocks
        assert all(-(-alloc.length(s) // bs) == len(alloc.blocks(s)) for s in seqs)
    for seq in list(seqs):
        alloc.free(seq)
    assert alloc.num_free_blocks == alloc.total_blocks


def test_prefix_cache_lifecycle():
    """Publish, share, free into the cache (still free), evict tail first under pressure, and
    never find an evicted block again."""
    alloc = BlockAllocator(6, 2)                       # 5 allocatable blocks of 2 tokens
    a = [1, 2, 3, 4, 5, 6, 7]
    alloc.allocate(0)
    alloc.add_tokens(0, 7)                             # 4 blocks
    alloc.publish(0, a, 3)
    assert alloc.num_cached_blocks == 3 and alloc.num_free_blocks == 1
    # The last token is always computed again: 3 full blocks of 7 tokens, 2 of 5.
    assert alloc.match(a)[0] == alloc.blocks(0)[:3]
    assert alloc.match(a[:5])[0] == alloc.blocks(0)[:2]
    assert alloc.match([1, 2, 3, 9, 5, 6, 7])[0] == alloc.blocks(0)[:1]
    shared = alloc.match(a)
    alloc.allocate(1, shared)                          # shares 3 blocks, costs none
    assert alloc.length(1) == 6 and alloc.num_free_blocks == 1
    alloc.free(0)
    alloc.free(1)
    assert alloc.num_free_blocks == 5 and alloc.num_cached_blocks == 3
    head, middle, tail = shared[0]
    alloc.allocate(2)
    alloc.add_tokens(2, 6)     # 2 never-cached blocks, then the least recently freed: the tail
    assert tail in alloc.blocks(2) and head not in alloc.blocks(2)
    assert alloc.match(a)[0] == [head, middle]         # the evicted tail is not found again
    alloc.add_tokens(2, 4)                             # evicts the rest
    assert alloc.match(a)[0] == [] and alloc.num_cached_blocks == 0
    alloc.free(2)
    assert alloc.num_free_blocks == 5
