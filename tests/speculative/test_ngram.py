"""The NGram pool on hand-worked sequences (TensorRT-LLM's semantics)."""
from specjax import NGramDrafter


def test_pool_contents_and_longest_suffix_first():
    d = NGramDrafter(max_draft_len=3, max_matching_ngram_size=2)
    assert d.propose_for(0, [1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # suffix (1, 2) seen at 0
    pool = d.pool(0)
    assert pool[(1, 2)] == {(3, 4, 1): None}
    assert pool[(4, 1)] == {(2,): None}
    # (1,) was seen twice: (2, 3, 4) first, then the shorter (2,) is appended after it.
    assert list(pool[(1,)]) == [(2, 3, 4), (2,)]


def test_oldest_or_newest_continuation():
    tokens = [5, 6, 7, 5, 6, 8, 5, 6]
    oldest = NGramDrafter(max_draft_len=2, max_matching_ngram_size=1, is_use_oldest=True)
    newest = NGramDrafter(max_draft_len=2, max_matching_ngram_size=1, is_use_oldest=False)
    assert oldest.propose_for(0, tokens, 2) == [7, 5]
    assert newest.propose_for(0, tokens, 2) == [8, 5]
    assert list(oldest.pool(0)[(6,)]) == [(7, 5), (8, 5)]


def test_longer_continuation_drops_shorter_ones():
    d = NGramDrafter(max_draft_len=2, max_matching_ngram_size=1)
    d.propose_for(0, [1, 2, 1, 2], 2)
    assert list(d.pool(0)[(1,)]) == [(2, 1), (2,)]
    d.propose_for(0, [1, 2, 1, 2, 3], 2)   # indexes from the start index on: (1,) -> (2, 3)
    assert list(d.pool(0)[(1,)]) == [(2, 1), (2, 3)]


def test_falls_back_to_shorter_pattern_and_returns_empty_when_unseen():
    d = NGramDrafter(max_draft_len=2, max_matching_ngram_size=3)
    assert d.propose_for(0, [4, 9, 4, 7, 9], 2) == [4, 7]   # (4,7,9),(7,9) unseen; (9,) seen
    assert d.propose_for(1, [10, 11, 12], 2) == []


def test_budget_cuts_the_proposal():
    d = NGramDrafter(max_draft_len=3, max_matching_ngram_size=1, max_sequence_length=8)
    assert d.propose_for(0, [1, 2, 3, 1, 2, 3], 3) == [1]     # 8 - 1 - 6 = 1
    assert d.propose_for(1, [1, 2, 3, 1, 2, 3, 1], 3) == []   # no room left
    # The pool is public by default: request 2 gets request 0's oldest continuation of (1,).
    assert d.propose_for(2, [1, 2, 1], 2) == [2, 3]


def test_public_pool_is_shared_private_is_not():
    public = NGramDrafter(max_draft_len=2, max_matching_ngram_size=1, is_public_pool=True)
    private = NGramDrafter(max_draft_len=2, max_matching_ngram_size=1, is_public_pool=False)
    for d in (public, private):
        d.propose_for(0, [1, 2, 3, 4], 2)
    assert public.propose_for(1, [9, 3], 2) == [4]
    assert private.propose_for(1, [9, 3], 2) == []
    private.on_request_finished(0)
    assert 0 not in private._pools


def test_start_index_indexes_only_new_windows():
    d = NGramDrafter(max_draft_len=2, max_matching_ngram_size=2, is_public_pool=False)
    d.propose_for(0, [1, 2, 3, 4, 5, 6], 2)
    assert d._start[0] == 6 - (2 + 2 - 1)
    d.pool(0).clear()
    d.propose_for(0, [1, 2, 3, 4, 5, 6, 7], 2)
    # Only windows from position 3 on were indexed again.
    assert (1, 2) not in d.pool(0) and (4, 5) in d.pool(0)


def test_keep_all_off_replaces_with_a_longer_continuation():
    d = NGramDrafter(max_draft_len=3, max_matching_ngram_size=1, is_keep_all=False)
    d.propose_for(0, [1, 2], 3)
    assert list(d.pool(0)[(1,)]) == [(2,)]
    d.propose_for(0, [1, 2, 3], 3)
    assert list(d.pool(0)[(1,)]) == [(2, 3)]


def test_evidence_off_is_the_reference():
    """The defaults ask no evidence: a single earlier occurrence of a 1-token pattern proposes."""
    d = NGramDrafter(max_draft_len=2, max_matching_ngram_size=3)
    assert (d.min_matching_ngram_size, d.min_followed_ratio) == (1, 0.0)
    assert d.propose_for(0, [7, 1, 2, 9, 1], 2) == [2, 9]


def test_no_proposal_from_a_match_shorter_than_asked():
    d = NGramDrafter(max_draft_len=2, max_matching_ngram_size=3, min_matching_ngram_size=2,
                     is_public_pool=False)
    assert d.propose_for(0, [7, 1, 2, 9, 1], 2) == []          # only (1,) matches
    assert d.last_match[0] == 1
    assert d.propose_for(1, [7, 1, 2, 9, 7, 1], 2) == [2, 9]   # (7, 1) matches
    assert d.last_match[0] == 2


def test_followed_ratio_counts_each_position_once():
    # (5,) was followed by 6 once, then by 8 twice: the oldest continuation (6, ...) has
    # 1 of 3 occurrences behind it.
    tokens = [5, 6, 5, 8, 5, 8, 5]
    strict = NGramDrafter(max_draft_len=2, max_matching_ngram_size=1, is_public_pool=False,
                          min_followed_ratio=0.5)
    loose = NGramDrafter(max_draft_len=2, max_matching_ngram_size=1, is_public_pool=False,
                         min_followed_ratio=0.3)
    assert strict.propose_for(0, tokens, 2) == []
    assert strict.last_match == (1, 1, 3)
    assert loose.propose_for(0, tokens, 2) == [6, 5]
    # Asked again as the sequence grows one token at a time, each position is counted once:
    # the counts equal a fresh drafter's over the whole sequence.
    grown = NGramDrafter(max_draft_len=2, max_matching_ngram_size=2, is_public_pool=False,
                         min_followed_ratio=0.5)
    fresh = NGramDrafter(max_draft_len=2, max_matching_ngram_size=2, is_public_pool=False,
                         min_followed_ratio=0.5)
    seq = [3, 4, 3, 4, 5, 3, 4, 3, 9, 3, 4]
    for n in range(1, len(seq) + 1):
        grown.propose_for(0, seq[:n], 2)
    fresh.propose_for(0, seq, 2)
    assert grown._counts[0] == fresh._counts[0]
    assert grown._counts[0][(3,)] == {4: 4, 9: 1}
    grown.on_request_finished(0)
    assert 0 not in grown._counts and 0 not in grown._counted


def test_evidence_config_is_checked_and_reaches_the_drafter():
    import pytest
    from specjax.speculative.build import get_spec_drafter
    from specjax.speculative.config import NGramConfig
    config = NGramConfig(max_draft_len=4, max_matching_ngram_size=4, min_matching_ngram_size=2,
                         min_followed_ratio=0.5)
    d = get_spec_drafter(config)
    assert (d.min_matching_ngram_size, d.min_followed_ratio) == (2, 0.5)
    assert NGramConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="min_matching_ngram_size .*at most"):
        NGramConfig(max_matching_ngram_size=2, min_matching_ngram_size=3)
    with pytest.raises(ValueError, match="min_followed_ratio"):
        NGramConfig(min_followed_ratio=1.5)


def test_repeated_ad_hoc_calls_do_not_inflate_the_public_counts():
    """`propose` (no request id) indexes its whole sequence each call; its follower counts stay
    its own, so asking twice gives the same answer as asking once."""
    d = NGramDrafter(max_draft_len=2, max_matching_ngram_size=1, min_followed_ratio=0.5)
    tokens = [5, 6, 5, 8, 5, 8, 5, 6, 5]   # (5,) -> 6 twice, 8 twice: the oldest, 6, has half
    assert d.propose(tokens, 2) == [6, 5]
    assert d.propose(tokens, 2) == [6, 5]
    assert d._public_counts == {} and d._counts == {}
