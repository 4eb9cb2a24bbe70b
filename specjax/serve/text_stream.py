"""Token ids -> text deltas for streaming, such that the deltas add up to the final text.

Decoding is incremental: each event feeds only the ids not seen before to a
`tokenizers.decoders.DecodeStream` (as `specjax/engine/output.py` does), so a stream costs time
linear in its length, not a re-decode of the whole output per event.

Two things could make an early delta wrong later, and both are held back until they resolve:
a multi-byte character split across tokens (`DecodeStream` yields nothing until its last byte
arrives) and the start of a stop string (the engine cuts the final text where a stop string
begins). Held-back text is only ever a suffix that could start a stop string, so it stays
short. At the finish the engine's final text is authoritative: the last delta is whatever of
it the client has not been sent.

Which tokens a chunk reports (their logprobs): token i starts at the number of characters
decoded before its piece (a token holding part of a character has an empty piece; the one that
completes the character carries it). A token is reported once the client has been sent text
beyond its start; at the finish every token not yet reported is, except when a stop string cut
the text: then only those that start before the cut (the tokens that completed the stop string,
or came after it in the same step, have no text in the choice and are not reported). The same
rule serves a whole response (one delta at the finish), so the tokens reported over a stream
are exactly those of the non-streamed response.
"""
from __future__ import annotations

import bisect
import os
from typing import Any, Protocol, Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"   # what a split character decodes to on its own: never sent


class StepDecoder(Protocol):
    def step(self, tokenizer: Any, token_id: int) -> str | None: ...


class PieceDecoder:
    """For a tokenizer without a `tokenizers` backend (test doubles, piece-per-token
    vocabularies): each id decodes on its own."""

    def step(self, tokenizer: Any, token_id: int) -> str | None:
        return tokenizer.decode([token_id]) or None


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class TextStream:
    """Feed the engine's cumulative outputs; get the text not sent yet."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()):
        self.stops = tuple(stops)
        backend = getattr(tokenizer, "backend", None)
        if isinstance(backend, tokenizers.Tokenizer):
            self._decoder: StepDecoder = DecodeStream(skip_special_tokens=True)
            self._source: Any = backend
        else:
            self._decoder, self._source = PieceDecoder(), tokenizer
        self._fed = 0              # ids of the output given to the decoder so far
        self._parts: list[str] = []  # what was sent, joined only when asked for
        self._held = ""            # decoded and not sent: a possible stop string's start
        self._starts: list[int] = []  # per token fed: characters decoded before its piece
        self._decoded = 0          # characters decoded so far
        self._reportable = 0       # tokens whose logprobs may be sent (see the module doc)

    @property
    def sent(self) -> str:
        return "".join(self._parts)

    def delta(self, token_ids: Sequence[int], finished: bool, final_text: str | None = None) -> str:
        """New text for the output so far (`token_ids` is cumulative); `final_text` (the
        engine's, stop strings cut) wins once the request has finished."""
        return self.delta_after(token_ids[self._fed:], finished, final_text)

    @property
    def fed(self) -> int:
        """Tokens of the output given to the decoder so far."""
        return self._fed

    def delta_after(self, new_ids: Sequence[int], finished: bool,
                    final_text: str | None = None) -> str:
        """`delta` given only the ids after the `fed` ones (a long output is not copied per
        event)."""
        for token in new_ids:
            self._starts.append(self._decoded)
            piece = self._decoder.step(self._source, token)
            if piece:
                self._held += piece
                self._decoded += len(piece)
        self._fed += len(new_ids)
        if finished and final_text is not None:
            return self._finish(final_text)
        # Only the held text can start a stop string: a longer candidate reaching into sent
        # text would have been held back when that text was sent.
        keep = 0 if finished else stop_prefix_len(self._held, self.stops)
        new, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        if new:
            self._parts.append(new)
        self._reportable = (len(self._starts) if finished else
                            bisect.bisect_left(self._starts, self._decoded - len(self._held)))
        return new

    @property
    def reportable(self) -> int:
        """How many of the tokens fed may be reported after the last `delta`: a count that
        never falls (module doc)."""
        return self._reportable

    def start(self, i: int) -> int:
        """Token i's character offset in the text."""
        return self._starts[i]

    def _finish(self, final_text: str) -> str:
        sent = self.sent
        common = len(sent) if final_text.startswith(sent) else \
            len(os.path.commonprefix([sent, final_text]))
        # A mismatch cannot happen with byte-level decoders; never resend what the client has.
        new = final_text[common:]
        self._parts, self._held = [sent, new], ""
        cut = len(final_text) < self._decoded   # a stop string cut the decoded text
        self._reportable = max(self._reportable, bisect.bisect_left(self._starts, len(final_text))
                               if cut else len(self._starts))
        return new
