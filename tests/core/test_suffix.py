"""SA on the device (`specjax.core.suffix`): the matcher against the suffix automaton (the host
reference, with its draft continued periodically as the device's is) and against brute force
where the bound applies; the history it reads; the global
pool; the enhancer's per-row choice."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core.suffix import (MAX_MATCH, Proposal, SuffixSpec, make_suffix_state, prefer,
                                 propose, record, retire)
from specjax.speculative import SuffixAutomaton


def _state_with(histories: list[list[int]], H: int, spec=SuffixSpec(), pool_rows=()):
    """A SuffixState whose slot i holds histories[i] (recorded in two pieces, as steps do)."""
    state = make_suffix_state(spec, len(histories), H)
    for i, h in enumerate(histories):
        cut = len(h) // 2
        for start, piece in ((0, h[:cut]), (cut, h[cut:])):
            tokens = np.zeros((1, H), np.int32)  # one shape: one compile
            tokens[0, :len(piece)] = piece
            state = record(state, jnp.array([i]), jnp.array([start]), jnp.asarray(tokens),
                           jnp.array([len(piece)]))
    return state


def _common_suffix(seq: list[int], end: int, last: int) -> int:
    n = 0
    while end - n >= 0 and seq[end - n] == seq[last - n]:
        n += 1
    return n


def _brute(seq: list[int], D: int, ngram: int, span: int) -> tuple[list[int], int]:
    """The documented device semantics: match = min(longest earlier suffix, span [, ngram]),
    drafted from the earliest end reaching it, periodically past the newest token."""
    last = len(seq) - 1
    counts = [min(_common_suffix(seq, e, last), span) for e in range(last)]
    match = max(counts, default=0)
    if ngram > 0:
        match = min(match, ngram)
    if match == 0:
        return [], 0
    end = next(e for e, c in enumerate(counts) if c >= match)
    return _periodic(seq, end, D), match


def _periodic(seq: list[int], end: int, D: int) -> list[int]:
    """D tokens after position `end`, repeating the last (len - 1 - end) with that period."""
    period = len(seq) - 1 - end
    return [seq[end + 1 + k % period] for k in range(D)]


def _check(state, rows, D, spec, want_of):
    out = propose(spec, state, jnp.asarray(rows), D)
    for b, row in enumerate(rows):
        want, want_len = want_of(row)
        assert int(out.match[b]) == want_len, (row, want_len)
        got = np.asarray(out.drafts[b]).tolist()
        assert int(out.num[b]) == len(want)
        assert got[:len(want)] == want and not any(got[len(want):]), (row, got, want)


@pytest.mark.parametrize("vocab", [2, 3, 6])
@pytest.mark.parametrize("ngram", [-1, 1, 3])
def test_matcher_equals_the_automaton_on_random_sequences(vocab, ngram):
    """Every true match here is shorter than the bound, so the answer is the automaton's."""
    rng = np.random.default_rng(vocab * 10 + ngram)
    H, D, S = 48, 4, 12
    spec = SuffixSpec(ngram=ngram)
    for _ in range(4):
        seqs = [rng.integers(0, vocab, size=rng.integers(0, H + 1)).tolist() for _ in range(S)]
        state = _state_with(seqs, H)
        _check(state, list(range(S)), D, spec,
               lambda r: SuffixAutomaton(seqs[r]).lookup(D, ngram, periodic=True))


def test_matcher_on_repetitive_sequences_follows_the_automaton_up_to_the_bound():
    """Text that repeats long spans with edits (a function copied with one name changed): the
    automaton's answer while the longest earlier suffix is at most MAX_MATCH; past it, the
    documented bound (earliest end of the last MAX_MATCH tokens)."""
    rng = np.random.default_rng(0)
    H, D = 400, 8
    spec = SuffixSpec()
    seqs, long_matches = [], 0
    for _ in range(24):
        block = rng.integers(0, 50, size=rng.integers(10, 90)).tolist()
        seq = list(block)
        while len(seq) < rng.integers(100, H):
            copy = list(block)
            if rng.random() < 0.7:  # most copies carry one edit
                copy[rng.integers(len(copy))] = int(rng.integers(50))
            seq += copy[:rng.integers(1, len(copy) + 1)]
        seqs.append(seq[:H])
    state = _state_with(seqs, H)
    for r, seq in enumerate(seqs):
        want_auto = SuffixAutomaton(seq).lookup(D, periodic=True)
        if want_auto[1] > MAX_MATCH:
            long_matches += 1
            want = _brute(seq, D, -1, MAX_MATCH)
            assert want[1] == MAX_MATCH
        else:
            want = want_auto
        _check(state, [r], D, spec, lambda _: want)
    assert 0 < long_matches < len(seqs)  # both regimes were exercised


def test_hand_worked_vectors():
    seqs = [[1, 2, 3, 4, 5, 1, 2, 3],          # N=3 -> the suffix 1 2 3 at position 0
            [7, 7, 7, 7],                        # overlapping: ends 1 before the newest -> 7 7
            [5],                                 # nothing earlier
            [],                                  # empty history
            [1, 2, 1, 2, 9, 1, 2]]              # longest is "1 2" at its first occurrence
    state = _state_with(seqs, 16)
    out = propose(SuffixSpec(ngram=3), state, jnp.arange(5), 2)
    assert out.match.tolist() == [3, 3, 0, 0, 2]
    assert out.drafts.tolist() == [[4, 5], [7, 7], [0, 0], [0, 0], [1, 2]]
    assert out.num.tolist() == [2, 2, 0, 0, 2]
    out = propose(SuffixSpec(ngram=-1), state, jnp.arange(5), 3)
    assert out.match.tolist() == [3, 3, 0, 0, 2]
    assert out.drafts.tolist()[0] == [4, 5, 1]


def test_record_overwrites_a_slot_for_a_new_request_and_drops_past_the_end():
    state = _state_with([[1, 2, 3, 1, 2]], 6)
    assert propose(SuffixSpec(), state, jnp.array([0]), 2).match.tolist() == [2]
    # A new request in slot 0: its first chunk starts at 0, the old tokens no longer count.
    state = record(state, jnp.array([0]), jnp.array([0]), jnp.array([[4, 5]]), jnp.array([2]))
    assert state.length.tolist()[0] == 2
    assert propose(SuffixSpec(), state, jnp.array([0]), 2).match.tolist() == [0]
    # Writes past the history's end are dropped, not wrapped.
    state = record(state, jnp.array([0]), jnp.array([5]), jnp.array([[8, 9, 9]]),
                   jnp.array([3]))
    assert state.history[0].tolist() == [4, 5, 3, 1, 2, 8] and int(state.length[0]) == 6


def _global_brute(own: list[int], others: list[list[int]], D: int) -> tuple[list[int], int]:
    """Longest match: own history first (earliest end), then the sources in order, each
    needing a token after the occurrence; ties keep the earlier candidate."""
    best, draft = 0, []
    last = len(own) - 1
    for e in range(last):
        n = min(_common_suffix(own, e, last), MAX_MATCH)
        if n > best:
            best, draft = n, _periodic(own, e, D)
    for seq in others:
        for e in range(len(seq) - 1):
            n = 0
            while e - n >= 0 and last - n >= 0 and seq[e - n] == own[last - n] and n < MAX_MATCH:
                n += 1
            if n > best:
                best, draft = n, seq[e + 1:e + 1 + D]
    return draft, best


def test_global_pool_matches_other_requests_and_kept_finished_ones():
    rng = np.random.default_rng(3)
    H, D, S, P = 40, 4, 5, 3
    spec = SuffixSpec(global_pool=True, pool_size=P)
    retired: list[list[int]] = []
    seqs = [rng.integers(0, 4, size=rng.integers(2, H)).tolist() for _ in range(S)]
    state = _state_with(seqs, H, spec)
    for round_ in range(5):
        # Slots 1 and 3 start new requests: what they held goes to the ring, oldest out.
        fresh_rows = jnp.array([1, 3, S])
        state = retire(state, fresh_rows, jnp.array([True, True, False]))
        retired = (retired + [seqs[1], seqs[3]])[-P:]
        for slot in (1, 3):
            seqs[slot] = rng.integers(0, 4, size=rng.integers(2, H)).tolist()
            tokens = np.zeros((1, H), np.int32)
            tokens[0, :len(seqs[slot])] = seqs[slot]
            state = record(state, jnp.array([slot]), jnp.array([0]), jnp.asarray(tokens),
                           jnp.array([len(seqs[slot])]))
        pool = [np.asarray(state.pool[i])[:int(state.pool_length[i])].tolist()
                for i in range(P) if int(state.pool_length[i])]
        assert sorted(map(tuple, pool)) == sorted(map(tuple, retired)), round_
        out = propose(spec, state, jnp.arange(S), D)
        for b in range(S):
            others = [seqs[i] for i in range(S) if i != b] + pool
            want, want_len = _global_brute(seqs[b], others, D)
            assert int(out.match[b]) == want_len, (round_, b)
            assert np.asarray(out.drafts[b]).tolist()[:len(want)] == want, (round_, b)
            assert int(out.num[b]) == len(want)


def test_the_enhancer_chooses_per_row():
    proposal = Proposal(drafts=jnp.array([[7, 8], [5, 0], [0, 0]]), num=jnp.array([2, 1, 0]),
                        match=jnp.array([6, 3, 0]))
    neural = jnp.array([[1, 2, 3], [4, 4, 4], [6, 6, 6]])
    drafts, num, from_sa, _ = prefer(SuffixSpec(threshold=4), proposal, neural,
                                     jnp.array([3, 3, 3]))
    assert drafts.tolist() == [[7, 8, 0], [4, 4, 4], [6, 6, 6]]
    assert num.tolist() == [2, 3, 3] and from_sa.tolist() == [True, False, False]
    # A tree's nodes: SA's chain replaces the tree, node i below node i - 1.
    _, _, _, parents = prefer(SuffixSpec(threshold=2), proposal, neural, jnp.array([3, 3, 3]),
                              jnp.array([[0, 0, 1]] * 3))
    assert parents.tolist() == [[0, 1, 2], [0, 1, 2], [0, 0, 1]]


def test_the_matcher_compiles_once_per_shape():
    spec = SuffixSpec()
    fn = jax.jit(propose, static_argnums=(0, 3))
    state = _state_with([[1, 2, 1, 2]] * 3, 8)
    for rows in ([0, 1], [2, 0], [1, 1]):
        fn(spec, state, jnp.array(rows), 3)
    assert fn._cache_size() == 1
