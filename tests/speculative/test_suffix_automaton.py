"""The suffix automaton (SA's host reference) against brute force and hand-worked vectors."""
import numpy as np
import pytest

from specjax.speculative import SuffixAutomaton


def brute_force(tokens, max_draft_len, n=-1):
    """The definition, directly: the longest suffix (at most n when n > 0) that also occurs
    ending before the last token, at its earliest occurrence, and the tokens after it."""
    size = len(tokens)
    longest = size - 1 if n <= 0 else min(n, size - 1)
    for length in range(longest, 0, -1):
        suffix = tokens[size - length:]
        for start in range(size - length):  # ends at start + length - 1 < size - 1
            if tokens[start:start + length] == suffix:
                after = start + length
                return tokens[after:after + max_draft_len], length
    return [], 0


def test_hand_worked_vectors():
    sa = SuffixAutomaton([1, 2, 3, 4, 5, 1, 2, 3])
    assert sa.lookup(2, 3) == ([4, 5], 3)
    assert sa.lookup(2) == ([4, 5], 3)
    assert sa.lookup(4, 1) == ([4, 5, 1, 2], 1)        # "3" first occurred at position 2
    assert SuffixAutomaton([7, 8, 9]).lookup(3) == ([], 0)
    assert SuffixAutomaton([]).lookup(3) == ([], 0)
    assert SuffixAutomaton([5]).lookup(3) == ([], 0)
    # Overlapping occurrences: the earliest "1 1" ends at position 1, followed by the rest.
    assert SuffixAutomaton([1, 1, 1, 1]).lookup(5) == ([1], 3)
    assert SuffixAutomaton([1, 1, 1, 1]).lookup(5, 2) == ([1, 1], 2)
    # periodic: the occurrence ends 1 (2) before the newest token; its tail repeats.
    assert SuffixAutomaton([1, 1, 1, 1]).lookup(5, periodic=True) == ([1] * 5, 3)
    assert SuffixAutomaton([4, 5, 4, 5, 4]).lookup(5, periodic=True) == ([5, 4, 5, 4, 5], 3)
    assert SuffixAutomaton([1, 2, 3, 4, 5, 1, 2, 3]).lookup(2, 3, periodic=True) == ([4, 5], 3)
    assert SuffixAutomaton([1, 2, 3, 4, 5, 1, 2, 3]).lookup(7, periodic=True) == (
        [4, 5, 1, 2, 3, 4, 5], 3)
    # A shorter suffix can have occurred earlier than the longer one.
    sa = SuffixAutomaton([3, 9, 0, 3, 9, 5, 0, 3])
    assert sa.lookup(3) == ([9, 5, 0], 2)              # "0 3" at 2..3, then 9 5 0
    assert sa.lookup(3, 1) == ([9, 0, 3], 1)           # "3" at 0, then 9 0 3


@pytest.mark.parametrize("vocab", [2, 3, 5])
def test_matches_brute_force_on_random_sequences(vocab):
    """Thousands of random sequences, built in random chunks (the lookup after each chunk),
    both lookup modes and several draft lengths."""
    rng = np.random.default_rng(vocab)
    checked = 0
    for _ in range(300):
        sa, tokens = SuffixAutomaton(), []
        for _ in range(rng.integers(1, 6)):
            chunk = rng.integers(0, vocab, size=rng.integers(0, 9)).tolist()
            sa.extend(chunk)
            tokens += chunk
            for n in (-1, 1, 2, 3, 5):
                D = int(rng.integers(0, 6))
                assert sa.lookup(D, n) == brute_force(tokens, D, n), (tokens, D, n)
                checked += 1
    assert checked > 3000


def test_repetitive_text_matches_long_spans():
    text = list(range(40)) + [99] + list(range(30))   # a long span repeated once
    sa = SuffixAutomaton(text)
    assert sa.lookup(4) == ([30, 31, 32, 33], 30)
    assert sa.lookup(4, 3) == ([30, 31, 32, 33], 3)
    assert len(sa) == len(text)
