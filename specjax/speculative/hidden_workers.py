"""In-step drafters that read the target's hidden states: EAGLE-3, MTP-Eagle and MTP.

Row t of a hidden-state drafter pairs the target's hidden state at position t with the token
at t+1 and predicts the token at t+2; its K/V live at position t of the drafter's own pool,
which shares the target's block tables. Per generation step (after acceptance, `lens` =
accepted + 1 new tokens from position p + 1 on):

- EAGLE-3 / MTP-Eagle (a chain): one pass over the verified rows p .. p+lens-1 (hidden from
  the target, tokens = the new tokens) writes the drafter's K/V for the accepted prefix, and
  the row of the last accepted token (p + lens - 1) gives draft 1; each later draft is one
  more row, fed the previous draft and the drafter's own hidden_out. Rejected rows are
  rewritten by the next step, which starts at the newest token's position.
- MTP (D modules, DeepSeek-V3): module s re-reads the same verified rows with the tokens
  shifted one further left and draft s entering after the last accepted one, and with module
  s-1's hidden_out; row lens-1 of module s gives draft s+1. Rows that read a draft token are
  written before the draft is verified and not revisited (at most s per step in module s's
  pool); that costs acceptance, never correctness.

Prompt chunks run the first pass (and MTP's modules) over the chunk with the tokens shifted
by one and the next prompt token -- or the sampled one -- after the last row.

Every worker is a frozen (hashable) dataclass: the jitted steps close over it; its
parameters travel as traced arguments (`params["draft"]`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.engine.batch import StepBatch
from specjax.engine.kv_cache import KVPool
from specjax.engine.step import PagedAttention
from specjax.models.config import ModelConfig
from specjax.models.llama import dense_attention
from specjax.speculative.accept import draft_tokens_and_probs
from specjax.speculative.eagle3_head import Eagle3HeadConfig
from specjax.speculative.mtp_head import target_lm_head


def shift_in(tokens: jax.Array, query_lens: jax.Array, following: jax.Array) -> jax.Array:
    """tokens `[B, T]` shifted left by one, with `following` `[B]` at each row's last real
    index (query_lens - 1): the token each row's hidden state is paired with."""
    T = tokens.shape[1]
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    last = jnp.arange(T)[None, :] == (query_lens - 1)[:, None]
    return jnp.where(last, following[:, None], shifted)


def head_pass(run_fn, kv: KVPool, layer: int, run: StepBatch, target, hidden: jax.Array
              ) -> tuple[KVPool, jax.Array]:
    """One drafter layer over `run` (its tokens are the embedded tokens, `hidden` `[B, T, H]`
    the paired hidden states), K/V written into `kv` layer `layer` for real rows only.
    `run_fn(embeds, hidden, positions, attend, state)` is the head's layer with attention
    split out (`Eagle3Head.run_midlayer`, `MTPModule.run_block`). -> (kv, hidden_out)."""
    paged = PagedAttention(run, kv.tokens_per_block)
    out, kv = run_fn(target.embed_tokens(run.tokens), hidden, paged.positions,
                     lambda q, k, v, pool: paged.attend(q, k, v, layer, pool), kv)
    return kv, out


def _make_pool(layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
               tokens_per_block: int, dtype: str) -> KVPool:
    shape = (layers, num_blocks, tokens_per_block, num_kv_heads, head_dim)
    return KVPool(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def _row(x: jax.Array, index: jax.Array) -> jax.Array:
    """x `[B, T, ...]` -> `[B, ...]` at `index` `[B]`."""
    return jnp.take_along_axis(x, index.reshape(-1, *([1] * (x.ndim - 1))), axis=1)[:, 0]


def _stack_drafts(first, first_probs, rest, rest_probs):
    drafts = jnp.concatenate([first[:, None], rest.T], axis=1)
    if first_probs is None:
        return drafts, None
    return drafts, jnp.concatenate([first_probs[:, None], rest_probs.transpose(1, 0, 2)], axis=1)


@dataclasses.dataclass(frozen=True)
class _ChainWorker:
    """EAGLE-style chain: one layer, one pool layer, D drafts from D - 1 single-row passes."""

    graphdef: nnx.GraphDef
    capture_layers: tuple[int, ...]
    rejection_sampling: bool = False

    # -- what a concrete head provides -----------------------------------------------------
    def _first_hidden(self, head, captured: jax.Array) -> jax.Array:
        raise NotImplementedError

    def _layer(self, head):
        """The object with `qkv_and_residual` and `finish` for the drafter's one layer."""
        raise NotImplementedError

    def _run_fn(self, head):
        layer = self._layer(head)
        return getattr(layer, "run_midlayer", None) or layer.run_block

    def _logits(self, head, target, hidden_out: jax.Array) -> jax.Array:
        """`[B, H]` -> float32 logits over the target vocabulary `[B, V]`."""
        raise NotImplementedError

    def _argmax(self, head, target, hidden_out: jax.Array) -> jax.Array:
        """The greedy draft `[B]` (target ids) without materialising target-vocab logits."""
        return jnp.argmax(self._logits(head, target, hidden_out), axis=-1).astype(jnp.int32)

    def _kv_shape(self) -> tuple[int, int]:
        raise NotImplementedError

    # -- the worker interface ----------------------------------------------------------------
    def make_kv(self, num_blocks: int, tokens_per_block: int, dtype: str) -> KVPool:
        return _make_pool(1, *self._kv_shape(), num_blocks, tokens_per_block, dtype)

    def catch_up(self, params: dict, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
                 following: jax.Array, num_drafts: int = 0
                 ) -> tuple[KVPool, jax.Array | None]:
        """Prompt chunks: write the drafter's K/V for the chunk's rows and, given
        `num_drafts`, draft that many tokens after each row's sampled token, so the first
        generation step already verifies drafts. -> (kv, drafts `[B, num_drafts]` or None).
        Not under rejection sampling: those drafts would need their distributions kept."""
        tokens = shift_in(batch.tokens, batch.query_lens, following)
        if num_drafts and not self.rejection_sampling:
            kv, drafts, _ = self.draft(params, kv, batch, target, captured, tokens,
                                       batch.query_lens, num_drafts)
            return kv, drafts
        head = nnx.merge(self.graphdef, params)
        kv, _ = head_pass(self._run_fn(head), kv, 0, batch.replace(tokens=tokens), target,
                          self._first_hidden(head, captured))
        return kv, None

    def draft(self, params: dict, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
              new_tokens: jax.Array, new_lens: jax.Array, num_drafts: int
              ) -> tuple[KVPool, jax.Array, jax.Array | None]:
        """After acceptance: catch up over the accepted rows, then draft `num_drafts` tokens.

        captured `[C, B, D+1, H]`, new_tokens `[B, D+1]`, new_lens `[B]` -> (kv, drafts
        `[B, num_drafts]`, their distributions `[B, num_drafts, V]` or None)."""
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
        newest = batch.start_pos + new_lens  # the newest token's position
        last = jnp.maximum(lens - 1, 0)

        def propose(hidden_out, k):  # draft k (0-based) lands at newest + 1 + k
            if not self.rejection_sampling:
                return self._argmax(head, target, hidden_out), None
            return draft_tokens_and_probs(self._logits(head, target, hidden_out), batch,
                                          newest + 1 + k, True)

        # The row of the last accepted token and every chain row attend to the same pool
        # context: gather it once, and keep the chain rows' K/V local -- the next step's
        # catch-up rewrites those positions before anything reads them.
        keys, values, key_pos, key_valid = _gather_context(kv, batch.block_tables,
                                                           batch.start_pos + lens)
        pos = (batch.start_pos + last)[:, None]
        out = dense_attention(_row(q, last)[:, None], keys, values, pos, key_pos,
                              k_valid=key_valid)
        h = layer.finish(out, _row(residual, last)[:, None])
        first, first_probs = propose(h[:, 0], 0)
        # Unrolled (D is static): on XLA:CPU a scan's loop overhead costs more than these
        # few single-row passes.
        drafts, probs, token = [first], [first_probs], first
        live = (lens > 0)[:, None]
        for k in range(1, num_drafts):
            pos = (newest + k - 1)[:, None]
            q, k_row, v_row, residual = layer.qkv_and_residual(
                target.embed_tokens(token[:, None]), h, pos)
            keys = jnp.concatenate([keys, k_row.astype(keys.dtype)], axis=1)
            values = jnp.concatenate([values, v_row.astype(values.dtype)], axis=1)
            key_pos = jnp.concatenate([key_pos, pos], axis=1)
            key_valid = jnp.concatenate([key_valid, live], axis=1)
            out = dense_attention(q, keys, values, pos, key_pos, k_valid=key_valid)
            h = layer.finish(out.astype(q.dtype), residual)
            token, p = propose(h[:, 0], k)
            drafts.append(token)
            probs.append(p)
        return kv, jnp.stack(drafts, axis=1), (None if first_probs is None
                                               else jnp.stack(probs, axis=1))


def _gather_context(kv: KVPool, block_tables: jax.Array, context_lens: jax.Array):
    """Pool layer 0 of each row's blocks as dense `[B, M * bs, kv, hd]` keys and values, with
    their positions `[B, M * bs]` and validity (position < context_lens) -- what paged
    attention reads, gathered once for several queries."""
    B, M = block_tables.shape
    bs = kv.tokens_per_block
    keys = kv.k[0, block_tables].reshape(B, M * bs, *kv.k.shape[3:])
    values = kv.v[0, block_tables].reshape(B, M * bs, *kv.v.shape[3:])
    positions = jnp.broadcast_to(jnp.arange(M * bs), (B, M * bs))
    return keys, values, positions, positions < context_lens[:, None]


@dataclasses.dataclass(frozen=True)
class Eagle3Worker(_ChainWorker):
    """EAGLE-3 (EAGLE3_ONE_MODEL): fc over three captured layers, one midlayer, draft vocab
    mapped to the target's through d2t."""

    head_config: Eagle3HeadConfig | None = None

    def _first_hidden(self, head, captured):
        return head.fuse(captured)

    def _layer(self, head):
        return head

    def _logits(self, head, target, hidden_out):
        return head.to_target_vocab(head.logits(hidden_out), -jnp.inf)

    def _argmax(self, head, target, hidden_out):
        draft_ids = jnp.argmax(head.logits(hidden_out), axis=-1).astype(jnp.int32)
        return head.to_target_ids(draft_ids)

    def _kv_shape(self):
        return self.head_config.num_kv_heads, self.head_config.head_dim


@dataclasses.dataclass(frozen=True)
class MTPEagleWorker(_ChainWorker):
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


@dataclasses.dataclass(frozen=True)
class MTPWorker:
    """Vanilla MTP (mode MTP): module s drafts token s+1; one pool layer per module."""

    graphdef: nnx.GraphDef
    capture_layers: tuple[int, ...]
    num_modules: int
    target_config: ModelConfig
    rejection_sampling: bool = False

    def make_kv(self, num_blocks: int, tokens_per_block: int, dtype: str) -> KVPool:
        cfg = self.target_config
        return _make_pool(self.num_modules, cfg.num_kv_heads, cfg.head_dim, num_blocks,
                          tokens_per_block, dtype)

    def _modules_pass(self, head, kv, run: StepBatch, target, hidden, num_steps: int,
                      with_probs: bool, draft_positions: jax.Array | None):
        """Modules 0 .. num_steps-1 over `run`'s rows; after module s, its row query_lens-1
        proposes token s+1, which enters module s+1's tokens after the last real row.
        -> (kv, drafts `[B, num_steps]`, probs or None)."""
        lm_head = target_lm_head(target)
        last = jnp.maximum(run.query_lens - 1, 0)
        tokens, drafts, probs = run.tokens, [], []
        for s in range(num_steps):
            module = head.modules[s]
            kv, hidden = head_pass(module.run_block, kv, s, run.replace(tokens=tokens), target,
                                   hidden)
            logits = module.logits(_row(hidden, last), lm_head)
            positions = draft_positions + s if draft_positions is not None else last
            token, p = draft_tokens_and_probs(logits, run, positions,
                                              with_probs and self.rejection_sampling)
            drafts.append(token)
            probs.append(p)
            tokens = shift_in(tokens, run.query_lens, token)
        B = run.tokens.shape[0]
        stacked = jnp.stack(drafts, axis=1) if drafts else jnp.zeros((B, 0), jnp.int32)
        if not drafts or probs[0] is None:
            return kv, stacked, None
        return kv, stacked, jnp.stack(probs, axis=1)

    def catch_up(self, params: dict, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
                 following: jax.Array, num_drafts: int = 0
                 ) -> tuple[KVPool, jax.Array | None]:
        head = nnx.merge(self.graphdef, params)
        run = batch.replace(tokens=shift_in(batch.tokens, batch.query_lens, following))
        # Module s > 0 reads tokens past the chunk: its own drafts stand in for them.
        kv, _, _ = self._modules_pass(head, kv, run, target, captured[0], self.num_modules,
                                      False, None)
        return kv, None

    def draft(self, params: dict, kv: KVPool, batch: StepBatch, target, captured: jax.Array,
              new_tokens: jax.Array, new_lens: jax.Array, num_drafts: int
              ) -> tuple[KVPool, jax.Array, jax.Array | None]:
        head = nnx.merge(self.graphdef, params)
        lens = jnp.where(batch.query_lens > 0, new_lens, 0)
        run = batch.replace(tokens=new_tokens, query_lens=lens)
        # At least module 0 runs, so the pool holds the accepted rows even when D = 0.
        kv, drafts, probs = self._modules_pass(head, kv, run, target, captured[0],
                                               max(num_drafts, 1), True,
                                               batch.start_pos + new_lens + 1)
        if probs is not None:
            probs = probs[:, :num_drafts]
        return kv, drafts[:, :num_drafts], probs
