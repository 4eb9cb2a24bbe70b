"""TensorRT-LLM's n-gram drafter: continuations of recent n-grams, kept in a pool."""
from __future__ import annotations

from typing import Sequence

from specjax.speculative.drafters.base import Drafter


class NGramDrafter(Drafter):
    """TensorRT-LLM's n-gram pool: continuations seen after each recent pattern of 1..M tokens.

    The pool maps a pattern (tuple of 1..M tokens) to an ordered set of continuations (tuples
    of up to D tokens). `is_public_pool` shares one pool across requests; otherwise each request
    has its own, dropped when it finishes. Lookup tries the longest suffix first and returns the
    oldest (`is_use_oldest`) or newest continuation of the first pattern found.
    """

    def __init__(self, max_draft_len: int, max_matching_ngram_size: int = 2,
                 is_keep_all: bool = True, is_use_oldest: bool = True,
                 is_public_pool: bool = True, max_sequence_length: int | None = None):
        self.max_draft_len = max_draft_len
        self.max_matching_ngram_size = max_matching_ngram_size
        self.is_keep_all = is_keep_all
        self.is_use_oldest = is_use_oldest
        self.is_public_pool = is_public_pool
        self.max_sequence_length = max_sequence_length
        self._public: dict[tuple[int, ...], dict[tuple[int, ...], None]] = {}
        self._pools: dict[int, dict] = {}
        self._start: dict[int, int] = {}

    def pool(self, request_id: int) -> dict[tuple[int, ...], dict[tuple[int, ...], None]]:
        """The pattern -> continuations map (dicts keep insertion order: an ordered set)."""
        return self._public if self.is_public_pool else self._pools.setdefault(request_id, {})

    def propose(self, token_ids: Sequence[int], max_draft_len: int) -> list[int]:
        # Without a request id nothing remembers what was indexed: each call indexes the whole
        # sequence again (into the shared pool with is_public_pool). `propose_for` is linear.
        proposal = self.propose_for(-1, token_ids, max_draft_len)
        self.on_request_finished(-1)
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
        proposal: list[int] = []
        for size in range(min(self.max_matching_ngram_size, len(tokens) - 1), 0, -1):
            continuations = pool.get(tuple(tokens[-size:]))
            if continuations:
                chosen = next(iter(continuations)) if self.is_use_oldest else next(reversed(continuations))
                proposal = list(chosen[:budget])
                break
        d, m = self.max_draft_len, self.max_matching_ngram_size
        self._start[request_id] = max(0, len(tokens) - (d + m - 1))  # index only new windows next
        return proposal

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
