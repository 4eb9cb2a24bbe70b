"""SA drafting inside the step: each slot's token history on the device, and the suffix matcher
that drafts from it.

The steps record every token a row commits (prompt chunks, the sampled token, accepted tokens)
in `SuffixState.history` and draft from it in the same call, so drafts for step N+1 come from
step N's accepted tokens without a host round trip: SA works with the overlap scheduler.

The matcher is the suffix automaton's lookup (`specjax.speculative.SuffixAutomaton`, the
reference) in fixed shapes. For every candidate end position e before the newest token, the
length of the common suffix of history[..e] and history[..newest] is counted, up to a bound
`span`; a suffix of length n occurred earlier exactly where that count is >= n, so the match
is the largest count and its earliest occurrence the first position that reaches it:

- `ngram = N > 0` (sizes N..1): span = N, and the answer is the automaton's, exactly;
- `ngram = -1` (the longest suffix): span = `MAX_MATCH`. Whenever the longest earlier suffix is at
  most MAX_MATCH tokens the answer is the automaton's; a longer one is reported as MAX_MATCH
  long and drafted from the earliest place the last MAX_MATCH tokens occurred (which the
  automaton's earliest occurrence of the longer suffix may follow). A match that long is
  already unambiguous context; the bound keeps the matcher O(B * H * span) per step.

The draft is the D tokens after that occurrence; when the occurrence ends only p < D tokens
before the newest one, those p tokens repeat to fill the draft (the sequence continued with
period p: a loop, a repeated row). The reference's draft is the first p of them; the step's
shape is D + 1 either way, so the extra guesses cost nothing. Drafts from another sequence
(the global pool) stop at that sequence's end.

Cost per step: O(B * H * span) compares for a history of H tokens (B = 8, H = 1024: 0.5 M),
and with the global pool O(B * (S + 1 + P) * H * span) -- off by default.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

MAX_MATCH = 64   # the longest match counted (ngram = -1); also the largest ngram size


@dataclasses.dataclass(frozen=True)
class SuffixSpec:
    """Static SA configuration the steps close over (hashable)."""

    ngram: int = -1          # max_matching_ngram_size: -1 = the longest suffix, N = sizes N..1
    # 0: SA drafts every row (mode SA). > 0: the enhancer -- SA's drafts replace an in-step
    # drafter's for rows whose match is at least this long.
    threshold: int = 0
    # The global pool: each row matches its own history first, then every other slot's and the
    # last `pool_size` completed requests' (oldest evicted); 0 = each row's own history only.
    pool_size: int = 0
    global_pool: bool = False

    def __post_init__(self):
        if not (self.ngram == -1 or 1 <= self.ngram <= MAX_MATCH):
            raise ValueError(f"max_matching_ngram_size must be -1 or in [1, {MAX_MATCH}], got "
                             f"{self.ngram!r}")
        if not 0 <= self.threshold <= MAX_MATCH:
            raise ValueError(f"the SA enhancer's threshold must be in [1, {MAX_MATCH}] (the "
                             f"longest match the matcher counts), got {self.threshold!r}")

    @property
    def span(self) -> int:
        """The longest match counted."""
        return self.ngram if self.ngram > 0 else MAX_MATCH


@struct.dataclass
class SuffixState:
    """Per-slot token history (row S is the spare padded rows write to) and, with the global
    pool, a ring of completed requests' histories."""

    history: jax.Array                   # [S+1, H] int32: token at each position
    length: jax.Array                    # [S+1] int32: tokens recorded
    pool: jax.Array | None = None        # [P, H] int32: histories of finished requests
    pool_length: jax.Array | None = None  # [P] int32 (0: empty)
    pool_next: jax.Array | None = None   # [] int32: the ring entry the next one replaces


def make_suffix_state(spec: SuffixSpec, num_slots: int, history_len: int) -> SuffixState:
    """Zeroed state: `history_len` tokens per slot (the engine's max_model_len)."""
    z = lambda *shape: jnp.zeros(shape, jnp.int32)
    P = (spec.pool_size or num_slots) if spec.global_pool else 0
    return SuffixState(history=z(num_slots + 1, history_len), length=z(num_slots + 1),
                       pool=z(P, history_len) if P else None,
                       pool_length=z(P) if P else None, pool_next=z() if P else None)


def record(state: SuffixState, rows: jax.Array, start: jax.Array, tokens: jax.Array,
           count: jax.Array) -> SuffixState:
    """Write tokens `[B, W]` at positions start `[B]` + 0..count-1 of slots `rows` `[B]`; each
    slot's history now ends there (a new request's first chunk starts at 0)."""
    H = state.history.shape[1]
    W = tokens.shape[1]
    pos = start[:, None] + jnp.arange(W)
    pos = jnp.where(jnp.arange(W) < count[:, None], pos, H)  # H: dropped
    return state.replace(
        history=state.history.at[rows[:, None], pos].set(tokens, mode="drop"),
        length=state.length.at[rows].set(jnp.minimum(start + count, H)))


def retire(state: SuffixState, rows: jax.Array, fresh: jax.Array) -> SuffixState:
    """Before rows `fresh` `[B]` start a new request in slots `rows`, move what those slots
    held into the global pool's ring (oldest entries replaced). No-op without a pool."""
    if state.pool is None:
        return state
    P = state.pool.shape[0]
    keep = fresh & (state.length[rows] > 0)
    order = jnp.cumsum(keep) - 1
    entry = jnp.where(keep, (state.pool_next + order) % P, P)  # P: dropped
    return state.replace(
        pool=state.pool.at[entry].set(state.history[rows], mode="drop"),
        pool_length=state.pool_length.at[entry].set(state.length[rows], mode="drop"),
        pool_next=(state.pool_next + keep.sum()) % P)


@functools.partial(jax.jit, donate_argnums=(0,))
def start_history(state: SuffixState, rows: jax.Array, tokens: jax.Array, count: jax.Array
                  ) -> SuffixState:
    """Start requests in slots `rows` `[B]` whose first `count` `[B]` tokens (`tokens`
    `[B, H]`) never pass through a prompt chunk -- their K/V came from the prefix cache: the
    slots' old histories go to the pool, the tokens become the new ones."""
    return record(retire(state, rows, count > 0), rows, jnp.zeros_like(count), tokens, count)


@struct.dataclass
class Proposal:
    drafts: jax.Array    # [B, D] int32, 0 past `num`
    num: jax.Array       # [B] int32: real drafts (0: no match)
    match: jax.Array     # [B] int32: matched suffix length (0: none)


def _match_counts(sources: jax.Array, suffix: jax.Array, suffix_ok: jax.Array) -> jax.Array:
    """sources `[B or 1, N, H]`, suffix `[B, M]` (suffix[:, m] = the token m before the newest),
    suffix_ok `[B, M]` -> `[B, N, H]`: how many of the suffix's tokens end at each position
    (the common-suffix length, counted up to M). Shift m compares every position e with
    e - m; the loop stops once no position still matches (real text: after a few shifts)."""
    (B, M), (_, N, H) = suffix.shape, sources.shape
    M = min(M, H)
    padded = jnp.pad(sources, ((0, 0), (0, 0), (M, 0)), constant_values=-1)  # tokens are >= 0

    def shift(carry):
        m, count, alive = carry
        shifted = jax.lax.dynamic_slice_in_dim(padded, M - m, H, axis=2)  # [.., e] = [.., e - m]
        token = jax.lax.dynamic_index_in_dim(suffix, m, axis=1, keepdims=False)
        ok = jax.lax.dynamic_index_in_dim(suffix_ok, m, axis=1, keepdims=False)
        alive = alive & (shifted == token[:, None, None]) & ok[:, None, None]
        return m + 1, count + alive, alive

    _, count, _ = jax.lax.while_loop(
        lambda carry: (carry[0] < M) & jnp.any(carry[2]), shift,
        (0, jnp.zeros((B, N, H), jnp.int32), jnp.ones((B, N, H), bool)))
    return count


def _earliest(counts: jax.Array, valid: jax.Array, ngram: int) -> tuple[jax.Array, jax.Array]:
    """counts, valid `[B, K]` -> (match `[B]`, index of its earliest occurrence `[B]`)."""
    counts = jnp.where(valid, counts, 0)
    match = counts.max(axis=1)
    if ngram > 0:
        match = jnp.minimum(match, ngram)
    return match, jnp.argmax(counts >= jnp.maximum(match, 1)[:, None], axis=1)


def propose(spec: SuffixSpec, state: SuffixState, rows: jax.Array, num_drafts: int) -> Proposal:
    """Each row's SA draft: up to `num_drafts` tokens that followed the earliest earlier
    occurrence of the longest suffix of its history (see the module docstring)."""
    H = state.history.shape[1]
    own, length = state.history[rows], state.length[rows]                 # [B, H], [B]
    M = spec.span
    suffix_pos = length[:, None] - 1 - jnp.arange(M)                      # [B, M]
    suffix = jnp.take_along_axis(own, jnp.clip(suffix_pos, 0, H - 1), axis=1)
    ok = suffix_pos >= 0
    ends = jnp.arange(H)
    own_counts = _match_counts(own[:, None], suffix, ok)[:, 0]            # [B, H]
    match, end = _earliest(own_counts, ends < length[:, None] - 1, spec.ngram)
    period = jnp.maximum(length - 1 - end, 1)
    offsets = jnp.arange(num_drafts)[None, :] % period[:, None]               # [B, D]
    num = jnp.where(match > 0, num_drafts, 0)
    source = own
    if spec.global_pool:
        others = state.history
        others_len = state.length
        if state.pool is not None:
            others = jnp.concatenate([others, state.pool])
            others_len = jnp.concatenate([others_len, state.pool_length])
        N = others.shape[0]
        counts = _match_counts(others[None], suffix, ok)                  # [B, N, H]
        valid = ((ends < others_len[:, None] - 1)[None]                   # a token follows
                 & (jnp.arange(N)[None, :] != rows[:, None])[:, :, None])
        other_match, flat = _earliest(counts.reshape(-1, N * H), valid.reshape(-1, N * H),
                                      spec.ngram)
        better = other_match > match  # ties: the row's own history first
        which, other_end = flat // H, flat % H
        match = jnp.where(better, other_match, match)
        end = jnp.where(better, other_end, end)
        source = jnp.where(better[:, None], others[which], own)
        offsets = jnp.where(better[:, None], jnp.arange(num_drafts)[None, :], offsets)
        num = jnp.where(better, jnp.clip(others_len[which] - 1 - other_end, 0, num_drafts), num)
    pos = end[:, None] + 1 + offsets
    drafts = jnp.take_along_axis(source, jnp.clip(pos, 0, H - 1), axis=1)
    return Proposal(jnp.where(jnp.arange(num_drafts) < num[:, None], drafts, 0), num, match)


def prefer(spec: SuffixSpec, proposal: Proposal, drafts: jax.Array | None, num: jax.Array,
           parents: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Each row's drafts: SA's alone (no in-step drafter: `drafts` None), or the enhancer's
    choice -- SA's where its match is at least `threshold` long, the drafter's elsewhere.
    drafts `[B, W]` (W >= SA's D; a tree's nodes), num `[B]`, parents `[B, W]` (a tree's) ->
    (drafts, num, from_sa `[B]`, parents: SA's chain is the tree whose node i hangs below
    node i-1)."""
    if drafts is None:
        return proposal.drafts, proposal.num, jnp.ones_like(proposal.num, bool), parents
    W = drafts.shape[1]
    use = proposal.match >= spec.threshold
    chain = jnp.pad(proposal.drafts, ((0, 0), (0, W - proposal.drafts.shape[1])))
    drafts = jnp.where(use[:, None], chain, drafts)
    num = jnp.where(use, proposal.num, num)
    if parents is not None:
        parents = jnp.where(use[:, None], jnp.arange(W, dtype=parents.dtype), parents)
    return drafts, num, use, parents
