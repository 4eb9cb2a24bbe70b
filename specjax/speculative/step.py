"""The one-model speculative step: verify, accept, draft -- one pure jitted function.

`spec_step(params, kv, batch) -> (kv, SpecOutput)`; each row's run is [newest token, drafts]
padded to D+1 with query_lens = 1 + real draft length. D comes from the batch's shape, so
the function compiles once per (batch bucket, runtime draft length).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.engine.batch import StepBatch
from specjax.engine.step import paged_forward
from specjax.speculative.accept import strict_accept, target_tokens


@struct.dataclass
class SpecOutput:
    new_tokens: jax.Array          # [B, D+1]: accepted drafts, then the correction/bonus token
    new_tokens_lens: jax.Array     # [B]: accepted + 1
    next_draft_tokens: jax.Array   # [B, D] (width 0 for host-drafter modes)


@functools.lru_cache(maxsize=None)  # engines over one model share compiled steps
def make_spec_step(graphdef: nnx.GraphDef, worker=None):
    def spec_step(params: dict, kv: dict, batch: StepBatch) -> tuple[dict, SpecOutput]:
        D = batch.tokens.shape[1] - 1
        model = nnx.merge(graphdef, params["target"])
        kv_target, hidden = paged_forward(model, kv["target"], batch)
        targets = target_tokens(model.logits(hidden), batch.start_pos, batch.temperature,
                                batch.top_k, batch.top_p, batch.min_p, batch.seeds)
        new_tokens, lens = strict_accept(batch.tokens[:, 1:], batch.query_lens - 1, targets)
        kv = {**kv, "target": kv_target}
        if worker is None:
            drafts = jnp.zeros((batch.tokens.shape[0], 0), jnp.int32)
        else:
            kv["draft"], drafts = worker.draft(params["draft"], kv["draft"], batch, new_tokens,
                                               lens, D)
        return kv, SpecOutput(new_tokens, lens, drafts)

    return jax.jit(spec_step, donate_argnums=(1,))
