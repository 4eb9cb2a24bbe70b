"""Timing the compiled generation step alone, through the public step API: what the engine's
host loop adds on top of it, and what verifying D+1 tokens costs against 1."""
from __future__ import annotations

import time

import jax
import numpy as np

from specjax.core import Params, empty_batch, make_generation_step, set_row
from specjax.engine.engine import Engine


def time_generation_step(engine: Engine, batch_size: int, width: int, start_pos: int,
                         iters: int = 20) -> float:
    """Seconds per back-to-back call of the target-only generation step (no drafter: a
    `width` > 1 run verifies host-given drafts) for `batch_size` rows of `width` tokens at
    `start_pos`, on the engine's own weights and pool (garbage context is fine for timing)."""
    ex = engine.executor
    fn = make_generation_step(ex.graphdef)
    params = Params(target=ex.params.target)
    state = ex.state.replace(draft=None)
    rows = next(b for b in ex.decode_buckets if b >= batch_size)
    batch = empty_batch(rows, width, ex.blocks_per_seq, ex.spare_slot)
    blocks = -(-(start_pos + width) // engine.config.tokens_per_block)
    total = engine.allocator.total_blocks
    for i in range(batch_size):
        set_row(batch, i, run=[0] * width, start_pos=start_pos, slot=ex.spare_slot,
                blocks=list(1 + (i * blocks + np.arange(blocks)) % total), max_len=10**6)
    for _ in range(3):
        state, out = fn(params, state, batch)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(iters):
        state, out = fn(params, state, batch)
    jax.block_until_ready(out)
    ex.state = ex.state.replace(target=state.target, slots=state.slots)  # donated
    return (time.perf_counter() - start) / iters
