"""Vanilla MTP (DeepSeek-V3): D modules, module s drafts token s+1, inside the step.

Module s re-reads the verified rows with the tokens shifted one further left and draft s
entering after the last accepted one, and with module s-1's hidden_out; row lens-1 of module s
gives draft s+1. Rows that read a draft token are written before the draft is verified and not
revisited (at most s per step in module s's pool); that costs acceptance, never correctness.
Prompt chunks run every module over the chunk, the tokens shifted by one more per module.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.core.batch import StepBatch
from specjax.core.forward import take_rows
from specjax.core.kv import KVPool, make_kv_pool
from specjax.core.sampling import draft_tokens_and_probs
from specjax.core.worker import Drafts, WorkerDefaults
from specjax.models import Llama, load_mtp_heads
from specjax.models.config import ModelConfig
from specjax.models.mtp_head import MTPHeads, target_lm_head
from specjax.speculative.modes import SpeculativeDecodingMode
from specjax.speculative.workers.loading import read_head
from specjax.speculative.workers.registry import register
from specjax.speculative.workers.common import head_pass, shift_in


@dataclasses.dataclass(frozen=True)
class MTPWorker(WorkerDefaults):
    """Vanilla MTP (mode MTP): module s drafts token s+1; one pool layer per module."""

    graphdef: nnx.GraphDef
    capture_layers: tuple[int, ...]
    num_modules: int
    target_config: ModelConfig
    rejection_sampling: bool = False
    # Module s's K/V at t read the token at t+s+1, and rows written from drafts are not
    # rewritten once the drafts are verified: only a prompt's prefill writes shareable blocks
    # (`specjax.engine.prefix_cache`).
    rewrites_committed: ClassVar[bool] = False

    @property
    def pool_lookahead(self) -> int:  # type: ignore[override]
        return self.num_modules

    def make_kv(self, num_blocks: int, tokens_per_block: int, dtype: str) -> KVPool:
        cfg = self.target_config
        return make_kv_pool(self.num_modules, cfg.num_kv_heads, cfg.head_dim, num_blocks,
                            tokens_per_block, dtype)

    def _modules_pass(self, head, kv, run: StepBatch, target, hidden, num_steps: int,
                      with_probs: bool, draft_positions: jax.Array | None, penalties=None):
        """Modules 0 .. num_steps-1 over `run`'s rows; after module s, its row query_lens-1
        proposes token s+1, which enters module s+1's tokens after the last real row.
        -> (kv, drafts `[B, num_steps]`, probs or None)."""
        lm_head = target_lm_head(target)
        last = jnp.maximum(run.query_lens - 1, 0)
        tokens, drafts, probs = run.tokens, [], []
        for s in range(num_steps):
            module = head.modules[s]
            kv, hidden = head_pass(module, kv, s, run.replace(tokens=tokens), target,
                                   hidden)
            logits = module.logits(take_rows(hidden, last), lm_head)
            positions = draft_positions + s if draft_positions is not None else last
            token, p = draft_tokens_and_probs(logits, run, positions,
                                              with_probs and self.rejection_sampling,
                                              penalties,
                                              jnp.stack(drafts, axis=1) if drafts else None)
            drafts.append(token)
            probs.append(p)
            tokens = shift_in(tokens, run.query_lens, token)
        B = run.tokens.shape[0]
        stacked = jnp.stack(drafts, axis=1) if drafts else jnp.zeros((B, 0), jnp.int32)
        if not drafts or probs[0] is None:
            return kv, stacked, None
        return kv, stacked, jnp.stack(probs, axis=1)

    def catch_up(self, params, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
                 following: jax.Array, num_drafts: int = 0, penalties=None
                 ) -> tuple[KVPool, None]:
        head = nnx.merge(self.graphdef, params)
        run = batch.replace(tokens=shift_in(batch.tokens, batch.query_lens, following))
        # Module s > 0 reads tokens past the chunk: its own drafts stand in for them.
        kv, _, _ = self._modules_pass(head, kv, run, target, captured[0], self.num_modules,
                                      False, None)
        return kv, None

    def draft(self, params, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
              new_tokens: jax.Array, new_lens: jax.Array, num_drafts: int, penalties=None
              ) -> tuple[KVPool, Drafts]:
        head = nnx.merge(self.graphdef, params)
        lens = jnp.where(batch.query_lens > 0, new_lens, 0)
        run = batch.replace(tokens=new_tokens, query_lens=lens)
        # At least module 0 runs, so the pool holds the accepted rows even when D = 0.
        kv, drafts, probs = self._modules_pass(head, kv, run, target, captured[0],
                                               max(num_drafts, 1), True,
                                               batch.start_pos + new_lens + 1, penalties)
        if probs is not None:
            probs = probs[:, :num_drafts]
        return kv, Drafts.every(drafts[:, :num_drafts], probs=probs)


def load_mtp_modules(config, target: Llama, dtype: str) -> MTPHeads:
    """The MTP modules (MTP-Eagle reuses the first)."""
    return read_head(config.speculative_model,
                     lambda path: load_mtp_heads(path, target.config, dtype=dtype), target,
                     "the MTP heads", "MTPConfig needs speculative_model: an MTP heads folder "
                     "or an MTPHeads (this target ships no MTP modules)")


def load_vanilla_mtp(config, target: Llama, dtype: str) -> MTPHeads:
    """Vanilla MTP drafts one token per module."""
    heads = load_mtp_modules(config, target, dtype)
    if heads.num_modules < config.max_draft_len:
        raise ValueError(f"MTP with max_draft_len {config.max_draft_len} needs that many "
                         f"modules; the heads have {heads.num_modules}")
    return heads


@register(SpeculativeDecodingMode.MTP, load_vanilla_mtp)
def mtp_worker(config, graphdef, draft_model, target_config) -> MTPWorker:
    return MTPWorker(graphdef, (target_config.num_layers - 1,), draft_model.num_modules,
                     target_config, config.use_rejection_sampling)
