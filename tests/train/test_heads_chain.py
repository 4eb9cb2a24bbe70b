"""The training-time-test chain against the engine's per-anchor drafting (brute force), and the
dense vanilla-MTP chain against `MTPHeads.forward`."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from head_helpers import EAGLE, random_fill, reference_chain
from specjax.models.mtp_head import target_lm_head
from specjax.train.heads.chain import chain_hidden_outs, run_chain, teacher_forced_step_tokens
from specjax.train.heads.spec import HeadSpec, new_head


@pytest.mark.parametrize("kind", ["eagle3", "mtp_eagle"])
def test_ttt_attention_equals_per_anchor_engine_chain(target, kind):
    rng = np.random.default_rng(1)
    K, B, T, H = 3, 2, 6, 32
    step_embeds = jnp.asarray(rng.standard_normal((K, B, T, H)), jnp.float32)
    hidden1 = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)
    if kind == "eagle3":
        spec = EAGLE
        head = random_fill(new_head(spec, target, 0), seed=2)
        qkv, finish = head.qkv_and_residual, head.finish
    else:
        spec = HeadSpec(kind="mtp", depth=K, num_layers=8, num_modules=1)
        module = random_fill(new_head(spec, target, 0), seed=3).modules[0]
        qkv, finish = module.qkv_and_residual, module.finish
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    got = jnp.stack(chain_hidden_outs([qkv] * K, [finish] * K, hidden1, step_embeds, positions))
    reference = jax.jit(partial(reference_chain, qkv, finish), static_argnums=2)  # b static
    for b in range(B):
        for anchor in range(T):
            want = reference(hidden1, step_embeds, b, anchor)
            np.testing.assert_allclose(np.asarray(got[:, b, anchor]), np.asarray(want),
                                       rtol=2e-5, atol=2e-5)


def test_dense_chain_matches_mtp_heads_forward(target, window):
    """Vanilla MTP trains the dense chain of `MTPHeads.forward`."""
    spec = HeadSpec(kind="mtp", depth=3, num_layers=8, num_modules=3)
    mtp = random_fill(new_head(spec, target, 0), seed=4)
    _, captured = target.forward(window, capture_layers=spec.needed_layers)
    T = window.shape[1] - 1
    got = run_chain(spec, mtp, target, captured, teacher_forced_step_tokens(window, 3))
    want, _ = mtp.forward(target.embed_tokens(window[:, :T + 1])[:, :T + 1],
                          captured[-1], target_lm_head(target))
    # forward's row i of step k predicts token i+k+2 from embeds shifted by k+1: rows < T-k-1
    # have a real input token in both.
    for k in range(3):
        rows = T - k - 1
        np.testing.assert_allclose(np.asarray(got[k][:, :rows]), np.asarray(want[k][:, :rows]),
                                   rtol=1e-5, atol=1e-5)

