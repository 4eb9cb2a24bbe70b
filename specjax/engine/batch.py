"""What one jitted step consumes and produces: fixed-shape padded arrays, no Python objects.

Rows are padded to a batch bucket and runs to a fixed width; a padded row has query_len 0 and
a block table of null blocks, so it writes only into block 0 and its outputs are ignored.
"""
from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class StepBatch:
    tokens: jax.Array        # [B, T] int32: each row's run (prompt chunk, or last token + drafts)
    start_pos: jax.Array     # [B] int32: position of tokens[:, 0]
    query_lens: jax.Array    # [B] int32: real tokens in the run (0 = padded row)
    block_tables: jax.Array  # [B, M] int32: the row's KV blocks, padded with block 0
    temperature: jax.Array   # [B] float32 (0 = greedy)
    top_k: jax.Array         # [B] int32 (0 = off)
    top_p: jax.Array         # [B] float32 (1 = off)
    min_p: jax.Array         # [B] float32 (0 = off)
    seeds: jax.Array         # [B] uint32
    slots: jax.Array         # [B] int32: the request's sequence slot (padded rows: the spare)
    max_lens: jax.Array      # [B] int32: prompt + output may not exceed this many tokens
    # [B] int32: the prompt token after a prompt-chunk run (-1: the run ends the prompt). Only
    # hidden-state drafters read it (their row t pairs hidden state t with token t+1).
    next_tokens: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape


@struct.dataclass
class StepOutput:
    tokens: jax.Array        # [B] int32: the token sampled after each row's run
    # [C, B, T, H]: residual streams after the captured layers (SAVE_HIDDEN_STATES only)
    hidden_states: jax.Array | None = None


@struct.dataclass
class SlotState:
    """Per-slot device state that lets a step start where the previous one ended without a
    host round trip: the overlap scheduler dispatches step N+1 before reading step N.

    Every step writes it for its rows; steps of in-step-drafter modes read their runs from it.
    Row S (one past the last slot) is the spare that padded rows write to.
    """

    run: jax.Array           # [S+1, D_max+1] int32: newest token, then its drafts
    start: jax.Array         # [S+1] int32: position of the newest token
    num_drafts: jax.Array    # [S+1] int32: drafts in `run` (0 after prefill or plain decode)
    # [S+1, D_max, V] float32: the distributions the drafts were drawn from, kept only when
    # rejection sampling needs them (None otherwise).
    draft_probs: jax.Array | None = None


def make_slot_state(num_slots: int, max_draft_len: int, vocab_size: int = 0) -> SlotState:
    """Slot state for `num_slots` slots plus the spare; `vocab_size` > 0 keeps draft probs."""
    import jax.numpy as jnp
    probs = (jnp.zeros((num_slots + 1, max_draft_len, vocab_size), jnp.float32)
             if vocab_size else None)
    return SlotState(run=jnp.zeros((num_slots + 1, max_draft_len + 1), jnp.int32),
                     start=jnp.zeros(num_slots + 1, jnp.int32),
                     num_drafts=jnp.zeros(num_slots + 1, jnp.int32), draft_probs=probs)
