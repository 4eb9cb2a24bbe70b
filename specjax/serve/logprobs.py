"""Log-probabilities in OpenAI's two shapes, and the text of single tokens they are keyed by.

The engine reports, per token, a {token id: logprob} dict: the top k in descending order, then
the chosen token if it is not among them (vLLM's convention); a prompt's first token has none.
`TokenLogprob` is one reported token, independent of the endpoint; `completion_logprobs` and
`chat_logprobs` shape a list of them:

- /v1/completions (`logprobs: k`): {"tokens", "token_logprobs", "top_logprobs", "text_offset"},
  `top_logprobs` one {token text: logprob} dict per token holding the engine's whole dict (top k
  plus the chosen token), `text_offset` the character offset of the token in the choice's text;
- /v1/chat/completions (`logprobs: true, top_logprobs: k`): {"content": [{"token", "logprob",
  "bytes", "top_logprobs": [the first k entries]}]}.

A token's text is its bytes decoded as UTF-8; a token that holds only part of a character
(byte-level BPE splits them) is written "bytes:\\xe4\\xb8" as OpenAI does, its `bytes` exact.
Logprobs that are not finite (-inf for a token the model rules out) are sent as -9999.0, as
vLLM does: JSON has no infinity.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

import tokenizers
from tokenizers import decoders

MIN_LOGPROB = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")    # SentencePiece byte fallback


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One reported token: its id, its logprob (None: a prompt's first token), the engine's
    {id: logprob} entries in the engine's order (None with no logprob), and the character
    offset of its text in the choice's text."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None
    offset: int


def token_logprob(token: int, entries: dict[int, float] | None, offset: int) -> TokenLogprob:
    if entries is None:
        return TokenLogprob(token, None, None, offset)
    return TokenLogprob(token, entries.get(token), tuple(entries.items()), offset)


def finite(logprob: float | None) -> float | None:
    if logprob is None:
        return None
    logprob = float(logprob)
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies spell
    their tokens with)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


class TokenTexts:
    """Token id -> (text, bytes), cached (at most one entry per vocabulary id)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend", None)
        self._backend = backend if isinstance(backend, tokenizers.Tokenizer) else None
        self._byte_level = False
        self._special: set[int] = set()
        if self._backend is not None:
            self._byte_level = isinstance(self._backend.decoder, decoders.ByteLevel)
            self._special = {i for i, t in self._backend.get_added_tokens_decoder().items()
                             if t.special}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _bytes(self, token: int) -> bytes:
        if self._backend is None:
            return self.tokenizer.decode([token]).encode("utf-8")
        piece = self._backend.id_to_token(token)
        if piece is None:
            return b""
        if token in self._special:
            return piece.encode("utf-8")
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        byte = _BYTE_TOKEN.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        if "\u2581" in piece:   # SentencePiece's word boundary: a space
            return piece.replace("\u2581", " ").encode("utf-8")
        return self._backend.decode([token], skip_special_tokens=False).encode("utf-8")

    def get(self, token: int) -> tuple[str, bytes]:
        hit = self._cache.get(token)
        if hit is None:
            raw = self._bytes(token)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token] = (text, raw)
        return hit

    def text(self, token: int) -> str:
        return self.get(token)[0]


def completion_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts,
                        shift: int = 0) -> dict[str, list]:
    """/v1/completions' logprobs object; `shift` is added to every text offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for e in entries:
        out["tokens"].append(texts.text(e.token))
        out["token_logprobs"].append(finite(e.logprob))
        out["top_logprobs"].append(None if e.top is None else
                                   {texts.text(t): finite(lp) for t, lp in e.top})
        out["text_offset"].append(e.offset + shift)
    return out


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts,
                  top_k: int) -> dict[str, list]:
    """/v1/chat/completions' logprobs object: the first `top_k` of each token's entries (the
    engine's top k; the chosen token, appended when outside them, is not one of them)."""
    content = []
    for e in entries:
        text, raw = texts.get(e.token)
        top = []
        for t, lp in (e.top or ())[:top_k]:
            t_text, t_raw = texts.get(t)
            top.append({"token": t_text, "logprob": finite(lp), "bytes": list(t_raw)})
        content.append({"token": text, "logprob": finite(e.logprob), "bytes": list(raw),
                        "top_logprobs": top})
    return {"content": content}
