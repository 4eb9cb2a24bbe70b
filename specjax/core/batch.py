"""What one jitted step consumes and produces: fixed-shape padded arrays, no Python objects.

Rows are padded to a batch bucket and runs to a fixed width; a padded row has query_len 0, a
block table of null blocks and the spare slot, so it writes only into block 0 and the spare
slot row, and its outputs are ignored. `empty_batch` + `set_row` build a batch on the host (numpy
arrays; jit takes them as they are).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import chex
import jax
import numpy as np
from flax import struct

from specjax.core.kv import NULL_BLOCK
from specjax.core.logits import MAX_LOGIT_BIAS, Logprobs


@struct.dataclass
class StepBatch:
    tokens: jax.Array        # [B, T] int32: each row's run (prompt chunk, or last token + drafts)
    start_pos: jax.Array     # [B] int32: position of tokens[:, 0]
    query_lens: jax.Array    # [B] int32: real tokens in the run (0 = padded row)
    block_tables: jax.Array  # [B, M] int32: the row's KV blocks, padded with the null block
    temperature: jax.Array   # [B] float32 (0 = greedy)
    top_k: jax.Array         # [B] int32 (0 = off)
    top_p: jax.Array         # [B] float32 (1 = off)
    min_p: jax.Array         # [B] float32 (0 = off)
    seeds: jax.Array         # [B] uint32
    slots: jax.Array         # [B] int32: the request's sequence slot (padded rows: the spare)
    max_lens: jax.Array      # [B] int32: prompt + output may not exceed this many tokens
                             # (generation steps verify no drafts past it)
    # [B] int32: the prompt token after a prompt-chunk run (-1: the run ends the prompt). Only
    # hidden-state drafters read it (their row t pairs hidden state t with token t+1).
    next_tokens: jax.Array | None = None
    # (`specjax.core.logits`; None: the step has no such input)
    bias_ids: jax.Array | None = None         # [B, MAX_LOGIT_BIAS] int32 (-1: no entry)
    bias_values: jax.Array | None = None      # [B, MAX_LOGIT_BIAS] float32
    logprobs: jax.Array | None = None         # [B] bool: log-probabilities of emitted tokens
    prompt_logprobs: jax.Array | None = None  # [B] bool: ... of prompt tokens (prefill)
    # [B] float32 (`specjax.core.penalties`; 1, 0, 0: off)
    repetition_penalty: jax.Array | None = None
    frequency_penalty: jax.Array | None = None
    presence_penalty: jax.Array | None = None
    # [B, R, W] int32: structured output's packed token masks (`specjax.core.logits`), one
    # per verified position (prefill: R = 1, the sampled one); all ones where unconstrained.
    token_mask: jax.Array | None = None
    # [B] bool: the row's run is the host's even where runs come from slot state (a
    # constrained row's drafts that its grammar forces); its drafts are accepted by strict
    # matching (they have no draft distribution).
    host_runs: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape

    def check(self) -> "StepBatch":
        """Raise ValueError naming the first field whose shape or dtype disagrees with
        `tokens` `[B, T]` (the comments above). Shapes are static: a step calls this while
        it is traced, so it costs nothing when it runs."""
        B, T = self.tokens.shape
        M = self.block_tables.shape[1] if self.block_tables.ndim == 2 else -1
        want = {"tokens": ((B, T), "i"), "block_tables": ((B, M), "i"),
                "bias_ids": ((B, MAX_LOGIT_BIAS), "i"), "bias_values": ((B, MAX_LOGIT_BIAS), "f"),
                "token_mask": None}
        for f in ("start_pos", "query_lens", "top_k", "slots", "max_lens", "next_tokens"):
            want[f] = ((B,), "i")
        for f in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                  "presence_penalty"):
            want[f] = ((B,), "f")
        want.update(seeds=((B,), "u"), logprobs=((B,), "b"), prompt_logprobs=((B,), "b"),
                    host_runs=((B,), "b"))
        for name, spec in want.items():
            value = getattr(self, name)
            if value is None:
                continue
            if spec is None:  # token_mask: [B, R, W] int32
                ok = value.ndim == 3 and value.shape[0] == B and value.dtype.kind == "i"
                expected = f"[{B}, R, W] int32"
            else:
                shape, kind = spec
                ok = tuple(value.shape) == shape and value.dtype.kind == kind
                expected = f"{list(shape)} of kind {kind!r}"
            if not ok:
                raise ValueError(f"StepBatch.{name} has shape {list(value.shape)} "
                                 f"{value.dtype}; expected {expected} (tokens are {[B, T]})")
        return self


@struct.dataclass
class PrefillOutput:
    tokens: jax.Array        # [B] int32: the token sampled after each row's run
    # [C, B, T, H]: residual streams after the saved layers (SAVE_HIDDEN_STATES only)
    hidden_states: jax.Array | None = None
    logprobs: Logprobs | None = None         # [B]: of `tokens`
    # [B, T]: of the token after each row of the run (the next prompt token; at the run's
    # last row, the next prompt token or `tokens`)
    prompt_logprobs: Logprobs | None = None

    def check(self, B: int, T: int) -> "PrefillOutput":
        """Assert the shapes above for a batch of B rows of T tokens (static: a step calls
        this while it is traced)."""
        chex.assert_shape(self.tokens, (B,))
        chex.assert_type(self.tokens, int)
        if self.hidden_states is not None:
            chex.assert_shape(self.hidden_states, (None, B, T, None))
        _check_logprobs(self.logprobs, (B,))
        _check_logprobs(self.prompt_logprobs, (B, T))
        return self


@struct.dataclass
class GenerationOutput:
    new_tokens: jax.Array          # [B, D+1]: accepted drafts, then the correction/bonus token
    new_tokens_lens: jax.Array     # [B]: accepted + 1
    next_draft_tokens: jax.Array   # [B, D] (width 0 without an in-step drafter)
    draft_lens: jax.Array          # [B]: real drafts verified (before padding)
    # [C, B, D+1, H]: residual streams after the saved layers (SAVE_HIDDEN_STATES only)
    hidden_states: jax.Array | None = None
    logprobs: Logprobs | None = None         # [B, D+1]: of new_tokens
    # [B, K] float32: the drafter's confidence in each of next_draft_tokens (DSpark), or None
    draft_confidence: jax.Array | None = None

    def check(self, B: int, D: int) -> "GenerationOutput":
        """Assert the shapes above for B rows verified to depth D (a tree's depth: its
        `next_draft_tokens` are its T nodes), while the step is traced."""
        chex.assert_shape(self.new_tokens, (B, D + 1))
        chex.assert_shape([self.new_tokens_lens, self.draft_lens], (B,))
        chex.assert_shape(self.next_draft_tokens, (B, None))
        chex.assert_type([self.new_tokens, self.new_tokens_lens, self.next_draft_tokens,
                          self.draft_lens], int)
        if self.hidden_states is not None:
            chex.assert_shape(self.hidden_states, (None, B, D + 1, None))
        _check_logprobs(self.logprobs, (B, D + 1))
        if self.draft_confidence is not None:
            chex.assert_shape(self.draft_confidence, self.next_draft_tokens.shape)
        return self


def _check_logprobs(logprobs: Logprobs | None, shape: tuple[int, ...]) -> None:
    if logprobs is not None:
        chex.assert_shape(logprobs.chosen, shape)
        chex.assert_shape([logprobs.top_ids, logprobs.top], (*shape, None))


def empty_batch(rows: int, width: int, blocks_per_seq: int, spare_slot: int,
                mask_shape: tuple[int, int] | None = None) -> StepBatch:
    """A batch of `rows` padded rows (numpy arrays, filled in place by `set_row`); with
    `mask_shape` (R, W), all-ones token masks `[rows, R, W]` (the host fills constrained rows:
    `specjax.engine.grammar`)."""
    return StepBatch(
        tokens=np.zeros((rows, width), np.int32),
        start_pos=np.zeros(rows, np.int32),
        query_lens=np.zeros(rows, np.int32),
        block_tables=np.full((rows, blocks_per_seq), NULL_BLOCK, np.int32),
        temperature=np.zeros(rows, np.float32),
        top_k=np.zeros(rows, np.int32),
        top_p=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32),
        seeds=np.zeros(rows, np.uint32),
        slots=np.full(rows, spare_slot, np.int32),
        max_lens=np.zeros(rows, np.int32),
        next_tokens=np.full(rows, -1, np.int32),
        bias_ids=np.full((rows, MAX_LOGIT_BIAS), -1, np.int32),
        bias_values=np.zeros((rows, MAX_LOGIT_BIAS), np.float32),
        logprobs=np.zeros(rows, bool),
        prompt_logprobs=np.zeros(rows, bool),
        repetition_penalty=np.ones(rows, np.float32),
        frequency_penalty=np.zeros(rows, np.float32),
        presence_penalty=np.zeros(rows, np.float32),
        token_mask=None if mask_shape is None else np.full((rows,) + mask_shape, -1, np.int32),
        host_runs=None if mask_shape is None else np.zeros(rows, bool),
    )


def set_row(batch: StepBatch, row: int, *, run: Sequence[int], start_pos: int,
            blocks: Sequence[int], slot: int, max_len: int, seed: int = 0,
            temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
            next_token: int = -1, logit_bias: Sequence[tuple[int, float]] = (),
            logprobs: bool = False, prompt_logprobs: bool = False,
            repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
            presence_penalty: float = 0.0) -> None:
    """Make `row` of an `empty_batch` real: `run` (its tokens) starts at `start_pos`, the
    request's K/V live in `blocks` and its device-side state in `slot`; generation steps
    verify no drafts past `max_len` tokens. Generation steps that read runs from slot state
    (`specjax.core.runs_on_device`) take the run, its start and its length from the device:
    then `run` only needs to be non-empty. `next_token`: the prompt token after a prompt-chunk
    run (-1: the run ends the prompt; hidden-state drafters pair it with the run's last row).
    `spare_slot` of `empty_batch` must be the state's spare (`state.slots.spare`).
    `logit_bias`: (token id, bias) pairs added to the row's logits; `logprobs` /
    `prompt_logprobs`: whether the step computes log-probabilities for the row; the
    penalties as in `specjax.core.penalties`. (`set_request` + `set_run`.)"""
    set_request(batch, row, blocks=blocks, slot=slot, max_len=max_len, seed=seed,
                temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                logit_bias=logit_bias, logprobs=logprobs, repetition_penalty=repetition_penalty,
                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)
    set_run(batch, row, run=run, start_pos=start_pos, next_token=next_token,
            prompt_logprobs=prompt_logprobs)


def set_request(batch: StepBatch, row: int, *, blocks: Sequence[int], slot: int, max_len: int,
                seed: int = 0, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0, logit_bias: Sequence[tuple[int, float]] = (),
                logprobs: bool = False, repetition_penalty: float = 1.0,
                frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> None:
    """The part of `set_row` a request fixes for many steps: its blocks, slot, length limit
    and sampling (`REQUEST_FIELDS`). A host loop may keep these in a table of one row per
    slot and gather a step's rows from it (`gather_rows`)."""
    batch.block_tables[row] = NULL_BLOCK
    batch.block_tables[row, :len(blocks)] = blocks
    batch.temperature[row] = temperature
    batch.top_k[row] = top_k
    batch.top_p[row] = top_p
    batch.min_p[row] = min_p
    batch.seeds[row] = seed
    batch.slots[row] = slot
    batch.max_lens[row] = max_len
    batch.bias_ids[row] = -1
    batch.bias_values[row] = 0
    if logit_bias:
        ids, values = zip(*logit_bias)
        batch.bias_ids[row, :len(ids)] = ids
        batch.bias_values[row, :len(ids)] = values
    batch.logprobs[row] = logprobs
    batch.repetition_penalty[row] = repetition_penalty
    batch.frequency_penalty[row] = frequency_penalty
    batch.presence_penalty[row] = presence_penalty


def set_run(batch: StepBatch, row: int, *, run: Sequence[int], start_pos: int,
            next_token: int = -1, prompt_logprobs: bool = False) -> None:
    """The part of `set_row` that changes every step: the row's run and where it starts."""
    batch.tokens[row, :len(run)] = run
    batch.start_pos[row] = start_pos
    batch.query_lens[row] = len(run)
    batch.next_tokens[row] = next_token
    batch.prompt_logprobs[row] = prompt_logprobs


# What `set_request` writes: the fields `gather_rows` takes from a table of requests' rows.
REQUEST_FIELDS = ("block_tables", "temperature", "top_k", "top_p", "min_p", "seeds", "slots",
                  "max_lens", "bias_ids", "bias_values", "logprobs", "repetition_penalty",
                  "frequency_penalty", "presence_penalty")


def gather_rows(table: StepBatch, rows: np.ndarray, width: int,
                mask_shape: tuple[int, int] | None = None) -> StepBatch:
    """A batch whose row i has `REQUEST_FIELDS` of `table`'s row `rows[i]` (an `empty_batch`
    written by `set_request`; a row never written holds padding) and an empty run, for
    `set_run` to fill: one gather per field instead of a write per row and field."""
    n = len(rows)
    return StepBatch(
        tokens=np.zeros((n, width), np.int32), start_pos=np.zeros(n, np.int32),
        query_lens=np.zeros(n, np.int32), next_tokens=np.full(n, -1, np.int32),
        prompt_logprobs=np.zeros(n, bool),
        token_mask=None if mask_shape is None else np.full((n,) + mask_shape, -1, np.int32),
        host_runs=None if mask_shape is None else np.zeros(n, bool),
        **{f: getattr(table, f)[rows] for f in REQUEST_FIELDS})


def clear_row(batch: StepBatch, row: int, spare_slot: int) -> None:
    """Make `row` padding again, e.g. after a `set_row` that raised part-way: the step then
    runs without it and the other rows are untouched."""
    pad = empty_batch(1, batch.tokens.shape[1], batch.block_tables.shape[1], spare_slot,
                      None if batch.token_mask is None else batch.token_mask.shape[1:])
    for field in dataclasses.fields(pad):
        if getattr(pad, field.name) is not None:
            getattr(batch, field.name)[row] = getattr(pad, field.name)[0]
