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

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.core.batch import StepBatch
from specjax.core.forward import PagedAttention, gather_context, take_rows, with_narrowest_table
from specjax.core.kv import KVPool, make_kv_pool
from specjax.core.sampling import adjusts_logits, draft_tokens_and_probs
from specjax.core.tree import TreeShape
from specjax.models.config import ModelConfig
from specjax.models.eagle3_head import Eagle3HeadConfig
from specjax.models.llama import dense_attention
from specjax.models.mtp_head import target_lm_head
from specjax.speculative.workers.common import head_pass, shift_in
from specjax.speculative.workers.tree import grow_tree


@dataclasses.dataclass(frozen=True)
class ChainWorker:
    """EAGLE-style chain: one layer, one pool layer, D drafts from D - 1 single-row passes."""

    graphdef: nnx.GraphDef
    capture_layers: tuple[int, ...]
    rejection_sampling: bool = False
    tree: TreeShape | None = None   # a dynamic tree's shape; None drafts a chain
    # Row t's K/V depend on the token at t+1 (`specjax.engine.prefix_cache`).
    pool_lookahead = 1

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
        return self._to_target(head, jnp.argmax(self._draft_logits(head, target, hidden_out),
                                                axis=-1).astype(jnp.int32))

    def _draft_logits(self, head, target, hidden_out: jax.Array) -> jax.Array:
        """`[..., H]` -> float32 logits over the head's own vocabulary `[..., V']`."""
        return self._logits(head, target, hidden_out)

    def _to_target(self, head, ids: jax.Array) -> jax.Array:
        """The head's token ids -> the target's."""
        return ids

    def _kv_shape(self) -> tuple[int, int]:
        raise NotImplementedError

    # -- the worker interface ----------------------------------------------------------------
    def make_kv(self, num_blocks: int, tokens_per_block: int, dtype: str) -> KVPool:
        return make_kv_pool(1, *self._kv_shape(), num_blocks, tokens_per_block, dtype)

    def catch_up(self, params, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
                 following: jax.Array, num_drafts: int = 0, penalties=None
                 ) -> tuple[KVPool, jax.Array | None, jax.Array | None]:
        """Prompt chunks: write the drafter's K/V for the chunk's rows and, given
        `num_drafts`, draft that many tokens after each row's sampled token, so the first
        generation step already verifies drafts. -> (kv, drafts `[B, num_drafts]` or None,
        their distributions `[B, num_drafts, V]` under rejection sampling, else None)."""
        tokens = shift_in(batch.tokens, batch.query_lens, following)
        if num_drafts:
            return self.draft(params, kv, batch, target, captured, tokens, batch.query_lens,
                              num_drafts, penalties)
        head = nnx.merge(self.graphdef, params)
        kv, _ = head_pass(self._layer(head), kv, 0, batch.replace(tokens=tokens), target,
                          self._first_hidden(head, captured))
        return kv, None, None

    def draft(self, params, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
              new_tokens: jax.Array, new_lens: jax.Array, num_drafts: int, penalties=None
              ) -> tuple[KVPool, jax.Array, jax.Array | None]:
        """After acceptance: catch up over the accepted rows, then draft `num_drafts` tokens
        (a tree worker: a tree of that depth, without penalties).

        captured `[C, B, W, H]`, new_tokens `[B, W]` (the accepted rows in sequence order),
        new_lens `[B]` -> (kv, drafts `[B, num_drafts]`, their distributions
        `[B, num_drafts, V]` or None); a tree worker: (kv, node tokens `[B, T]`, parents
        `[B, T]`)."""
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
            return kv, jnp.zeros((B, 0), jnp.int32), None
        last = jnp.maximum(lens - 1, 0)
        context_lens = batch.start_pos + lens

        # The row of the last accepted token and every drafted row attend to the same pool
        # context: gather it once (through the narrowest block table that holds it), and keep
        # the drafted rows' K/V local -- the next step's catch-up rewrites those positions
        # before anything reads them.
        def from_context(tables):
            context = gather_context(kv, 0, tables, context_lens)
            keys, values, key_pos, key_valid = context
            pos = (batch.start_pos + last)[:, None]
            out = dense_attention(take_rows(q, last)[:, None], keys, values, pos, key_pos,
                                  k_valid=key_valid)
            h = layer.finish(out, take_rows(residual, last)[:, None])[:, 0]   # [B, H]
            if self.tree is None:
                return self._chain(head, layer, target, batch, context, h, context_lens, lens,
                                   num_drafts, penalties)
            return self._tree(head, layer, target, context, h, take_rows(new_tokens, last),
                              context_lens, num_drafts)

        drafts, extra = with_narrowest_table(from_context, batch.block_tables,
                                             jnp.where(lens > 0, context_lens, 0),
                                             kv.tokens_per_block)
        return kv, drafts, extra

    def _chain(self, head, layer, target, batch, context, h, newest, lens, num_drafts,
               penalties):
        """D drafts one after another: draft k is one more row, fed draft k - 1 and the
        previous row's hidden_out. -> (drafts `[B, D]`, distributions `[B, D, V]` or None)."""
        keys, values, key_pos, key_valid = context
        live = (lens > 0)[:, None]

        def propose(hidden_out, k, before):  # draft k (0-based) lands at newest + 1 + k
            logits = lambda: self._logits(head, target, hidden_out)
            if not self.rejection_sampling:
                # Target-vocabulary logits only for batches that bias or penalise them.
                adjusted = adjusts_logits(batch)
                if adjusted is False:
                    return self._argmax(head, target, hidden_out), None
                return jax.lax.cond(
                    adjusted,
                    lambda: draft_tokens_and_probs(logits(), batch, None, False, penalties,
                                                   before)[0],
                    lambda: self._argmax(head, target, hidden_out)), None
            return draft_tokens_and_probs(logits(), batch, newest + 1 + k, True, penalties,
                                          before)

        h = h[:, None]
        first, first_probs = propose(h[:, 0], 0, None)
        # Unrolled (D is static): on XLA:CPU a scan's loop overhead costs more than these few
        # single-row passes.
        drafts, probs, token = [first], [first_probs], first
        for k in range(1, num_drafts):
            pos = (newest + k - 1)[:, None]
            q_row, k_row, v_row, res_row = layer.qkv_and_residual(
                target.embed_tokens(token[:, None]), h, pos)
            keys = jnp.concatenate([keys, k_row.astype(keys.dtype)], axis=1)
            values = jnp.concatenate([values, v_row.astype(values.dtype)], axis=1)
            key_pos = jnp.concatenate([key_pos, pos], axis=1)
            key_valid = jnp.concatenate([key_valid, live], axis=1)
            out = dense_attention(q_row, keys, values, pos, key_pos, k_valid=key_valid)
            h = layer.finish(out.astype(q_row.dtype), res_row)
            token, p = propose(h[:, 0], k, jnp.stack(drafts, axis=1))
            drafts.append(token)
            probs.append(p)
        return jnp.stack(drafts, axis=1), (None if first_probs is None
                                           else jnp.stack(probs, axis=1))

    def _node_log_probs(self, head, target, hidden_out: jax.Array, tokens: jax.Array
                        ) -> jax.Array:
        """A tree node's next-token log-probabilities over the head's vocabulary: from the
        hidden_out `[..., H]` of the row that read its token `tokens` `[...]`."""
        del tokens  # the head's hidden_out already read it
        return jax.nn.log_softmax(self._draft_logits(head, target, hidden_out))

    def _tree(self, head, layer, target, context, h, newest_token, newest, depth):
        """A dynamic tree of `depth` levels (`grow_tree`): each expanded node is one row, fed
        its token and the hidden_out its distribution came from, attending to the context,
        its ancestors' rows and itself. -> (node tokens `[B, T]`, parents `[B, T]`)."""
        keys, values, key_pos, key_valid = context
        K = self.tree.top_k
        B, S = key_valid.shape
        R = K * max(depth - 1, 0)   # expanded rows: K per level but the last
        log_probs = lambda hidden, tokens: self._node_log_probs(head, target, hidden, tokens)

        def expand(level, tokens, node, local):
            hidden_in, ancestors = node                    # [B, K, H], [B, K, R] bool
            local_k, local_v = local                       # [B, R, KV, hd]
            pos = jnp.broadcast_to((newest + level - 1)[:, None], (B, K))
            q_rows, k_rows, v_rows, res = layer.qkv_and_residual(
                target.embed_tokens(tokens), hidden_in, pos)
            first = (level - 1) * K
            local_k = local_k.at[:, first:first + K].set(k_rows.astype(local_k.dtype))
            local_v = local_v.at[:, first:first + K].set(v_rows.astype(local_v.dtype))
            own = jnp.arange(R)[None, :] == first + jnp.arange(K)[:, None]   # [K, R]
            sees = ancestors | own[None]
            mask = jnp.concatenate([jnp.broadcast_to(key_valid[:, None], (B, K, S)), sees],
                                   axis=2)
            out = dense_attention(q_rows, jnp.concatenate([keys, local_k], axis=1),
                                  jnp.concatenate([values, local_v], axis=1), pos,
                                  jnp.concatenate([key_pos, jnp.zeros((B, R), key_pos.dtype)],
                                                  axis=1), mask=mask)
            h_out = layer.finish(out.astype(q_rows.dtype), res)
            return log_probs(h_out, tokens), (h_out, sees), (local_k, local_v)

        kv_shape = keys.shape[2:]
        node = (jnp.broadcast_to(h[:, None], (B, K, h.shape[-1])), jnp.zeros((B, K, R), bool))
        local = (jnp.zeros((B, R, *kv_shape), keys.dtype), jnp.zeros((B, R, *kv_shape),
                                                                     values.dtype))
        return grow_tree(log_probs(h, newest_token), expand, node, local, K, depth,
                         self.tree.nodes_for(depth), lambda ids: self._to_target(head, ids))


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
