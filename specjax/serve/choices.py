"""One choice of a response: the engine's cumulative outputs -> text and reported tokens.

A `ChoiceStream` is fed a choice's outputs (every one when streaming, only the final one
otherwise) and returns, per output, the text not sent yet and the tokens whose logprobs go
with it (`text_stream.py` says which). Both paths run this same code, so a stream's deltas and
logprob entries add up to exactly the non-streamed choice.

With `echo`, the first delta starts with the prompt's text, and the prompt's tokens (with the
engine's `prompt_logprobs`; the first prompt token has no logprob) come before the generated
ones; offsets of generated tokens then count from the start of the prompt text.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from specjax.engine.request import RequestOutput
from specjax.serve.logprobs import TokenLogprob, token_logprob
from specjax.serve.text_stream import TextStream


@dataclasses.dataclass(frozen=True)
class Echo:
    """A prompt to echo: its text, and each prompt token's character offset in it."""

    text: str
    offsets: tuple[int, ...]


def prompt_offsets(tokenizer: Any, prompt_ids: Sequence[int], text: str) -> tuple[int, ...]:
    """Each prompt token's offset in `text`, decoded the way outputs are (at most len(text):
    a prompt given as text need not decode back to exactly itself)."""
    stream = TextStream(tokenizer)
    stream.delta(prompt_ids, False)
    return tuple(min(stream.start(i), len(text)) for i in range(len(prompt_ids)))


class ChoiceStream:
    def __init__(self, index: int, tokenizer: Any, stops: Sequence[str], logprobs: bool,
                 echo: Echo | None = None):
        self.index = index
        self.text = TextStream(tokenizer, stops)
        self.logprobs = logprobs
        self.echo = echo
        self._started = False
        self._reported = 0
        self.final: RequestOutput | None = None

    @property
    def shift(self) -> int:
        return len(self.echo.text) if self.echo is not None else 0

    def update(self, out: RequestOutput) -> tuple[str, list[TokenLogprob] | None]:
        """The text and the tokens this output adds (None: logprobs were not asked for)."""
        delta = self.text.delta_after(out.token_ids_from(self.text.fed), out.finished, out.text)
        entries: list[TokenLogprob] | None = [] if self.logprobs else None
        if not self._started:
            self._started = True
            if self.echo is not None:
                delta = self.echo.text + delta
                if entries is not None:
                    entries.extend(self._prompt_entries(out))
        upto = self.text.reportable
        if entries is not None:
            lps = out.logprobs or ()
            shift = self.shift
            ids = out.token_ids_from(self._reported)
            for i in range(self._reported, upto):
                entries.append(token_logprob(ids[i - self._reported],
                                             lps[i] if i < len(lps) else None,
                                             self.text.start(i) + shift))
        self._reported = upto
        if out.finished:
            self.final = out
        return delta, entries

    def _prompt_entries(self, out: RequestOutput) -> list[TokenLogprob]:
        lps = out.prompt_logprobs or ()
        ids = out.prompt_token_ids
        offsets = self.echo.offsets
        return [token_logprob(t, lps[i] if i < len(lps) else None,
                              offsets[i] if i < len(offsets) else len(self.echo.text))
                for i, t in enumerate(ids)]
