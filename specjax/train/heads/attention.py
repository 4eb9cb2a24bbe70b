"""The two attention patterns of head training that the shared `dense_attention` cannot express.

`dense_attention` (`specjax.models`) masks on positions: every query of a batch row sees the
same keys, causally (and within a window). Plain causal attention in training goes through it:
chain step 1, the dense vanilla-MTP chain and the target's own forward. Two patterns are not a
function of positions:

- `chain_attention`, a later chain step: the query of anchor row t sees the step-1 keys of rows
  <= t plus keys that exist for row t alone (the "diagonal"). As `dense_attention` this would
  need the step-1 keys copied once per anchor (`[B*T, T + J]` keys) or a `[T, T*J]` score block
  that is all masked but its diagonal.
- `masked_attention`, the report's tree-masked target forward: a draft slot of anchor a sees
  the prefix rows <= a+1 and its own anchor's earlier slots, but not the prefix rows a+2.. that
  sit at positions before it.

Both use the heads-major layout and float32 softmax of `dense_attention`, so the numbers agree
with it to float rounding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q `[B, S, heads, hd]`, k `[B, S_k, kv, hd]` -> scaled float32 scores
    `[B, kv, S*G, S_k]`, query rows t-major (row t*G + g; G = heads // kv)."""
    B, S, Hq, hd = q.shape
    KV = k.shape[2]
    # Heads-major batched matmuls, as in `dense_attention` (faster than einsum on XLA:CPU).
    qh = q.reshape(B, S, KV, Hq // KV, hd).transpose(0, 2, 1, 3, 4).reshape(B, KV, -1, hd)
    return jnp.matmul(qh, k.transpose(0, 2, 3, 1)).astype(jnp.float32) * hd ** -0.5


def _weighted_values(probs: jax.Array, v: jax.Array, G: int) -> jax.Array:
    """probs `[B, kv, S*G, S_k]` (t-major rows), v `[B, S_k, kv, hd]` -> `[B, S, kv, G, hd]`."""
    B, KV, SG, _ = probs.shape
    out = jnp.matmul(probs.astype(v.dtype), v.transpose(0, 2, 1, 3))  # [B, kv, S*G, hd]
    return out.reshape(B, KV, SG // G, G, -1).transpose(0, 2, 1, 3, 4)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """GQA attention with an explicit boolean mask `[S_q, S_k]` (shared by the batch); float32
    softmax. q `[B, S, heads, hd]`, k/v `[B, S, kv, hd]` -> `[B, S, heads, hd]`."""
    B, S, Hq, hd = q.shape
    G = Hq // k.shape[2]
    scores = jnp.where(jnp.repeat(mask, G, axis=0), _scores(q, k), -jnp.inf)
    return _weighted_values(jax.nn.softmax(scores, axis=-1), v, G).reshape(B, S, Hq, hd)


def chain_attention(q: jax.Array, k1: jax.Array, v1: jax.Array,
                    diag_k: list[jax.Array] = (), diag_v: list[jax.Array] = ()) -> jax.Array:
    """Attention of a chain step, one query per anchor row.

    q `[B, T, heads, hd]` (the query of anchor row t); k1, v1 `[B, T, kv, hd]`: step-1 keys and
    values by row, of which row t's query sees rows <= t; diag_k, diag_v: lists of
    `[B, T, kv, hd]`, the keys/values later chain steps produced at the same anchor row (each
    seen only by that row's query). Scores are concatenated [causal block | diagonal] and
    softmaxed together in float32. -> `[B, T, heads, hd]`.
    """
    B, T, Hq, hd = q.shape
    KV = k1.shape[2]
    G = Hq // KV
    causal = jnp.tril(jnp.ones((T, T), bool))
    scores = jnp.where(jnp.repeat(causal, G, axis=0), _scores(q, k1), -jnp.inf)  # [B, KV, T*G, T]
    J = len(diag_k)
    if J:
        dk = jnp.stack(diag_k, axis=3)  # [B, T, KV, J, hd]
        dv = jnp.stack(diag_v, axis=3)
        q5 = q.reshape(B, T, KV, G, hd)
        diag = jnp.matmul(q5, dk.swapaxes(-1, -2)).astype(jnp.float32) * hd ** -0.5
        diag = diag.transpose(0, 2, 1, 3, 4).reshape(B, KV, T * G, J)  # from [B, T, KV, G, J]
        scores = jnp.concatenate([scores, diag], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    out = _weighted_values(probs[..., :T], v1, G)  # [B, T, KV, G, hd]
    if J:
        pd = probs[..., T:].reshape(B, KV, T, G, J).transpose(0, 2, 1, 3, 4)  # [B, T, KV, G, J]
        out = out + jnp.matmul(pd.astype(dv.dtype), dv)
    return out.reshape(B, T, Hq, hd).astype(q.dtype)
