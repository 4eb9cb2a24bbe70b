"""llama.cpp's two stops for editors, as its server applies them to a request's text:

- `n_indent`: every line after the first must be indented by at least n spaces or tabs; the
  first line that is not ends the output just before its text (its newline and indentation
  kept, as llama.cpp keeps them);
- `t_max_predict_ms`: once a newline has been generated, the output ends at the first step
  that finds this long passed since its first token.

Both end the engine request early (`Submission.until`, checked on the engine thread as each
step's output is handed over); the output's text is cut there and its finish_reason is
"length" (llama.cpp's stop type "limit").
"""
from __future__ import annotations

import dataclasses
import time

from tokenizers.decoders import DecodeStream

from specjax.engine.request import RequestOutput

INDENT = " \t"


@dataclasses.dataclass(frozen=True)
class LineLimits:
    n_indent: int = 0
    t_max_predict_ms: int = 0

    def start(self, tokenizer) -> "LineCheck | None":
        """One request's check (None: neither limit is on)."""
        return LineCheck(self, tokenizer) if self.n_indent or self.t_max_predict_ms else None


class LineCheck:
    """Fed a request's cumulative outputs; returns the output cut where a limit ends it."""

    def __init__(self, limits: LineLimits, tokenizer):
        self.limits, self.backend = limits, tokenizer.backend
        self.decoder = DecodeStream(skip_special_tokens=True)
        self.text, self.fed = "", 0
        self.line = 0             # where the first line not yet judged may start
        self.had_newline = False  # a newline came in an earlier output

    def __call__(self, out: RequestOutput) -> RequestOutput | None:
        for token in out.token_ids_from(self.fed):
            self.text += self.decoder.step(self.backend, token) or ""
            self.fed += 1
        cut = self._under_indented() if self.limits.n_indent else None
        started = out.stats.first_token_time
        if (cut is None and self.had_newline and self.limits.t_max_predict_ms
                and started is not None
                and (time.perf_counter() - started) * 1e3 > self.limits.t_max_predict_ms):
            cut = len(self.text)
        self.had_newline = self.had_newline or "\n" in self.text
        if cut is None:
            return None
        return dataclasses.replace(out, text=self.text[:cut], finish_reason="length")

    def _under_indented(self) -> int | None:
        """Where the text ends at the first line indented less than n_indent, once that
        line's first other character is in."""
        text = self.text
        while (newline := text.find("\n", self.line)) >= 0:
            start = pos = newline + 1
            while pos < len(text) and text[pos] in INDENT:
                pos += 1
            if pos == len(text):
                return None   # its indentation is not known yet
            if pos - start < self.limits.n_indent:
                return pos
            self.line = start
        return None
