"""Parallel drafters in training: every anchor's K drafts from one pass, laid out as the engine
runs them (PARD, DFlash).

A window holds tokens x[0..T]. Anchor index t (0..T-1) stands for the newest token at row
a = t + 1, as for the chain heads (whose step 1 at row t reads token t+1): draft k (1..K) of
the anchor predicts x[a+k] and is labelled with the target's distribution at row a+k-1.

PARD: one sequence holds the window (causal; row a's output is draft 1 of anchor a) and, for
k = 2..K, a mask row per anchor at position a+k-1 that sees the window's rows <= a and the
anchor's earlier mask rows (the pass the engine runs after each step: [.., newest, mask x
(K-1)]).

DFlash: the context features of rows 0..T (each layer's injected keys), and per anchor a block
[x[a], mask x K] at positions a..a+K that sees the context rows < a and its own block,
bidirectionally. Block row k is draft k.

DSpark: DFlash's pass, then draft k's logits add the Markov term of the token before it,
teacher-forced: the TRUE token x[a+k-1] (k = 1: the anchor itself), so the whole block still
trains in one pass (at inference that token is the draft at k - 1). The confidence logit z_k
reads the final-normed block row k and the same Markov embedding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import Llama
from specjax.train.heads.attention import masked_attention
from specjax.train.heads.chain import shift_rows


def pard_mask_rows(T: int, K: int) -> tuple[jax.Array, jax.Array]:
    """The PARD training sequence's positions `[S]` and attention mask `[S, S]`: rows 0..T are
    the window, then K-1 groups of T mask rows (group g, anchor index t: position t + 1 + g +
    1, draft g + 2 of anchor row t + 1)."""
    T1, n = T + 1, K - 1
    S = T1 + n * T
    idx = jnp.arange(S)
    is_mask = idx >= T1
    group = jnp.where(is_mask, (idx - T1) // T, -1)
    anchor = jnp.where(is_mask, (idx - T1) % T + 1, idx)          # the anchor's newest row
    positions = jnp.where(is_mask, anchor + group + 1, idx)
    q_group, k_group = group[:, None], group[None, :]
    window_key = jnp.where(is_mask[:, None], idx[None, :] <= anchor[:, None],
                           idx[None, :] <= idx[:, None])
    mask = jnp.where(k_group < 0, window_key,
                     is_mask[:, None] & (anchor[:, None] == anchor[None, :]) & (k_group <= q_group))
    return positions, mask


def pard_logits(model: Llama, tokens: jax.Array, K: int, vocab_size: int, mask_token: int
                ) -> list[jax.Array]:
    """tokens `[B, T+1]` -> K arrays `[B, T, vocab_size]`: draft k at each anchor index."""
    B, T1 = tokens.shape
    T = T1 - 1
    positions, mask = pard_mask_rows(T, K)
    seq = jnp.concatenate([tokens, jnp.full((B, (K - 1) * T), mask_token, tokens.dtype)], axis=1)
    attend = lambda q, k, v, layer, state: (masked_attention(q, k, v, mask), state)
    x, _, _ = model.run_layers(model.embed_tokens(seq), jnp.broadcast_to(positions, seq.shape),
                               attend, None)
    logits = model.logits(x)[..., :vocab_size]
    out = [logits[:, 1:T1]]
    out += [logits[:, T1 + g * T: T1 + (g + 1) * T] for g in range(K - 1)]
    return out


def dflash_hidden(head, target: Llama, captured: jax.Array, tokens: jax.Array, K: int
                  ) -> jax.Array:
    """captured `[>=C, B, >=T+1, H]` (the drafter's layers first), tokens `[B, T+1]` -> every
    anchor's block rows `[B, T, K+1, H]` (before the final norm; row k is draft k)."""
    B, T1 = tokens.shape
    T = T1 - 1
    C = len(head.config.target_layer_ids)
    ctx_pos = jnp.broadcast_to(jnp.arange(T1), (B, T1))
    context_kv = head.context_kv(head.context(captured[:C, :, :T1]), ctx_pos)
    anchors = jnp.arange(1, T1)                                            # [T]
    block_pos = (anchors[:, None] + jnp.arange(K + 1)[None, :]).reshape(-1)  # [T*(K+1)]
    block_anchor = jnp.repeat(anchors, K + 1)
    block_tokens = jnp.concatenate([tokens[:, 1:, None],
                                    jnp.full((B, T, K), head.config.mask_token_id, tokens.dtype)],
                                   axis=2).reshape(B, -1)
    sees_context = jnp.arange(T1)[None, :] < block_anchor[:, None]          # [Q, T1]
    sees_block = block_anchor[:, None] == block_anchor[None, :]             # [Q, Q]
    mask = jnp.concatenate([sees_context, sees_block], axis=1)

    def attend(q, k, v, layer, state):
        ck, cv = context_kv[layer]
        return masked_attention(q, jnp.concatenate([ck, k], axis=1),
                                jnp.concatenate([cv, v], axis=1), mask), state

    x, _ = head.run(target, block_tokens, jnp.broadcast_to(block_pos, block_tokens.shape), attend)
    return x.reshape(B, T, K + 1, -1)


def dflash_logits(head, target: Llama, captured: jax.Array, tokens: jax.Array, K: int
                  ) -> list[jax.Array]:
    """captured `[>=C, B, >=T+1, H]` (the drafter's layers first), tokens `[B, T+1]` -> K arrays
    `[B, T, V]`: draft k at each anchor index."""
    logits = head.logits(target, dflash_hidden(head, target, captured, tokens, K))
    return [logits[:, :, k] for k in range(1, K + 1)]


def dspark_outputs(head, target: Llama, captured: jax.Array, tokens: jax.Array, K: int
                   ) -> tuple[list[jax.Array], list[jax.Array]]:
    """A DSpark head in training (teacher-forced Markov inputs) -> (K logits `[B, T, V]`, K
    confidence logits z `[B, T]`): draft k of anchor row a = t + 1 reads the true token
    x[a+k-1] = tokens[:, t+k] (0 past the window: those rows are masked by the loss)."""
    T = tokens.shape[1] - 1
    x = dflash_hidden(head, target, captured, tokens, K)
    base = head.logits(target, x)
    normed = head.normed(x)
    logits, z = [], []
    for k in range(1, K + 1):
        e, term = head.markov(shift_rows(tokens, k, T))
        logits.append(base[:, :, k] + term)
        z.append(head.confidence_logit(normed[:, :, k], e))
    return logits, z
