"""The suffix automaton SA drafting is defined by (the host reference; semantics.md, "SA").

Built online over a request's tokens (prompt, then accepted tokens): `extend(tokens)` costs
amortised O(1) per token. Each state keeps the end position of its strings' FIRST occurrence,
so a lookup names the earliest place the matched suffix occurred:

- `lookup(D)` (max_matching_ngram_size = -1): the longest suffix of the sequence that also
  occurs earlier (an occurrence ending before the last token); the draft is up to D tokens that
  followed its earliest occurrence.
- `lookup(D, N)` (N > 0): suffix lengths N, N-1, ..., 1; the first that occurred earlier wins,
  again at its earliest occurrence.
- no match: an empty draft and match length 0.

Along the suffix-link chain from the whole sequence's state, first occurrences only move
earlier as suffixes get shorter, so the suffixes that occurred earlier are exactly the lengths
1..M for the first state on the chain that occurred before the end: M is the `-1` match, and
min(N, M) the fixed-size one.
"""
from __future__ import annotations

from typing import Iterable


class SuffixAutomaton:
    def __init__(self, tokens: Iterable[int] = ()):
        self.tokens: list[int] = []
        self._len = [0]        # longest string of each state
        self._link = [-1]      # suffix link
        self._next: list[dict[int, int]] = [{}]
        self._first = [-1]     # end position of the first occurrence of the state's strings
        self._last = 0         # the state of the whole sequence
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self._add(int(token))

    def _new_state(self, length: int, link: int, nxt: dict[int, int], first: int) -> int:
        self._len.append(length)
        self._link.append(link)
        self._next.append(nxt)
        self._first.append(first)
        return len(self._len) - 1

    def _add(self, token: int) -> None:
        pos = len(self.tokens)
        self.tokens.append(token)
        cur = self._new_state(self._len[self._last] + 1, -1, {}, pos)
        p = self._last
        while p != -1 and token not in self._next[p]:
            self._next[p][token] = cur
            p = self._link[p]
        if p == -1:
            self._link[cur] = 0
        else:
            q = self._next[p][token]
            if self._len[p] + 1 == self._len[q]:
                self._link[cur] = q
            else:  # split q: the clone keeps q's first occurrence (it has q's end positions)
                clone = self._new_state(self._len[p] + 1, self._link[q], dict(self._next[q]),
                                        self._first[q])
                while p != -1 and self._next[p].get(token) == q:
                    self._next[p][token] = clone
                    p = self._link[p]
                self._link[q] = self._link[cur] = clone
        self._last = cur

    def lookup(self, max_draft_len: int, max_matching_ngram_size: int = -1,
               periodic: bool = False) -> tuple[list[int], int]:
        """-> (draft: up to `max_draft_len` tokens after the earliest earlier occurrence of the
        matched suffix, match length); ([], 0) when no suffix occurred earlier.

        `periodic` (what the device matcher drafts): an occurrence ending p tokens before the
        newest one has only p tokens after it; the draft then repeats them to its full
        length, continuing the sequence with period p (a loop or a repeated row, whose next
        tokens the reference would leave undrafted)."""
        n = len(self.tokens)
        end = n - 1
        state = self._last
        while state > 0 and self._first[state] >= end:  # occurs only at the very end
            state = self._link[state]
        if state <= 0:
            return [], 0
        match = self._len[state]
        if max_matching_ngram_size > 0 and max_matching_ngram_size < match:
            match = max_matching_ngram_size
            while self._len[self._link[state]] >= match:  # the state holding that length
                state = self._link[state]
        start = self._first[state] + 1
        if periodic:
            period = n - start
            return [self.tokens[start + k % period] for k in range(max(max_draft_len, 0))], match
        return self.tokens[start:start + max(max_draft_len, 0)], match
