"""Chain workers: EAGLE-3 and MTP-Eagle draft D tokens one after another inside the step --
or, with a `TreeShape`, a dynamic tree of depth D (`specjax.speculative.workers.tree`).

Per generation step (after acceptance, `lens` = accepted + 1 new tokens from position p + 1
on): one pass over the verified rows p .. p+lens-1 (hidden states from the target, tokens = the
new tokens) writes the drafter's K/V for the accepted prefix, and the row of the last accepted
token (p + lens - 1) gives draft 1; each later draft is one more row, fed the previous draft and
the drafter's own hidden_out (a tree: K rows per level, one per frontier node). Rejected rows
are rewritten by the next step, which starts at the newest token's position; after a tree the
step hands over the accepted path's rows in sequence order, so the catch-up writes them at
their linear positions. Prompt chunks run the first pass over the chunk with the tokens shifted
by one and the next prompt token -- or the sampled one -- after the last row.

Every worker is a frozen (hashable) dataclass implementing `specjax.core.DraftWorker`: the
jitted steps close over it; its parameters travel as traced arguments (`Params.draft`).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.paged_attention.reference import dense_attention, merge_attention
from specjax.core.batch import StepBatch
from specjax.core.forward import PagedAttention, context_attention, take_rows
from specjax.core.kv import KVPool, make_kv_pool
from specjax.core.sampling import adjusts_logits, draft_tokens_and_probs, vocab_argmax
from specjax.core.sharding import whole_vocab
from specjax.core.tree import TreeShape
from specjax.core.worker import Drafts, WorkerDefaults
from specjax.models import Llama, load_eagle3_head
from specjax.models.config import ModelConfig
from specjax.models.eagle3_head import Eagle3HeadConfig
from specjax.models.mtp_head import target_lm_head
from specjax.speculative.modes import SpeculativeDecodingMode
from specjax.speculative.workers.common import head_pass, shift_in
from specjax.speculative.workers.loading import read_head
from specjax.speculative.workers.mtp import load_mtp_modules
from specjax.speculative.workers.registry import register
from specjax.speculative.workers.tree import grow_tree, sampled_draw


@dataclasses.dataclass(frozen=True)
class ChainWorker(WorkerDefaults):
    """EAGLE-style chain: one layer, one pool layer, D drafts from D - 1 single-row passes."""

    graphdef: nnx.GraphDef
    capture_layers: tuple[int, ...]
    rejection_sampling: bool = False
    tree: TreeShape | None = None   # a dynamic tree's shape; None drafts a chain
    # Row t's K/V depend on the token at t+1 (`specjax.engine.prefix_cache`).
    pool_lookahead: ClassVar[int] = 1

    # -- what a concrete head provides -----------------------------------------------------
    def _first_hidden(self, head, captured: jax.Array) -> jax.Array:
        raise NotImplementedError

    def _layer(self, head):
        """The drafter's one layer: `qkv_and_residual`, `finish` and `run_layer`."""
        raise NotImplementedError

    def _logits(self, head, target, hidden_out: jax.Array) -> jax.Array:
        """`[B, H]` -> float32 logits over the target vocabulary `[B, V]`."""
        raise NotImplementedError

    def _argmax(self, head, target, hidden_out: jax.Array) -> jax.Array:
        """The greedy draft `[B]` (target ids) without materialising target-vocab logits."""
        return self._to_target(head, vocab_argmax(self._draft_logits(head, target, hidden_out)))

    def _draft_logits(self, head, target, hidden_out: jax.Array) -> jax.Array:
        """`[..., H]` -> float32 logits over the head's own vocabulary `[..., V']`."""
        return self._logits(head, target, hidden_out)

    def _to_target(self, head, ids: jax.Array) -> jax.Array:
        """The head's token ids -> the target's."""
        return ids

    def _to_target_vocab(self, head, probs: jax.Array) -> jax.Array:
        """Probabilities `[..., V']` over the head's vocabulary -> `[..., V]` over the
        target's (0 where the head has no token)."""
        return probs

    def _kv_shape(self) -> tuple[int, int]:
        raise NotImplementedError

    # -- the worker interface ----------------------------------------------------------------
    def make_kv(self, num_blocks: int, tokens_per_block: int, dtype: str) -> KVPool:
        return make_kv_pool(1, *self._kv_shape(), num_blocks, tokens_per_block, dtype)

    def catch_up(self, params, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
                 following: jax.Array, num_drafts: int = 0, penalties=None
                 ) -> tuple[KVPool, Drafts | None]:
        """Prompt chunks: write the drafter's K/V for the chunk's rows and, given
        `num_drafts`, draft that many tokens after each row's sampled token, so the first
        generation step already verifies drafts."""
        tokens = shift_in(batch.tokens, batch.query_lens, following)
        if num_drafts:
            return self.draft(params, kv, batch, target, captured, tokens, batch.query_lens,
                              num_drafts, penalties)
        head = nnx.merge(self.graphdef, params)
        kv, _ = head_pass(self._layer(head), kv, 0, batch.replace(tokens=tokens), target,
                          self._first_hidden(head, captured))
        return kv, None

    def draft(self, params, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
              new_tokens: jax.Array, new_lens: jax.Array, num_drafts: int, penalties=None
              ) -> tuple[KVPool, Drafts]:
        """After acceptance: catch up over the accepted rows, then draft `num_drafts` tokens
        (a tree worker: a tree of that depth, without bias or penalties).

        captured `[C, B, W, H]`, new_tokens `[B, W]` (the accepted rows in sequence order),
        new_lens `[B]`."""
        head = nnx.merge(self.graphdef, params)
        layer = self._layer(head)
        lens = jnp.where(batch.query_lens > 0, new_lens, 0)
        run = batch.replace(tokens=new_tokens, query_lens=lens)
        paged = PagedAttention(run, kv.tokens_per_block)
        q, k, v, residual = layer.qkv_and_residual(target.embed_tokens(new_tokens),
                                                   self._first_hidden(head, captured),
                                                   paged.positions)
        kv = paged.write(k, v, 0, kv)  # the accepted rows: the next step's context
        B = new_tokens.shape[0]
        if num_drafts == 0:
            return kv, Drafts.every(jnp.zeros((B, 0), jnp.int32))
        last = jnp.maximum(lens - 1, 0)
        context_lens = jnp.where(lens > 0, batch.start_pos + lens, 0)
        newest = batch.start_pos + last  # the newest token's position

        # The row of the last accepted token and every drafted row attend to the pool's
        # context (read as narrow as it allows); the drafted rows' K/V stay local -- the next
        # step's catch-up rewrites those positions before anything reads them.
        def attend(q_rows, positions):
            return context_attention(q_rows, kv, 0, batch.block_tables, positions,
                                     context_lens)

        out, _ = attend(take_rows(q, last)[:, None], newest[:, None])
        h = layer.finish(out.astype(q.dtype), take_rows(residual, last)[:, None])[:, 0]
        if self.tree is None:
            drafts, probs = self._chain(head, layer, target, batch, attend, h, newest, lens,
                                        num_drafts, penalties)
            return kv, Drafts.every(drafts, probs=probs)
        nodes, parents, probs = self._tree(head, layer, target, batch, attend, h,
                                           take_rows(new_tokens, last), newest, num_drafts)
        return kv, Drafts.every(nodes, parents=parents, probs=probs)

    def _chain(self, head, layer, target, batch, attend, h, newest, lens, num_drafts,
               penalties):
        """D drafts one after another (under `lax.scan`: one draft body per program): draft k
        is one more row, fed draft k - 1 and the previous row's hidden_out, attending to the
        context (`attend`) and the drafted rows before it. -> (drafts `[B, D]`, distributions
        `[B, D, V]` or None)."""
        live = (lens > 0)[:, None]

        def propose(hidden_out, k, before):  # draft k (0-based) lands at newest + 1 + k,
            # drawn with the key of the position after it; `before`: the drafts so far
            logits = lambda: self._logits(head, target, hidden_out)
            if not self.rejection_sampling:
                # Target-vocabulary logits only for batches that bias or penalise them.
                adjusted = adjusts_logits(batch)
                if adjusted is False:
                    return self._argmax(head, target, hidden_out), None
                return jax.lax.cond(
                    adjusted,
                    lambda: draft_tokens_and_probs(logits(), batch, None, False, penalties,
                                                   before, num_before=k)[0],
                    lambda: self._argmax(head, target, hidden_out)), None
            return draft_tokens_and_probs(logits(), batch, newest + 2 + k, True, penalties,
                                          before, num_before=k)

        B = h.shape[0]
        before = jnp.zeros((B, num_drafts), jnp.int32)
        first, first_probs = propose(h, 0, before)
        before = before.at[:, 0].set(first)
        if num_drafts == 1:
            return before, None if first_probs is None else first_probs[:, None]
        R = num_drafts - 1  # drafted rows, kept local: draft k's row reads draft k - 1
        local_k = jnp.zeros((B, R, *self._kv_shape()), h.dtype)
        local_v = jnp.zeros_like(local_k)
        local_pos = newest[:, None] + 1 + jnp.arange(R)

        def one(carry, k):  # draft k, k = 1 .. D - 1
            h, token, local_k, local_v, before = carry
            pos = (newest + k)[:, None]
            q_row, k_row, v_row, res_row = layer.qkv_and_residual(
                target.embed_tokens(token[:, None]), h[:, None], pos)
            local_k = jax.lax.dynamic_update_slice_in_dim(local_k, k_row.astype(h.dtype),
                                                          k - 1, axis=1)
            local_v = jax.lax.dynamic_update_slice_in_dim(local_v, v_row.astype(h.dtype),
                                                          k - 1, axis=1)
            valid = live & (jnp.arange(R)[None, :] < k)
            out, _ = merge_attention(attend(q_row, pos),
                                     dense_attention(q_row, local_k, local_v, pos, local_pos,
                                                     k_valid=valid, with_lse=True))
            h = layer.finish(out.astype(q_row.dtype), res_row)[:, 0]
            token, p = propose(h, k, before)
            before = before.at[:, k].set(token)
            return (h, token, local_k, local_v, before), p

        (_, _, _, _, drafts), probs = jax.lax.scan(
            one, (h, first, local_k, local_v, before), jnp.arange(1, num_drafts))
        if first_probs is None:
            return drafts, None
        return drafts, jnp.concatenate([first_probs[:, None], probs.transpose(1, 0, 2)], axis=1)

    def _node_log_probs(self, head, target, hidden_out: jax.Array, tokens: jax.Array
                        ) -> jax.Array:
        """A tree node's next-token log-probabilities over the head's vocabulary: from the
        hidden_out `[..., H]` of the row that read its token `tokens` `[...]`."""
        del tokens  # the head's hidden_out already read it
        return jax.nn.log_softmax(whole_vocab(self._draft_logits(head, target, hidden_out)))

    def _tree(self, head, layer, target, batch, attend, h, newest_token, newest, depth):
        """A dynamic tree of `depth` levels (`grow_tree`): each expanded node is one row, fed
        its token and the hidden_out its distribution came from, attending to the context
        (`attend`), its ancestors' rows and itself. With rejection sampling, sampled rows
        draw each node's children without replacement from the filtered head distribution
        (`sampled_draw`). -> (node tokens `[B, T]`, parents `[B, T]`, the distribution each
        node was drawn from over the target's vocabulary `[B, T, V]` or None)."""
        K = self.tree.top_k
        B = h.shape[0]
        R = K * max(depth - 1, 0)   # expanded rows: K per level but the last
        log_probs = lambda hidden, tokens: self._node_log_probs(head, target, hidden, tokens)

        def expand(level, tokens, node, local):
            hidden_in, ancestors = node                    # [B, K, H], [B, K, R] bool
            local_k, local_v = local                       # [B, R, KV, hd]
            pos = jnp.broadcast_to((newest + level)[:, None], (B, K))
            q_rows, k_rows, v_rows, res = layer.qkv_and_residual(
                target.embed_tokens(tokens), hidden_in, pos)
            first = (level - 1) * K
            local_k = local_k.at[:, first:first + K].set(k_rows.astype(local_k.dtype))
            local_v = local_v.at[:, first:first + K].set(v_rows.astype(local_v.dtype))
            own = jnp.arange(R)[None, :] == first + jnp.arange(K)[:, None]   # [K, R]
            sees = ancestors | own[None]
            out, _ = merge_attention(
                attend(q_rows, pos),
                dense_attention(q_rows, local_k, local_v, pos, jnp.zeros((B, R), pos.dtype),
                                mask=sees, with_lse=True))
            h_out = layer.finish(out.astype(q_rows.dtype), res)
            return log_probs(h_out, tokens), (h_out, sees), (local_k, local_v)

        kv_shape = self._kv_shape()
        node = (jnp.broadcast_to(h[:, None], (B, K, h.shape[-1])), jnp.zeros((B, K, R), bool))
        local = (jnp.zeros((B, R, *kv_shape), h.dtype), jnp.zeros((B, R, *kv_shape), h.dtype))
        draw = sampled_draw(batch, newest, K) if self.rejection_sampling else None
        nodes, parents, q = grow_tree(log_probs(h, newest_token), expand, node, local, K, depth,
                                      self.tree.nodes_for(depth),
                                      lambda ids: self._to_target(head, ids), draw)
        return nodes, parents, None if q is None else self._to_target_vocab(head, q)


@dataclasses.dataclass(frozen=True)
class Eagle3Worker(ChainWorker):
    """EAGLE-3 (EAGLE3_ONE_MODEL): fc over three captured layers, one midlayer, draft vocab
    mapped to the target's through d2t."""

    head_config: Eagle3HeadConfig | None = None

    def _first_hidden(self, head, captured):
        return head.fuse(captured)

    def _layer(self, head):
        return head

    def _logits(self, head, target, hidden_out):
        return head.to_target_vocab(head.logits(hidden_out), -jnp.inf)

    def _draft_logits(self, head, target, hidden_out):
        return head.logits(hidden_out)

    def _to_target(self, head, ids):
        return head.to_target_ids(ids)

    def _to_target_vocab(self, head, probs):
        return head.to_target_vocab(probs, 0.0)

    def _kv_shape(self):
        return self.head_config.num_kv_heads, self.head_config.head_dim


@dataclasses.dataclass(frozen=True)
class MTPEagleWorker(ChainWorker):
    """MTP-Eagle (MTP_EAGLE_ONE_MODEL): the first MTP module reused for every draft step, fed
    the target's last residual stream (capture layer L - 1)."""

    target_config: ModelConfig | None = None

    def _first_hidden(self, head, captured):
        return captured[0]

    def _layer(self, head):
        return head.modules[0]

    def _logits(self, head, target, hidden_out):
        return head.modules[0].logits(hidden_out, target_lm_head(target))

    def _kv_shape(self):
        return self.target_config.num_kv_heads, self.target_config.head_dim


def tree_within(config, vocab_size: int) -> TreeShape | None:
    """The config's draft-tree shape, checked against the drafter's vocabulary."""
    tree = config.tree_shape
    if tree is not None and tree.top_k > vocab_size:
        raise ValueError(f"dynamic_tree_max_topK ({tree.top_k}) exceeds the drafter's vocabulary "
                         f"({vocab_size} tokens)")
    return tree


def load_eagle3_drafter(config, target: Llama, dtype: str):
    return read_head(config.speculative_model, lambda path: load_eagle3_head(path, dtype=dtype),
                     target, "the EAGLE-3 head", "EagleConfig needs speculative_model: an "
                     "EAGLE-3 head folder (public layout) or an Eagle3Head")


@register(SpeculativeDecodingMode.EAGLE3_ONE_MODEL, load_eagle3_drafter)
def eagle3_worker(config, graphdef, draft_model, target_config) -> Eagle3Worker:
    head = draft_model.config
    layers = config.layers_to_capture(target_config.num_layers, head.aux_hidden_state_layers)
    return Eagle3Worker(graphdef, layers, config.use_rejection_sampling,
                        tree_within(config, head.draft_vocab_size), head_config=head)


@register(SpeculativeDecodingMode.MTP_EAGLE_ONE_MODEL, load_mtp_modules)
def mtp_eagle_worker(config, graphdef, draft_model, target_config) -> MTPEagleWorker:
    return MTPEagleWorker(graphdef, (target_config.num_layers - 1,),
                          config.use_rejection_sampling,
                          tree_within(config, target_config.vocab_size),
                          target_config=target_config)
