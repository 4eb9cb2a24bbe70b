"""Presence, frequency and repetition penalties, with speculation.

The penalty at a verified position counts what precedes that position in the sequence the
step is checking: the request's generated tokens so far, plus the drafts before it in the
run (for a tree node: its ancestors). So the logits a draft is accepted against are the
logits plain decoding would penalise in the same way, and greedy output with penalties is
plain greedy output with penalties, token for token.

Semantics (vLLM's, applied after the logit bias and before temperature):
    repetition r: a token seen in the prompt or the output has its logit divided by r if
                  positive, multiplied by r if not;
    frequency f:  logit -= f * (times the token was generated);
    presence p:   logit -= p * (the token was generated at all).

Each slot carries its counts on the device (`PenaltyState`): the steps add every emitted
token; a request (re)starting in a slot sets them from all its tokens (`start_penalties`),
since prompt chunks whose K/V come from the prefix cache never pass through a step.

In-step drafters penalise their own logits the same way (`penalize_draft`, counting the
drafts before each), so a drafter that agrees with the target keeps agreeing under penalties.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class PenaltyState:
    counts: jax.Array   # [S+1, V] int32: times each token was generated in the slot's request
    prompt: jax.Array   # [S+1, V] bool: the token occurs in its prompt


def make_penalty_state(num_slots: int, vocab_size: int) -> PenaltyState:
    return PenaltyState(counts=jnp.zeros((num_slots + 1, vocab_size), jnp.int32),
                        prompt=jnp.zeros((num_slots + 1, vocab_size), bool))


def _bincount(tokens: jax.Array, keep: jax.Array, V: int) -> jax.Array:
    """tokens `[B, W]`, keep `[B, W]` bool -> `[B, V]` int32 counts of the kept tokens."""
    B = tokens.shape[0]
    return jnp.zeros((B, V), jnp.int32).at[jnp.arange(B)[:, None], tokens].add(
        keep.astype(jnp.int32))


@functools.partial(jax.jit, donate_argnums=(0,))
def start_penalties(state: PenaltyState, rows: jax.Array, tokens: jax.Array,
                    prompt_lens: jax.Array, num_tokens: jax.Array) -> PenaltyState:
    """Requests (re)starting in slots `rows` `[B]` with `tokens` `[B, H]`: the first
    `prompt_lens` `[B]` are the prompt, the rest up to `num_tokens` `[B]` generated."""
    V = state.counts.shape[1]
    at = jnp.arange(tokens.shape[1])
    prompt = _bincount(tokens, at < prompt_lens[:, None], V) > 0
    counts = _bincount(tokens, (at >= prompt_lens[:, None]) & (at < num_tokens[:, None]), V)
    return PenaltyState(counts=state.counts.at[rows].set(counts),
                        prompt=state.prompt.at[rows].set(prompt))


def record_generated(state: PenaltyState, rows: jax.Array, tokens: jax.Array,
                     lens: jax.Array) -> PenaltyState:
    """Each row's first `lens` `[B]` of `tokens` `[B, W]` were emitted for slot `rows`."""
    keep = jnp.arange(tokens.shape[1]) < lens[:, None]
    added = _bincount(tokens, keep, state.counts.shape[1])
    return state.replace(counts=state.counts.at[rows].add(added))


def chain_context(width: int) -> jax.Array:
    """`[W, W]` bool: run row i (a draft, i >= 1) precedes the position row j verifies."""
    i = jnp.arange(width)
    return (i[None, :] >= 1) & (i[None, :] <= i[:, None])


def tree_context(ancestors: jax.Array) -> jax.Array:
    """A tree layout's ancestor bits `[B, W]` -> `[B, W, W]` bool: row i is a proper
    ancestor of row j other than the root (the newest token, already generated)."""
    W = ancestors.shape[1]
    i = jnp.arange(W)
    bits = (ancestors[:, :, None] >> i[None, None, :]) & 1
    return (bits > 0) & (i[None, None, :] >= 1) & (i[None, None, :] != i[None, :, None])


def penalize(logits: jax.Array, state: PenaltyState, batch, run: jax.Array | None = None,
             context: jax.Array | None = None) -> jax.Array:
    """logits `[B, W, V]` of W positions, penalised for what precedes them: the slots'
    counts plus, given a `run` `[B, R]` of tokens not yet counted, the run rows `context`
    (`[W, R]` or `[B, W, R]` bool) marks before each position (`chain_context`,
    `tree_context`). Batches without a penalised row skip it."""
    if state is None or batch.repetition_penalty is None:
        return logits
    rep = batch.repetition_penalty
    freq, pres = batch.frequency_penalty, batch.presence_penalty
    active = (rep != 1) | (freq != 0) | (pres != 0)

    def apply():
        B, W, V = logits.shape
        counts = state.counts[batch.slots][:, None, :]                       # [B, 1, V]
        if run is not None:
            ctx = jnp.broadcast_to(context, (B, W, run.shape[1])).astype(jnp.int32)
            onehot = jax.nn.one_hot(run, V, dtype=jnp.int32)                   # [B, W, V]
            counts = counts + jnp.einsum("bji,biv->bjv", ctx, onehot)
        seen = counts > 0
        x = logits.astype(jnp.float32)
        r = rep[:, None, None]
        repeated = seen | state.prompt[batch.slots][:, None, :]
        x = jnp.where(repeated, jnp.where(x > 0, x / r, x * r), x)
        x = x - freq[:, None, None] * counts - pres[:, None, None] * seen
        return jnp.where(active[:, None, None], x, logits.astype(jnp.float32)).astype(
            logits.dtype)

    return jax.lax.cond(jnp.any(active), apply, lambda: logits)


def penalize_draft(logits: jax.Array, state: PenaltyState, batch,
                   drafts: jax.Array | None = None, num_before=None) -> jax.Array:
    """An in-step drafter's logits `[B, V]` for the position after the run's first
    `num_before` (default: all) `drafts` `[B, R]` -- the slots' counts already hold the newest
    token -- penalised as verification will penalise that position, so a drafter that agrees
    with the target without penalties still agrees with it with them."""
    if drafts is None or drafts.shape[1] == 0:
        return penalize(logits[:, None], state, batch)[:, 0]
    R = drafts.shape[1]
    before = jnp.arange(R)[None, :] < (R if num_before is None else num_before)   # [1, R]
    return penalize(logits[:, None], state, batch, drafts, before)[:, 0]
