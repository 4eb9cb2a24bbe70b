"""The one-model speculative step: verify, accept, draft -- one pure jitted function.

`spec_step(params, kv, batch) -> (kv, SpecOutput)`; each row's run is [newest token, drafts]
padded to D+1 with query_lens = 1 + real draft length. D comes from the batch's shape, so
the function compiles once per (batch bucket, runtime draft length).

D = 0 is plain decoding: every generation step of the engine is this function, so plain and
speculative decoding share one code path. Runs come from device slot state when the host
cannot know them yet (in-step drafters) or needs nothing from itself (D = 0); then the host
may dispatch step N+1 before it reads step N (the overlap scheduler).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.engine.batch import StepBatch
from specjax.engine.step import paged_forward
from specjax.speculative.accept import rejection_accept, strict_accept, target_tokens


@struct.dataclass
class SpecOutput:
    new_tokens: jax.Array          # [B, D+1]: accepted drafts, then the correction/bonus token
    new_tokens_lens: jax.Array     # [B]: accepted + 1
    next_draft_tokens: jax.Array   # [B, D] (width 0 for host-drafter modes)
    draft_lens: jax.Array          # [B]: real drafts verified (before padding)
    # [C, B, D+1, H]: residual streams after the captured layers (SAVE_HIDDEN_STATES only)
    hidden_states: jax.Array | None = None


def runs_from_slots(batch: StepBatch, slots, D: int) -> StepBatch:
    """Take each row's run from device slot state: its newest token and as many of its drafts
    as the runtime length and the room left allow. Rows the host marked real (query_lens > 0)
    stay real; padded rows stay empty."""
    start = slots.start[batch.slots]
    room = batch.max_lens - start - 2  # a step emits drafts + 1 tokens after the newest
    drafts = jnp.clip(jnp.minimum(slots.num_drafts[batch.slots], jnp.minimum(D, room)), 0)
    return batch.replace(tokens=slots.run[batch.slots, :D + 1], start_pos=start,
                         query_lens=jnp.where(batch.query_lens > 0, 1 + drafts, 0))


@functools.lru_cache(maxsize=None)  # engines over one model share compiled steps
def make_spec_step(graphdef: nnx.GraphDef, worker=None, save_layers: tuple[int, ...] = ()):
    """Build the jitted generation step; `worker` is the in-step drafter (None: host drafts
    or none), `save_layers` the layers whose residual streams the output carries."""
    capture = worker.capture_layers if worker is not None else save_layers

    def spec_step(params: dict, kv: dict, batch: StepBatch) -> tuple[dict, SpecOutput]:
        D = batch.tokens.shape[1] - 1
        if worker is not None or D == 0:  # the next run is already on device
            batch = runs_from_slots(batch, kv["slots"], D)
        model = nnx.merge(graphdef, params["target"])
        kv_target, hidden, captured = paged_forward(model, kv["target"], batch, capture)
        logits = model.logits(hidden)
        slots = kv["slots"]
        # Decided by shapes: without draft distributions acceptance fails closed to strict.
        rejection = slots.draft_probs is not None and D > 0
        # Rejection sampling decides every sampled row, so strict matching need not sample.
        strict_temperature = jnp.zeros_like(batch.temperature) if rejection else batch.temperature
        targets = target_tokens(logits, batch.start_pos, strict_temperature,
                                batch.top_k, batch.top_p, batch.min_p, batch.seeds)
        new_tokens, lens = strict_accept(batch.tokens[:, 1:], batch.query_lens - 1, targets)
        if rejection:
            new_tokens, lens = rejection_accept(
                logits, batch, batch.tokens[:, 1:], batch.query_lens - 1,
                slots.draft_probs[batch.slots, :D], new_tokens, lens)
        kv = {**kv, "target": kv_target}
        B = batch.tokens.shape[0]
        probs = None
        if worker is None:
            drafts = jnp.zeros((B, 0), jnp.int32)
        else:
            kv["draft"], drafts, probs = worker.draft(params["draft"], kv["draft"], batch, model,
                                                      captured, new_tokens, lens, D)
        newest = jnp.take_along_axis(new_tokens, (lens - 1)[:, None], axis=1)
        run = jnp.zeros((B, slots.run.shape[1]), jnp.int32).at[:, :D + 1].set(
            jnp.concatenate([newest, drafts], axis=1))
        kv["slots"] = slots.replace(
            run=slots.run.at[batch.slots].set(run),
            start=slots.start.at[batch.slots].set(batch.start_pos + lens),
            num_drafts=slots.num_drafts.at[batch.slots].set(drafts.shape[1]))
        if probs is not None and slots.draft_probs is not None:
            kv["slots"] = kv["slots"].replace(
                draft_probs=slots.draft_probs.at[batch.slots, :D].set(probs))
        return kv, SpecOutput(new_tokens, lens, drafts, batch.query_lens - 1,
                              captured if save_layers else None)

    return jax.jit(spec_step, donate_argnums=(1,))
