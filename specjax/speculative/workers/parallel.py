"""Parallel drafters: PARD and DFlash propose all D drafts from ONE pass of their drafter
(TensorRT-LLM's `is_parallel_draft()`), where EAGLE-3 and MTP need D passes.

PARD (a small causal LM of the target's tokenizer). Per generation step, one pass of the draft
model over [the verified window's first token, the new tokens, mask x (D-1)] from the window's
start: it writes the draft model's K/V for the accepted tokens (its pool stays level with the
target's; the mask rows' K/V land past the newest token, where the next step's pass rewrites
them before anything reads them) and the rows from the newest token on give drafts 1..D.

DFlash (a few layers conditioned on the target). Its pool holds, per layer, the keys and values
of the context features (`DFlashHead.context`) of committed tokens, so a step projects only the
rows it verified. The block [newest token, mask x D] at positions p .. p+D is kept local: its
rows attend to the pool's context (positions < p) and to each other, bidirectionally, and rows
1..D give the drafts.

Drafts are independent given the context, so rejection sampling takes draft k's distribution
as it is (it need not depend on drafts 1..k-1 to keep the output on the target distribution).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.core.batch import StepBatch
from specjax.core.forward import PagedAttention, paged_forward
from specjax.core.kv import KVPool, make_kv_pool
from specjax.core.sampling import adjusts_logits, draft_tokens_and_probs, vocab_argmax
from specjax.core.worker import Drafts, WorkerDefaults
from specjax.models import Llama, load_dflash_head
from specjax.models.config import ModelConfig
from specjax.models.dflash_head import DFlashHeadConfig
from specjax.speculative.modes import SpeculativeDecodingMode
from specjax.speculative.workers.common import attend_over_context
from specjax.speculative.workers.loading import read_head, read_llama
from specjax.speculative.workers.registry import register


def propose_block(logits: jax.Array, batch: StepBatch, first: jax.Array, rejection: bool,
                  penalties=None) -> tuple[jax.Array, jax.Array | None]:
    """logits `[B, K, V]` of one pass -> (drafts `[B, K]`, their distributions `[B, K, V]`
    under rejection sampling, else None); draft k lands at position first + k (`first` `[B]`),
    whose key it is drawn with. Biased or penalised rows adjust draft k's logits as
    verification will, counting drafts 0 .. k-1."""
    B, K = logits.shape[:2]

    def one_by_one(with_probs: bool):  # under `lax.scan`: one draw in the program
        def one(before, k):
            d, p = draft_tokens_and_probs(logits[:, k], batch, first + k, with_probs, penalties,
                                          before, num_before=k)
            return before.at[:, k].set(d), p

        drafts, probs = jax.lax.scan(one, jnp.zeros((B, K), jnp.int32), jnp.arange(K))
        return drafts, (probs.transpose(1, 0, 2) if with_probs else None)

    if rejection:
        return one_by_one(True)
    plain = lambda: vocab_argmax(logits)
    adjusted = adjusts_logits(batch)
    if adjusted is False:
        return plain(), None
    return jax.lax.cond(adjusted, lambda: one_by_one(False)[0], plain), None


def _local_pass(batch: StepBatch, kv: KVPool, context_lens: jax.Array, positions: jax.Array,
                live: jax.Array, run, bidirectional: bool):
    """`run(attend)` with rows kept local: they see the pool's context (positions <
    `context_lens` `[B]`) and each other (causally on `positions` `[B, W]`, or all of them).
    -> what `run` returns."""
    return run(attend_over_context(kv, batch.block_tables, context_lens, positions, live,
                                   bidirectional))


@dataclasses.dataclass(frozen=True)
class PARDWorker(WorkerDefaults):
    """Implements `specjax.core.DraftWorker` for PARD (mode 12)."""

    graphdef: nnx.GraphDef
    config: ModelConfig                    # the draft model's (its pool's shape)
    mask_token_id: int
    vocab_size: int                        # the target's: drafts never name ids past it
    capture_layers: tuple[int, ...] = ()
    rejection_sampling: bool = False

    def make_kv(self, num_blocks: int, tokens_per_block: int, dtype: str) -> KVPool:
        cfg = self.config
        return make_kv_pool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks,
                            tokens_per_block, dtype)

    def _drafts(self, model, hidden: jax.Array, rows: jax.Array, batch: StepBatch,
                first: jax.Array, penalties) -> tuple[jax.Array, jax.Array | None]:
        """The drafts read at `rows` `[B, K]` of a pass's hidden `[B, W, H]`."""
        h = jnp.take_along_axis(hidden, rows[..., None], axis=1)
        logits = model.logits(h)[..., :self.vocab_size]
        return propose_block(logits, batch, first, self.rejection_sampling, penalties)

    def catch_up(self, params, kv: KVPool, batch: StepBatch, target, captured, following,
                 num_drafts: int = 0, penalties=None):
        """The chunk's K/V; after a prompt's last chunk, D drafts from one more pass over
        [the sampled token, mask x (D-1)], kept local (its blocks need not exist yet)."""
        model = nnx.merge(self.graphdef, params)
        kv, _, _ = paged_forward(model, kv, batch)
        if not num_drafts:
            return kv, None
        B, K = batch.tokens.shape[0], num_drafts
        p = batch.start_pos + batch.query_lens           # the sampled token's position
        tokens = jnp.concatenate([following[:, None],
                                  jnp.full((B, K - 1), self.mask_token_id, jnp.int32)], axis=1)
        positions = p[:, None] + jnp.arange(K)
        live = jnp.broadcast_to((batch.query_lens > 0)[:, None], (B, K))
        hidden = _local_pass(batch, kv, p, positions, live, lambda attend: model.run_layers(
            model.embed_tokens(tokens), positions, attend, None)[0], bidirectional=False)
        drafts, probs = self._drafts(model, hidden, jnp.broadcast_to(jnp.arange(K), (B, K)),
                                     batch, p + 1, penalties)
        return kv, Drafts.every(drafts, probs=probs)

    def draft(self, params, kv: KVPool, batch: StepBatch, target, captured,
              new_tokens: jax.Array, new_lens: jax.Array, num_drafts: int, penalties=None):
        """One pass over [window's first token, new_tokens[:lens], mask x (D-1)] from the
        window's start: K/V for the committed rows, drafts from the newest row on."""
        model = nnx.merge(self.graphdef, params)
        B, K = new_tokens.shape[0], num_drafts
        live = batch.query_lens > 0
        head = jnp.concatenate([batch.tokens[:, :1], new_tokens], axis=1)   # [B, D+2]
        head_lens = new_lens + 1
        width = head.shape[1] + max(K - 1, 0)
        cols = jnp.arange(width)[None, :]
        head = jnp.pad(head, ((0, 0), (0, width - head.shape[1])))
        tokens = jnp.where(cols < head_lens[:, None], head, self.mask_token_id)
        real = head_lens + max(K - 1, 0)
        run = batch.replace(tokens=tokens, query_lens=jnp.where(live, real, 0))
        kv, hidden, _ = paged_forward(model, kv, run)
        if K == 0:
            return kv, Drafts.every(jnp.zeros((B, 0), jnp.int32))
        rows = (head_lens - 1)[:, None] + jnp.arange(K)
        drafts, probs = self._drafts(model, hidden, rows, batch, batch.start_pos + head_lens,
                                     penalties)
        return kv, Drafts.every(drafts, probs=probs)


@dataclasses.dataclass(frozen=True)
class DFlashWorker(WorkerDefaults):
    """Implements `specjax.core.DraftWorker` for DFlash (mode 13)."""

    graphdef: nnx.GraphDef
    capture_layers: tuple[int, ...]        # the drafter's target_layer_ids
    head_config: DFlashHeadConfig
    mask_token_id: int
    rejection_sampling: bool = False

    def make_kv(self, num_blocks: int, tokens_per_block: int, dtype: str) -> KVPool:
        body = self.head_config.body
        return make_kv_pool(body.num_layers, body.num_kv_heads, body.head_dim, num_blocks,
                            tokens_per_block, dtype)

    def _write_context(self, head, kv: KVPool, run: StepBatch, captured: jax.Array) -> KVPool:
        """Every layer's injected K/V of `run`'s rows (their captured streams)."""
        paged = PagedAttention(run, kv.tokens_per_block)
        for layer, (k, v) in enumerate(head.context_kv(head.context(captured), paged.positions)):
            kv = paged.write(k, v, layer, kv)
        return kv

    def block_width(self, num_drafts: int) -> int:
        """Drafts proposed when a step verifies up to `num_drafts`."""
        return num_drafts

    def _block_rows(self, head, kv: KVPool, batch: StepBatch, target, newest: jax.Array,
                    p: jax.Array, live: jax.Array, K: int) -> jax.Array:
        """The block [newest, mask x K] at p .. p+K through the drafter -> rows 1..K'
        hidden states `[B, K, H]` (before the final norm)."""
        B = newest.shape[0]
        tokens = jnp.concatenate([newest[:, None],
                                  jnp.full((B, K), self.mask_token_id, jnp.int32)], axis=1)
        positions = p[:, None] + jnp.arange(K + 1)
        rows_live = jnp.broadcast_to(live[:, None], (B, K + 1))
        hidden = _local_pass(batch, kv, p, positions, rows_live, lambda attend: head.run(
            target, tokens, positions, attend)[0], bidirectional=True)
        return hidden[:, 1:]

    def _block(self, head, kv: KVPool, batch: StepBatch, target, newest: jax.Array,
               p: jax.Array, live: jax.Array, K: int, penalties) -> Drafts:
        """Drafts for positions p+1 .. p+K from the block [newest, mask x K] at p .. p+K."""
        rows = self._block_rows(head, kv, batch, target, newest, p, live, K)
        drafts, probs = propose_block(head.logits(target, rows), batch, p + 1,
                                      self.rejection_sampling, penalties)
        return Drafts.every(drafts, probs=probs)

    def catch_up(self, params, kv: KVPool, batch: StepBatch, target, captured, following,
                 num_drafts: int = 0, penalties=None):
        head = nnx.merge(self.graphdef, params)
        kv = self._write_context(head, kv, batch, captured)
        K = self.block_width(num_drafts)
        if not K:
            return kv, None
        return kv, self._block(head, kv, batch, target, following,
                               batch.start_pos + batch.query_lens, batch.query_lens > 0, K,
                               penalties)

    def draft(self, params, kv: KVPool, batch: StepBatch, target, captured,
              new_tokens: jax.Array, new_lens: jax.Array, num_drafts: int, penalties=None):
        """The accepted rows' context (the window's rows 0 .. lens-1 have the target's hidden
        states), then the block after the newest token."""
        head = nnx.merge(self.graphdef, params)
        live = batch.query_lens > 0
        lens = jnp.where(live, new_lens, 0)
        kv = self._write_context(head, kv, batch.replace(query_lens=lens), captured)
        B, K = new_tokens.shape[0], self.block_width(num_drafts)
        if K == 0:
            return kv, Drafts.every(jnp.zeros((B, 0), jnp.int32))
        newest = jnp.take_along_axis(new_tokens, jnp.maximum(lens - 1, 0)[:, None], axis=1)[:, 0]
        return kv, self._block(head, kv, batch, target, newest, batch.start_pos + lens, live, K,
                               penalties)


def load_pard_model(config, target: Llama, dtype: str) -> Llama:
    """The PARD model: the target's vocabulary plus (past it, or inside it) the mask token."""
    draft = read_llama(config.speculative_model, dtype, target)
    V, Vd = target.config.vocab_size, draft.config.vocab_size
    if Vd < V:
        raise ValueError(f"the PARD model's vocab_size {Vd} is smaller than the target's {V}: "
                         "PARD needs the target's tokenizer")
    mask = config.mask_token_id
    if mask is not None and mask >= Vd:
        raise ValueError(f"mask_token_id {mask} is outside the PARD model's vocabulary "
                         f"({Vd} tokens)")
    return draft


def load_dflash_drafter(config, target: Llama, dtype: str):
    """The DFlash drafter (a DSpark folder loads as a `DSparkHead`)."""
    return read_head(config.speculative_model,
                     lambda path: load_dflash_head(path, target.config, dtype=dtype), target,
                     "the DFlash drafter", "")


@register(SpeculativeDecodingMode.PARD, load_pard_model, layered=True)
def pard_worker(config, graphdef, draft_model, target_config) -> PARDWorker:
    if config.mask_token_id is None:
        raise ValueError("PARD needs mask_token_id (see with_drafter_fields)")
    return PARDWorker(graphdef, draft_model.config, config.mask_token_id,
                      target_config.vocab_size, rejection_sampling=config.use_rejection_sampling)


@register(SpeculativeDecodingMode.DFLASH, load_dflash_drafter, layered=True)
def dflash_worker(config, graphdef, draft_model, target_config) -> DFlashWorker:
    head = draft_model.config
    for layer in config.layers_for(head.target_layer_ids):
        if layer >= target_config.num_layers:
            raise ValueError(f"the DFlash drafter reads target layer {layer}; the target has "
                             f"{target_config.num_layers}")
    mask = head.mask_token_id if config.mask_token_id is None else config.mask_token_id
    if mask > target_config.vocab_size:
        raise ValueError(f"mask_token_id {mask} is past the target's vocabulary "
                         f"({target_config.vocab_size} tokens; {target_config.vocab_size} "
                         "is the drafter's own mask embedding)")
    return DFlashWorker(graphdef, head.target_layer_ids, head, mask,
                        config.use_rejection_sampling)
