"""The draft chain, unrolled over K = --depth steps exactly as the engine drafts it
("training-time test"), for EAGLE-3 and MTP-Eagle (one MTP module reused):

    step 1, every row t:  hidden = fuse(captured) (EAGLE-3) / the target's last residual stream
                          (MTP-Eagle), token t+1, position t, causal attention over rows <= t
    step j >= 2, anchor t: hidden = step j-1's hidden_out at row t, token t+j, position t+j-1;
                          the query attends to the step-1 keys of rows <= t (the head's KV cache
                          of the accepted prefix) plus the keys that steps 2..j produced at the
                          same anchor row t (the chain so far, itself included).

Step j >= 2 is `chain_attention`: one score matrix, the causal block over step-1 keys
concatenated with the per-row "diagonal" keys, softmax in float32.

Vanilla MTP (--num-modules N > 1) runs the dense chain of `MTPHeads.forward`: module j reads
module j-1's hidden_out at the same row, the embedding of token t+j and position t, with causal
attention over module j's own rows.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from specjax.models import Llama, dense_attention
from specjax.train.heads.attention import chain_attention
from specjax.train.heads.spec import HeadSpec


def chain_hidden_outs(qkv_fns: list[Callable], finish_fns: list[Callable], hidden1: jax.Array,
                      step_embeds: jax.Array, positions: jax.Array, ttt: bool = True
                      ) -> list[jax.Array]:
    """Unroll K = len(step_embeds) draft steps. hidden1 `[B, T, H]`; step_embeds `[K, B, T, H]`
    (step j's input-token embedding at each anchor row); positions `[B, T]` (the rows').

    ttt=True: the EAGLE-style chain (step j at position t+j-1, causal prefix of step-1 keys plus
    the diagonal). ttt=False: the dense vanilla-MTP chain (every step at position t, causal over
    its own rows). -> K hidden_outs `[B, T, H]`."""
    hidden, outs = hidden1, []
    k1 = v1 = None
    diag_k, diag_v = [], []
    for j in range(step_embeds.shape[0]):
        pos = positions + j if ttt else positions
        q, k, v, residual = qkv_fns[j](step_embeds[j], hidden, pos)
        if j == 0 or not ttt:
            k1, v1 = k, v
            attended = dense_attention(q, k, v, pos, pos)  # plain causal over the step's rows
        else:
            diag_k.append(k)
            diag_v.append(v)
            attended = chain_attention(q, k1, v1, diag_k, diag_v)
        hidden = finish_fns[j](attended, residual)
        outs.append(hidden)
    return outs


def run_chain(spec: HeadSpec, head, target: Llama, captured: jax.Array, step_tokens: jax.Array
              ) -> list[jax.Array]:
    """The head's logits for every chain step: captured `[len(needed_layers), B, >=T, H]` (the
    target's residual streams by row), step_tokens `[K, B, T]` (step j's input token at each
    anchor row). -> K arrays `[B, T, draft vocab]` (float32)."""
    K, B, T = step_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    embeds = target.embed_tokens(step_tokens.reshape(K * B, T)).reshape(K, B, T, -1)
    hidden1, modules, logits = spec.head_kind.chain_inputs(head, target, captured, K, T)
    outs = chain_hidden_outs([m.qkv_and_residual for m in modules], [m.finish for m in modules],
                             hidden1, embeds, positions, ttt=spec.chain)
    return [fn(h) for fn, h in zip(logits, outs)]


def shift_rows(x: jax.Array, shift: int, rows: int, axis: int = 1, fill=0) -> jax.Array:
    """x[..., shift : shift + rows, ...] along `axis`, padded with `fill` past the end."""
    x = jax.lax.slice_in_dim(x, min(shift, x.shape[axis]), min(shift + rows, x.shape[axis]),
                             axis=axis)
    missing = rows - x.shape[axis]
    if missing <= 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, missing)
    return jnp.pad(x, pad, constant_values=fill)


def teacher_forced_step_tokens(tokens: jax.Array, depth: int) -> jax.Array:
    """tokens `[B, T+1]` -> `[K, B, T]`: step j's input at anchor t is token t+j (0 past the end)."""
    T = tokens.shape[1] - 1
    return jnp.stack([shift_rows(tokens, j + 1, T) for j in range(depth)])
