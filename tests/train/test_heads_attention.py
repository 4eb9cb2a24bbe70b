"""The head-training attention variants against the shared `dense_attention`: where the mask
is causal they agree with it, and a chain step equals per-anchor attention over the step-1
prefix plus that anchor's own keys."""
import jax.numpy as jnp
import numpy as np

from specjax.models import dense_attention
from specjax.train.heads.attention import chain_attention, masked_attention

B, T, HEADS, KV, HD = 2, 5, 4, 2, 8


def qkv(seed, rows=T):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((B, rows, h, HD)), jnp.float32)
            for h in (HEADS, KV, KV)]


def test_causal_mask_equals_dense_attention():
    q, k, v = qkv(0)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    want = dense_attention(q, k, v, positions, positions)
    np.testing.assert_allclose(masked_attention(q, k, v, jnp.tril(jnp.ones((T, T), bool))), want,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(chain_attention(q, k, v), want, rtol=1e-5, atol=1e-6)


def test_chain_step_equals_per_anchor_attention():
    q, k1, v1 = qkv(1)
    J = 2
    diag = [qkv(10 + j)[1:] for j in range(J)]
    got = chain_attention(q, k1, v1, [d[0] for d in diag], [d[1] for d in diag])
    for t in range(T):
        keys = jnp.concatenate([k1] + [d[0][:, t:t + 1] for d in diag], axis=1)
        values = jnp.concatenate([v1] + [d[1][:, t:t + 1] for d in diag], axis=1)
        visible = jnp.concatenate([jnp.arange(T) <= t, jnp.ones((J,), bool)])
        k_pos = jnp.broadcast_to(jnp.arange(T + J), (B, T + J))
        want = dense_attention(q[:, t:t + 1], keys, values, jnp.full((B, 1), T + J), k_pos,
                               k_valid=jnp.broadcast_to(visible, (B, T + J)))
        np.testing.assert_allclose(got[:, t:t + 1], want, rtol=1e-5, atol=1e-6)
