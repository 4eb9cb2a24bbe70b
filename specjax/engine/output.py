"""From a step's tokens to a request's output: stop conditions and text.

Tokens are appended one at a time and the first stop condition ends the request -- a
structured-output grammar that is complete, EOS (unless `ignore_eos`), a stop token id, a stop string, the length limit; the rest of an accepted run
is dropped with the request's blocks. Stop strings are looked for in text decoded
incrementally (`tokenizers`' streaming decoder), only where a new piece could complete one, so
a request costs time linear in its length however long it runs.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np
from tokenizers.decoders import DecodeStream

from specjax.engine.request import Request
from specjax.engine.stats import EngineStats
from specjax.tokenizer import Tokenizer


@dataclasses.dataclass
class _StopScan:
    """A request's output decoded token by token, and the characters a stop string completed
    by the next piece could start in."""

    stream: DecodeStream
    pieces: list[str] = dataclasses.field(default_factory=list)
    tail: str = ""       # the last (longest stop - 1) characters decoded
    cut: bool = False    # a stop string was found: `request.text` ends before it


def logprob_entries(logprobs, row: int, tokens: Sequence[int], k: int, start: int = 0
                    ) -> list[dict[int, float]]:
    """{token id: logprob} for `tokens`, at positions start, start + 1, ... of `row` of a
    step's `Logprobs` (`[B]` outputs have the one position 0): the top k, most probable
    first, then the token itself if it is not among them."""
    chosen = np.asarray(logprobs.chosen)[row].reshape(-1)
    top_ids = np.asarray(logprobs.top_ids)[row].reshape(chosen.size, -1)
    top = np.asarray(logprobs.top)[row].reshape(chosen.size, -1)
    entries = []
    for j, token in enumerate(tokens, start):
        entry = {int(t): float(v) for t, v in zip(top_ids[j, :k], top[j, :k]) if t >= 0}
        entry.setdefault(int(token), float(chosen[j]))
        entries.append(entry)
    return entries


class OutputProcessor:
    def __init__(self, eos_token_ids: Sequence[int], tokenizer: Tokenizer | None,
                 stats: EngineStats):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.stats = stats
        self._scans: dict[int, _StopScan] = {}

    def append(self, request: Request, tokens: Sequence[int],
               logprobs: Sequence[dict[int, float]] | None = None) -> str | None:
        """Append a step's tokens (and, where the request asked for them, their
        `logprobs` entries); returns the finish reason ("stop", "length") if one of them ends
        the request, else None. A stop string cuts `request.text` before it."""
        stats = request.stats
        stats.decoding_iterations += 1
        if stats.first_token_time is None:
            stats.first_token_time = time.perf_counter()
        p = request.params
        if request.grammar is None and request.logprobs is None and not (
                p.stop and self.tokenizer is not None):
            return self._append_plain(request, tokens)
        for i, token in enumerate(tokens):
            request.output_ids.append(token)
            if request.logprobs is not None:
                request.logprobs.append(logprobs[i])
            stats.num_generated_tokens += 1
            self.stats.num_generated_tokens += 1
            grammar = request.grammar
            if grammar is not None:
                if not grammar.advance(token):
                    raise RuntimeError(f"token {token} breaks the request's grammar: "
                                       f"{grammar.error()}")
                if grammar.done:  # nothing more may follow (at most EOS): the output is whole
                    return "stop"
            if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
                return "stop"
            if p.stop and self.tokenizer is not None and self._stop_string(request, token):
                return "stop"
            if request.num_tokens >= request.max_len:
                return "length"
        return None

    def _append_plain(self, request: Request, tokens: Sequence[int]) -> str | None:
        """`append` for a request without grammar, logprobs or stop strings (the common one),
        on the whole run at once: the same tokens kept and the same finish reason as token by
        token -- a stop token ends the run where it is, else the length limit where it falls."""
        p = request.params
        end, reason = len(tokens), None
        stops = (p.stop_token_ids if p.ignore_eos else
                 self.eos_token_ids.union(p.stop_token_ids) if p.stop_token_ids else
                 self.eos_token_ids)
        if stops:
            for i, token in enumerate(tokens):
                if token in stops:
                    end, reason = i + 1, "stop"
                    break
        room = max(1, request.max_len - request.num_tokens)
        if room <= end:
            end, reason = room, "stop" if reason is not None and room == end else "length"
        request.output_ids.extend(tokens[:end])
        request.stats.num_generated_tokens += end
        self.stats.num_generated_tokens += end
        return reason

    def _stop_string(self, request: Request, token: int) -> bool:
        scan = self._scans.get(request.request_id)
        if scan is None:
            scan = self._scans[request.request_id] = _StopScan(
                DecodeStream(skip_special_tokens=True))
        piece = scan.stream.step(self.tokenizer.backend, token)
        if not piece:  # a character still incomplete
            return False
        scan.pieces.append(piece)
        # No stop string lies wholly in earlier text (it would have been found then), so the
        # first one to appear ends in this piece and starts in the tail before it.
        window = scan.tail + piece
        hits = [i for i in (window.find(s) for s in request.params.stop) if i >= 0]
        if hits:
            text = "".join(scan.pieces)
            request.text = text[:len(text) - len(window) + min(hits)]
            scan.cut = True
            return True
        keep = max(map(len, request.params.stop)) - 1
        scan.tail = window[-keep:] if keep else ""
        return False

    def finish(self, request: Request) -> None:
        """The request is over: unless a stop string cut it, its text is the whole output
        decoded once."""
        scan = self._scans.pop(request.request_id, None)
        if self.tokenizer is not None and not (scan is not None and scan.cut):
            request.text = self.tokenizer.decode(request.output_ids)
