"""TensorRT-LLM's n-gram drafter: continuations of recent n-grams, kept in a pool."""
from __future__ import annotations

from typing import Sequence

from specjax.speculative.drafters.base import Drafter


AD_HOC = -1   # the request id of `propose` calls, which name none


class NGramDrafter(Drafter):
    """TensorRT-LLM's n-gram pool: continuations seen after each recent pattern of 1..M tokens.

    The pool maps a pattern (tuple of 1..M tokens) to an ordered set of continuations (tuples
    of up to D tokens). `is_public_pool` shares one pool across requests; otherwise each request
    has its own, dropped when it finishes. Lookup tries the longest suffix first and returns the
    oldest (`is_use_oldest`) or newest continuation of the first pattern found.

    Evidence (off by default, the reference's behaviour): `min_matching_ngram_size` -- no
    proposal from a suffix match shorter than this; `min_followed_ratio` -- no proposal whose
    first token followed the matched pattern at fewer than this share of the pattern's
    earlier occurrences (the pool's own counts, each position counted once). A guess the
    context hardly supports costs a verify step and rarely pays it back: in open chat most
    short matches are such guesses, while text the answer copies matches long and one way.
    """

    def __init__(self, max_draft_len: int, max_matching_ngram_size: int = 2,
                 is_keep_all: bool = True, is_use_oldest: bool = True,
                 is_public_pool: bool = True, max_sequence_length: int | None = None,
                 min_matching_ngram_size: int = 1, min_followed_ratio: float = 0.0):
        self.max_draft_len = max_draft_len
        self.max_matching_ngram_size = max_matching_ngram_size
        self.is_keep_all = is_keep_all
        self.is_use_oldest = is_use_oldest
        self.is_public_pool = is_public_pool
        self.max_sequence_length = max_sequence_length
        self.min_matching_ngram_size = min_matching_ngram_size
        self.min_followed_ratio = min_followed_ratio
        self._public: dict[tuple[int, ...], dict[tuple[int, ...], None]] = {}
        self._pools: dict[int, dict] = {}
        self._start: dict[int, int] = {}
        # pattern -> {next token: times it followed}, each (position, size) counted once.
        self._public_counts: dict[tuple[int, ...], dict[int, int]] = {}
        self._counts: dict[int, dict] = {}
        self._counted: dict[int, int] = {}   # request -> tokens whose followers are counted
        self.last_match: tuple[int, int, int] = (0, 0, 0)  # (size, followed, occurrences)

    def pool(self, request_id: int) -> dict[tuple[int, ...], dict[tuple[int, ...], None]]:
        """The pattern -> continuations map (dicts keep insertion order: an ordered set)."""
        return self._public if self.is_public_pool else self._pools.setdefault(request_id, {})

    def propose(self, token_ids: Sequence[int], max_draft_len: int) -> list[int]:
        # Without a request id nothing remembers what was indexed: each call indexes the whole
        # sequence again (into the shared pool with is_public_pool; its follower counts stay
        # the call's own, since counting the same positions again would inflate them).
        # `propose_for` is linear.
        proposal = self.propose_for(AD_HOC, token_ids, max_draft_len)
        self.on_request_finished(AD_HOC)
        return proposal

    def propose_for(self, request_id: int, token_ids: Sequence[int], max_draft_len: int) -> list[int]:
        tokens = list(token_ids)
        budget = min(max_draft_len, self.max_draft_len)
        if self.max_sequence_length is not None:
            budget = min(budget, self.max_sequence_length - 1 - len(tokens))
        if budget <= 0:
            return []
        pool = self.pool(request_id)
        self._update(pool, tokens, self._start.get(request_id, 0))
        counts = self._count(request_id, tokens)
        proposal: list[int] = []
        self.last_match = (0, 0, 0)
        for size in range(min(self.max_matching_ngram_size, len(tokens) - 1), 0, -1):
            pattern = tuple(tokens[-size:])
            continuations = pool.get(pattern)
            if continuations:
                chosen = next(iter(continuations)) if self.is_use_oldest else next(reversed(continuations))
                followers = counts.get(pattern, {})
                self.last_match = (size, followers.get(chosen[0], 0), sum(followers.values()))
                if self._supported(*self.last_match):
                    proposal = list(chosen[:budget])
                break
        d, m = self.max_draft_len, self.max_matching_ngram_size
        self._start[request_id] = max(0, len(tokens) - (d + m - 1))  # index only new windows next
        return proposal

    def may_propose(self, request_id: int, token_ids: Sequence[int]) -> bool:
        """With evidence asked for: whether the tokens known so far already have a proposal
        -- text being copied goes on matching, so the next position likely does too, and a
        copied span is found one token late at worst. Without, always (the reference
        proposes on nearly any match)."""
        if self.min_matching_ngram_size <= 1 and self.min_followed_ratio <= 0:
            return True
        return bool(self.propose_for(request_id, token_ids, self.max_draft_len))

    def _supported(self, size: int, followed: int, occurrences: int) -> bool:
        """Whether a match of `size` tokens whose proposed first token followed it `followed`
        of `occurrences` times is evidence enough to propose."""
        return (size >= self.min_matching_ngram_size
                and followed >= self.min_followed_ratio * occurrences)

    def _count(self, request_id: int, tokens: list[int]) -> dict:
        """The follower counts, updated with this request's tokens not counted yet (only
        kept when evidence is asked for: the reference's pool has no counts)."""
        counts = (self._public_counts if self.is_public_pool and request_id != AD_HOC
                  else self._counts.setdefault(request_id, {}))
        if self.min_followed_ratio <= 0:
            return counts
        M = self.max_matching_ngram_size
        for j in range(max(1, self._counted.get(request_id, 0)), len(tokens)):
            for size in range(1, min(M, j) + 1):
                followers = counts.setdefault(tuple(tokens[j - size:j]), {})
                followers[tokens[j]] = followers.get(tokens[j], 0) + 1
        self._counted[request_id] = len(tokens)
        return counts

    def _update(self, pool, tokens: list[int], start: int) -> None:
        n = len(tokens)
        for size in range(min(self.max_matching_ngram_size, n - 1), 0, -1):
            for pos in range(start, n - size):
                pattern = tuple(tokens[pos:pos + size])
                continuation = tuple(tokens[pos + size:pos + size + self.max_draft_len])
                stored = pool.get(pattern)
                # Stored continuations stay ordered longest first, so the first is the longest.
                if stored is None or (not self.is_keep_all
                                      and len(continuation) > len(next(iter(stored)))):
                    pool[pattern] = {continuation: None}
                elif continuation not in stored:
                    for old in [c for c in stored if len(c) < len(continuation)]:
                        del stored[old]
                    stored[continuation] = None

    def on_request_finished(self, request_id: int) -> None:
        self._start.pop(request_id, None)
        self._pools.pop(request_id, None)
        self._counts.pop(request_id, None)
        self._counted.pop(request_id, None)
