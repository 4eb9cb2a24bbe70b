"""Token ids -> text deltas for streaming, such that the deltas add up to the final text.

Two things could make an early delta wrong later: a multi-byte character split across tokens
(decoded as U+FFFD until its last byte arrives) and the start of a stop string (the engine
cuts the final text where a stop string begins). Both are held back until they resolve.
"""
from __future__ import annotations

from typing import Sequence

from specjax.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


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

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.sent = ""

    def delta(self, token_ids: Sequence[int], finished: bool, final_text: str | None = None) -> str:
        """New text for the output so far; `final_text` (the engine's, stop strings cut) wins
        once the request has finished."""
        if finished and final_text is not None:
            text = final_text
        else:
            text = self.tokenizer.decode(token_ids)
            if not finished:
                text = text.rstrip(REPLACEMENT)
                text = text[:len(text) - stop_prefix_len(text, self.stops)]
        if not text.startswith(self.sent):
            # Cannot happen with byte-level decoders; never resend what the client has.
            common = 0
            while common < min(len(text), len(self.sent)) and text[common] == self.sent[common]:
                common += 1
            text = self.sent + text[common:] if finished else self.sent
        new = text[len(self.sent):]
        self.sent = text
        return new
