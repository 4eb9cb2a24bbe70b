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

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape


@struct.dataclass
class StepOutput:
    tokens: jax.Array        # [B] int32: the token sampled after each row's run
