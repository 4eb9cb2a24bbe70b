"""The jitted plain step: one forward over the paged KV pool, then sampling.

`make_step(graphdef)` returns `step(params, kv, batch) -> (kv, StepOutput)`, pure and jitted,
with the pools donated so XLA writes them in place. Parameters are traced arguments (plain
dicts from `nnx.split`), so one compiled program serves any weights of that shape; it
compiles once per (batch bucket, run width).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.paged_attention import paged_attention
from specjax.engine.batch import StepBatch, StepOutput
from specjax.engine.kv_cache import NULL_BLOCK, KVPool
from specjax.engine.sampling import sample, sampling_keys
from specjax.models.llama import NO_WINDOW, Llama


def write_slots(batch: StepBatch, tokens_per_block: int) -> tuple[jax.Array, jax.Array]:
    """(block ids, offsets), each `[B, T]`, where the run's K/V go; padding goes to block 0."""
    B, T = batch.tokens.shape
    positions = batch.start_pos[:, None] + jnp.arange(T)
    valid = jnp.arange(T) < batch.query_lens[:, None]
    index = jnp.where(valid, positions // tokens_per_block, 0)
    blocks = jnp.take_along_axis(batch.block_tables, index, axis=1)
    return jnp.where(valid, blocks, NULL_BLOCK), positions % tokens_per_block


class PagedAttention:
    """Paged attention for runs laid out as in `batch`: `write` puts a run's K/V into a pool
    layer (padding into the null block), `read` attends each row's queries over its blocks up
    to its context length, `attend` does both (the `AttendFn` the layer loop calls). Target
    and drafter heads share it, so their pools line up block for block."""

    def __init__(self, batch: StepBatch, tokens_per_block: int, windows: jax.Array | None = None):
        T = batch.tokens.shape[1]
        self.batch, self.windows = batch, windows
        self.positions = batch.start_pos[:, None] + jnp.arange(T)   # [B, T]
        self.context_lens = batch.start_pos + batch.query_lens      # [B]
        self.blocks, self.offsets = write_slots(batch, tokens_per_block)

    def write(self, k: jax.Array, v: jax.Array, layer, pool: KVPool) -> KVPool:
        return KVPool(k=pool.k.at[layer, self.blocks, self.offsets].set(k.astype(pool.k.dtype)),
                      v=pool.v.at[layer, self.blocks, self.offsets].set(v.astype(pool.v.dtype)))

    def read(self, q: jax.Array, layer, pool: KVPool) -> jax.Array:
        window = NO_WINDOW if self.windows is None else self.windows[layer]
        out = paged_attention(q, pool.k, pool.v, layer, self.batch.block_tables,
                              self.positions, self.context_lens, window)
        return out.astype(q.dtype)

    def attend(self, q, k, v, layer, pool: KVPool) -> tuple[jax.Array, KVPool]:
        pool = self.write(k, v, layer, pool)
        return self.read(q, layer, pool), pool


def paged_forward(model: Llama, kv: KVPool, batch: StepBatch,
                  capture_layers: Sequence[int] = ()) -> tuple[KVPool, jax.Array, jax.Array]:
    """Run each row's tokens through the model, writing their K/V into the pool first.

    Returns (kv, hidden `[B, T, D]` after the last layer, captured `[C, B, T, D]`: the residual
    streams after `capture_layers`, for hidden-state drafters; rows past query_lens are padding).
    """
    cfg = model.config
    windows = jnp.asarray([w or NO_WINDOW for w in (cfg.sliding_windows or (None,) * cfg.num_layers)])
    paged = PagedAttention(batch, kv.tokens_per_block, windows)
    hidden, captured, kv = model.run_layers(model.embed_tokens(batch.tokens), paged.positions,
                                            paged.attend, kv, capture_layers)
    return kv, hidden, captured


def last_rows(hidden: jax.Array, query_lens: jax.Array) -> jax.Array:
    """hidden `[B, T, D]` -> `[B, D]` at each row's last real token."""
    index = jnp.maximum(query_lens - 1, 0)
    return jnp.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]


@functools.lru_cache(maxsize=None)  # engines over one model share compiled steps
def make_step(graphdef: nnx.GraphDef, worker=None, save_layers: tuple[int, ...] = ()):
    """Build the jitted plain (prompt-chunk) step for models of this graph definition.

    `params` and `kv` are dicts: "target", plus "draft" when an in-step drafter rides along
    (it then processes the same runs, so its KV stays level with the target's). With
    `save_layers` the output carries the residual streams after those layers
    (SAVE_HIDDEN_STATES).
    """
    capture = worker.capture_layers if worker is not None else save_layers

    def step(params: dict, kv: dict, batch: StepBatch) -> tuple[dict, StepOutput]:
        model = nnx.merge(graphdef, params["target"])
        kv_target, hidden, captured = paged_forward(model, kv["target"], batch, capture)
        logits = model.logits(last_rows(hidden, batch.query_lens))
        keys = sampling_keys(batch.seeds, batch.start_pos + batch.query_lens)
        tokens = sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, keys)
        kv = {**kv, "target": kv_target}
        slots = kv["slots"]
        run = jnp.zeros((tokens.shape[0], slots.run.shape[1]), jnp.int32).at[:, 0].set(tokens)
        num_drafts = jnp.zeros_like(tokens)
        if worker is not None:
            # The token after each run: the next prompt token, or the one just sampled.
            ends = batch.next_tokens < 0
            following = jnp.where(ends, tokens, batch.next_tokens)
            kv["draft"], drafts = worker.catch_up(params["draft"], kv["draft"], batch, model,
                                                  captured, following, slots.run.shape[1] - 1)
            if drafts is not None:  # the first generation step verifies these
                run = run.at[:, 1:].set(drafts)
                num_drafts = jnp.where(ends & (batch.query_lens > 0), drafts.shape[1], 0)
        kv["slots"] = slots.replace(
            run=slots.run.at[batch.slots].set(run),
            start=slots.start.at[batch.slots].set(batch.start_pos + batch.query_lens),
            num_drafts=slots.num_drafts.at[batch.slots].set(num_drafts))
        return kv, StepOutput(tokens=tokens, hidden_states=captured if save_layers else None)

    return jax.jit(step, donate_argnums=(1,))
