"""The draft-target worker: a smaller model with its own paged KV drafts D tokens in the step.

The draft pool shares the target's block tables (one allocator, two pools), so a request's
positions map to the same blocks in both.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.core.batch import StepBatch
from specjax.core.forward import paged_forward
from specjax.core.kv import KVPool, make_kv_pool
from specjax.core.sampling import draft_tokens_and_probs
from specjax.core.worker import Drafts, WorkerDefaults
from specjax.models import Llama
from specjax.models.config import ModelConfig
from specjax.speculative.modes import SpeculativeDecodingMode
from specjax.speculative.workers.loading import read_llama
from specjax.speculative.workers.registry import register


@dataclasses.dataclass(frozen=True)
class DraftTargetWorker(WorkerDefaults):
    """Static (hashable) description of the draft model; its params travel as traced args
    (`Params.draft`). Implements `specjax.core.DraftWorker`."""

    graphdef: nnx.GraphDef
    config: ModelConfig                    # the draft model's (its KV pool's shape)
    capture_layers: tuple[int, ...] = ()   # target hidden states the worker reads (none here)
    # Sampled rows draw their drafts from the filtered draft distribution and return it, so
    # the step can accept by rejection sampling; otherwise every row drafts the argmax.
    rejection_sampling: bool = False

    def make_kv(self, num_blocks: int, tokens_per_block: int, dtype: str) -> KVPool:
        cfg = self.config
        return make_kv_pool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks,
                            tokens_per_block, dtype)

    def catch_up(self, params, kv: KVPool, batch: StepBatch, target, captured,
                 following, num_drafts: int = 0, penalties=None) -> tuple[KVPool, None]:
        """Write the draft model's K/V for the same runs the target just processed (drafting
        starts with the first generation step)."""
        kv, _, _ = paged_forward(nnx.merge(self.graphdef, params), kv, batch)
        return kv, None

    def draft(self, params, kv: KVPool, batch: StepBatch, target, captured,
              new_tokens: jax.Array, new_lens: jax.Array, num_drafts: int, penalties=None
              ) -> tuple[KVPool, Drafts]:
        """After acceptance: catch up over the verified window, then draft `num_drafts` tokens
        one at a time from each row's newest token."""
        model = nnx.merge(self.graphdef, params)
        kv, _, _ = paged_forward(model, kv, batch)
        B = new_tokens.shape[0]
        if num_drafts == 0:
            return kv, Drafts.every(jnp.zeros((B, 0), jnp.int32))
        newest = jnp.take_along_axis(new_tokens, (new_lens - 1)[:, None], axis=1)[:, 0]
        live = (batch.query_lens > 0).astype(jnp.int32)

        def one(carry, k):
            kv, token, pos, before = carry  # before: the drafts so far, zeros past k
            run = batch.replace(tokens=token[:, None], start_pos=pos, query_lens=live)
            kv, hidden, _ = paged_forward(model, kv, run)
            nxt, probs = draft_tokens_and_probs(model.logits(hidden[:, 0]), batch, pos + 1,
                                                self.rejection_sampling, penalties,
                                                before, num_before=k)
            return (kv, nxt, pos + 1, before.at[:, k].set(nxt)), (nxt, probs)

        start = batch.start_pos + new_lens  # the newest token's position
        before = jnp.zeros((B, num_drafts), jnp.int32)
        (kv, _, _, _), (drafts, probs) = jax.lax.scan(one, (kv, newest, start, before),
                                                      jnp.arange(num_drafts))
        if probs is not None:
            probs = probs.transpose(1, 0, 2)
        return kv, Drafts.every(drafts.T, probs=probs)


def load_draft_llm(config, target: Llama, dtype: str) -> Llama:
    """The draft model: a smaller LM of the target's tokenizer."""
    draft = read_llama(config.speculative_model, dtype, target)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_model vocab_size {draft.config.vocab_size} differs from "
                         f"the target's {target.config.vocab_size}: draft-target needs one "
                         "tokenizer")
    return draft


@register(SpeculativeDecodingMode.DRAFT_TARGET_ONE_MODEL, load_draft_llm, layered=True)
def draft_target_worker(config, graphdef, draft_model, target_config) -> DraftTargetWorker:
    return DraftTargetWorker(graphdef, draft_model.config,
                             rejection_sampling=config.use_rejection_sampling)
