"""Structured output on the host: each constrained request's grammar matcher, and the token
bitmasks the steps apply (`specjax.core.logits.apply_token_mask`).

The grammar engine is llguidance (PyPI `llguidance`: one self-contained wheel, no torch): it
compiles JSON schemas, regular expressions and Lark grammars lazily against the tokenizer,
computes a position's mask in tens of microseconds, and rolls back -- which is what checking
drafts needs. A mask is one bit per vocabulary entry, packed in int32 words (bit `t % 32` of
word `t // 32`), exactly the layout a step takes as `StepBatch.token_mask`.

Per generation step, for a constrained row verifying drafts d_1..d_k the host writes k + 1
masks: row j is the grammar's mask after the committed output plus d_1..d_j. Masks are
computed only as far as the drafts obey the grammar; the first forbidden draft ends them
(later rows stay all ones), and the step cuts the row's drafts there (`clip_to_mask`).
The matcher advances only on tokens that were emitted (`Grammar.advance`), so nothing needs
undoing after acceptance: llguidance computes the draft masks by consuming the drafts and
rolling back to the committed prefix (`fill_next_token_bitmask_par_with_draft_tokens`).
Where the grammar forces the next tokens (`Grammar.forced`), they replace a drafter's drafts
that disagree (drafters know nothing of the grammar): the executor writes them into the row
(`StepBatch.host_runs`) and the step verifies them by strict matching.

JSON schemas compile with fixed separators (", " and ": ", as `json.dumps` writes them) and no
free whitespace: a model may not pad the output with whitespace forever, and greedy output is
deterministic.
"""
from __future__ import annotations

import functools
import json
from typing import Sequence

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from specjax.tokenizer import Tokenizer
from specjax.validation import InvalidArgument

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}


def check_guided(grammars: Grammars | None, params) -> None:
    """A request's structured-output constraint compiles here, or InvalidArgument naming its
    field (before any work starts: the engine and the server both call this)."""
    if params.guided is None:
        return
    if grammars is None:
        raise InvalidArgument(params.guided, f"{params.guided} needs the model's tokenizer: "
                                             "this engine was built without one")
    grammars.check(params)


def mask_width(vocab_size: int) -> int:
    """int32 words per position's mask."""
    return (vocab_size + 31) // 32


def grammar_source(params) -> tuple[str, str] | None:
    """(field, llguidance grammar text) of a request's constraint; None if it has none."""
    field = params.guided
    if field is None:
        return None
    value = getattr(params, field)
    G = llguidance.LLMatcher
    if field == "guided_json":
        schema = ANY_JSON_OBJECT if value is True else value
        try:
            return field, G.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except Exception as e:  # not JSON, or not a schema llguidance reads
            raise InvalidArgument(field, f"guided_json: {e}") from None
    if field == "guided_regex":
        return field, G.grammar_from_regex(value)
    if field == "guided_choice":
        # Lark string literals take JSON's escapes, so any text is one literal.
        return field, G.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    return field, G.grammar_from_lark(value)


class Grammar:
    """One request's matcher: the grammar state after its committed output."""

    def __init__(self, matcher):
        self.matcher = matcher

    def advance(self, token: int) -> bool:
        """Consume an emitted token; False if the grammar forbids it (a bug upstream: masks
        forbid every such token)."""
        return self.matcher.consume_token(int(token))

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (the bytes it admits one way only, as
        llguidance tokenises them): drafts that verification accepts unless the target
        spells the same text otherwise."""
        return self.matcher.compute_ff_tokens()[:limit] if limit > 0 else []

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (at most EOS)."""
        return self.matcher.is_stopped()

    def error(self) -> str:
        return self.matcher.get_error()


class Grammars:
    """An engine's grammar compiler: the tokenizer as llguidance sees it, compiled grammars
    (cached by their source), the matchers requests get, and the per-step masks."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        # Without EOS ids in the model's config, llguidance takes the tokenizer's own.
        eos = list(eos_token_ids) or None
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                eos_token=eos)
        self.executor = llguidance.LLExecutor()
        # Per engine (a cache on the class would keep every engine's tokenizer alive).
        self._compiled = functools.lru_cache(maxsize=256)(self._compile)

    def _compile(self, field: str, source: str) -> str:
        error = llguidance.LLMatcher.validate_grammar(source, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise InvalidArgument(field, f"{field} cannot be compiled: {error.strip()}"[:600])
        return source

    def check(self, params) -> None:
        """Raise InvalidArgument naming the field if the request's constraint does not
        compile (before any work starts)."""
        source = grammar_source(params)
        if source is not None:
            self._compiled(*source)

    def matcher(self, params) -> Grammar | None:
        source = grammar_source(params)
        if source is None:
            return None
        matcher = llguidance.LLMatcher(self.tokenizer, self._compiled(*source), log_level=0)
        if matcher.is_error():
            raise InvalidArgument(source[0], f"{source[0]}: {matcher.get_error()}"[:600])
        return Grammar(matcher)

    def fill(self, masks: np.ndarray, rows: Sequence[tuple[int, Grammar, Sequence[int]]]
             ) -> None:
        """masks `[B, R, W]` int32 (all ones on entry): for each (row, grammar, drafts), rows
        0..k of `masks[row]` become the grammar's masks after the first 0..k drafts, k the
        number of drafts it accepts in a row (at most R - 1). One parallel call."""
        if not rows:
            return
        B, R, W = masks.shape
        flat = masks.reshape(B * R, W)  # a view: masks is C-contiguous
        drafted = [(g.matcher, row * R, [int(t) for t in drafts[:R - 1]])
                   for row, g, drafts in rows if len(drafts) and R > 1]
        plain = [(g.matcher, row * R) for row, g, drafts in rows if not (len(drafts) and R > 1)]
        if drafted:
            llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(self.executor, drafted, flat)
        if plain:
            llg_numpy.fill_next_token_bitmask_par(self.executor, plain, flat)

    def fill_tree(self, masks: np.ndarray, row: int, grammar: Grammar, tokens: Sequence[int],
                  parents: Sequence[int]) -> None:
        """A tree's masks: run row 0 is the root (the committed output), row i + 1 node i with
        token `tokens[i]` and parent row `parents[i]` (0: the root). A node's row gets the
        mask after the tokens on its path; a node the grammar forbids, and its subtree, keep
        all ones (acceptance never reaches them: the target's masked token is never theirs)."""
        m, out = grammar.matcher, masks[row]
        m.unsafe_compute_mask_ptr(out[0].ctypes.data, out[0].nbytes)
        paths: dict[int, list[int] | None] = {0: []}
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            base = paths.get(int(parent))
            path = None if base is None else base + [int(token)]
            if path is not None and i + 1 < out.shape[0]:
                consumed = m.try_consume_tokens(path)
                if consumed == len(path):
                    m.unsafe_compute_mask_ptr(out[i + 1].ctypes.data, out[i + 1].nbytes)
                else:
                    path = None
                m.rollback(consumed)
            paths[i + 1] = path
