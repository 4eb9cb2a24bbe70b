"""The jitted plain step: one forward over the paged KV pool, then sampling.

`make_step(graphdef)` returns `step(params, kv, batch) -> (kv, StepOutput)`, pure and jitted,
with the pools donated so XLA writes them in place. Parameters are traced arguments (plain
dicts from `nnx.split`), so one compiled program serves any weights of that shape; it
compiles once per (batch bucket, run width).
"""
from __future__ import annotations

import functools

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


def paged_forward(model: Llama, kv: KVPool, batch: StepBatch) -> tuple[KVPool, jax.Array]:
    """Run each row's tokens through the model, writing their K/V into the pool first.

    Returns (kv, hidden `[B, T, D]` after the last layer).
    """
    cfg = model.config
    B, T = batch.tokens.shape
    positions = batch.start_pos[:, None] + jnp.arange(T)
    context_lens = batch.start_pos + batch.query_lens
    blocks, offsets = write_slots(batch, kv.tokens_per_block)
    windows = jnp.asarray([w or NO_WINDOW for w in (cfg.sliding_windows or (None,) * cfg.num_layers)])

    def attend(q, k, v, layer, pool):
        pool = KVPool(k=pool.k.at[layer, blocks, offsets].set(k.astype(pool.k.dtype)),
                      v=pool.v.at[layer, blocks, offsets].set(v.astype(pool.v.dtype)))
        out = paged_attention(q, pool.k, pool.v, layer, batch.block_tables, positions,
                              context_lens, windows[layer])
        return out.astype(q.dtype), pool

    hidden, _, kv = model.run_layers(model.embed_tokens(batch.tokens), positions, attend, kv)
    return kv, hidden


def last_rows(hidden: jax.Array, query_lens: jax.Array) -> jax.Array:
    """hidden `[B, T, D]` -> `[B, D]` at each row's last real token."""
    index = jnp.maximum(query_lens - 1, 0)
    return jnp.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]


@functools.lru_cache(maxsize=None)  # engines over one model share compiled steps
def make_step(graphdef: nnx.GraphDef, worker=None):
    """Build the jitted plain step for models of this graph definition.

    `params` and `kv` are dicts: "target", plus "draft" when a draft worker rides along (its
    model then processes the same runs, so its KV stays level with the target's).
    """

    def step(params: dict, kv: dict, batch: StepBatch) -> tuple[dict, StepOutput]:
        model = nnx.merge(graphdef, params["target"])
        kv_target, hidden = paged_forward(model, kv["target"], batch)
        logits = model.logits(last_rows(hidden, batch.query_lens))
        keys = sampling_keys(batch.seeds, batch.start_pos + batch.query_lens)
        tokens = sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, keys)
        kv = {**kv, "target": kv_target}
        if worker is not None:
            kv["draft"] = worker.catch_up(params["draft"], kv["draft"], batch)
        slots = kv["slots"]
        kv["slots"] = slots.replace(
            run=slots.run.at[batch.slots].set(0).at[batch.slots, 0].set(tokens),
            start=slots.start.at[batch.slots].set(batch.start_pos + batch.query_lens),
            num_drafts=slots.num_drafts.at[batch.slots].set(0))
        return kv, StepOutput(tokens=tokens)

    return jax.jit(step, donate_argnums=(1,))
