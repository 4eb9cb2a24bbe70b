"""Shared by the head-training tests: a tiny target config, an EAGLE-3 spec for it, random
parameters, and the engine's per-anchor drafting chain as a brute-force reference."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import ModelConfig, dense_attention
from specjax.train.heads.spec import HeadSpec

TARGET = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=8,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                     rms_norm_eps=1e-5)
EAGLE = HeadSpec(kind="eagle3", depth=3, num_layers=8, capture_layers=(1, 3, 4), draft_vocab=64)


def random_fill(module, seed, scale=0.3):
    """Every parameter random (vectors around 1), so no piece is an identity by accident."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray(rng.standard_normal(x.shape) * scale + (len(x.shape) == 1), x.dtype)
              for x in leaves]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves), rest)


def reference_chain(qkv, finish, hidden1, step_embeds, b, anchor):
    """Anchor `anchor` of batch row `b`, drafted as the engine does: step 1 over every row
    (dense causal), then for j >= 2 one query at position anchor+j-1 attending to a KV cache
    holding the step-1 entries of rows <= anchor and the chain's own entries (a fixed-size
    cache with a validity mask, so one compilation serves every anchor).
    -> the anchor's hidden_outs [K, H]."""
    K, B, T, _ = step_embeds.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    q, k, v, res = qkv(step_embeds[0], hidden1, positions)
    out1 = finish(dense_attention(q, k, v, positions, positions), res)
    cache_k = jnp.concatenate([k[b:b + 1], jnp.zeros_like(k[b:b + 1, :K - 1])], axis=1)
    cache_v = jnp.concatenate([v[b:b + 1], jnp.zeros_like(v[b:b + 1, :K - 1])], axis=1)
    cache_pos = jnp.concatenate([jnp.arange(T), anchor + jnp.arange(1, K)])[None]
    hidden = jax.lax.dynamic_slice_in_dim(out1[b:b + 1], anchor, 1, axis=1)
    outs = [hidden[0, 0]]
    for j in range(1, K):
        pos = jnp.reshape(anchor + j, (1, 1))
        e = jax.lax.dynamic_slice_in_dim(step_embeds[j][b:b + 1], anchor, 1, axis=1)
        q, k, v, res = qkv(e, hidden, pos)
        cache_k = cache_k.at[:, T + j - 1].set(k[:, 0])
        cache_v = cache_v.at[:, T + j - 1].set(v[:, 0])
        valid = jnp.concatenate([jnp.arange(T) <= anchor, jnp.arange(1, K) <= j])[None]
        hidden = finish(dense_attention(q, cache_k, cache_v, pos, cache_pos, k_valid=valid), res)
        outs.append(hidden[0, 0])
    return jnp.stack(outs)
