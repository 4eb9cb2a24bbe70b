"""MTP modules: the split decoder layer equals the target's, the module equals a hand-written
DeepSeek-V3 composition, the split pieces work with a KV cache, the training chain's shift,
and MTP (D modules) vs MTP-Eagle (one module reused)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import Llama, ModelConfig
from specjax.models.llama import decoder_layer, dense_attention, layer_param_shapes, rms_norm
from specjax.models.rope import rope_tables
from specjax.models.mtp_head import (MTPHeads, MTPModule, layer_finish, layer_qkv,
                                          target_lm_head)

CONFIG = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-5)
# Every optional branch of the layer switched on, with non-trivial values.
FULL = CONFIG.replace(qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=True)
B, T = 2, 6


def randn(rng, *shape, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def random_module(make, seed=1):
    """Build `make()` abstractly and fill every parameter with random values (vectors --
    norms, biases -- around 1): no eager random init, which is slow to compile on a CPU."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    leaves, tree = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    leaves = [1 + randn(rng, *x.shape, scale=0.3) if len(x.shape) == 1
              else randn(rng, *x.shape, scale=0.3) for x in leaves]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    embeds, hidden = randn(rng, B, T, 16), randn(rng, B, T, 16)
    lm_head = randn(rng, 16, 40, scale=0.3)
    positions = jnp.broadcast_to(jnp.arange(T) + 3, (B, T))
    return embeds, hidden, lm_head, positions


@pytest.mark.parametrize("config", [CONFIG, FULL], ids=["plain", "biases_qknorm"])
def test_split_layer_equals_the_target_decoder_layer(config, data):
    x, _, _, positions = data
    rng = np.random.default_rng(0)
    lp = {name: randn(rng, *shape, scale=0.3) + (1.0 if name.endswith("norm") else 0.0)
          for name, shape in layer_param_shapes(config).items()}
    cos, sin = rope_tables(config, positions)
    attend = lambda q, k, v, s: (dense_attention(q, k, v, positions, positions), s)
    want, _ = decoder_layer(config, lp, x, cos, sin, attend, None)
    q, k, v = layer_qkv(config, lp, x, cos, sin)
    got = layer_finish(config, lp, dense_attention(q, k, v, positions, positions), x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("config", [CONFIG, FULL], ids=["plain", "biases_qknorm"])
def test_module_is_the_deepseek_v3_composition(config, data):
    embeds, hidden, lm_head, positions = data
    module = random_module(lambda: MTPModule(config, nnx.Rngs(0)))
    logits, hidden_out = module.forward(embeds, hidden, lm_head, positions)
    # By hand: eh_proj([enorm(e) | hnorm(h)]), the target's decoder layer, final norm, lm_head.
    eps = config.rms_norm_eps
    x = jnp.concatenate([rms_norm(embeds, module.enorm[...], eps),
                         rms_norm(hidden, module.hnorm[...], eps)], -1) @ module.eh_proj[...]
    cos, sin = rope_tables(config, positions)
    lp = {n: p[...] for n, p in module.block.items()}
    want_hidden, _ = decoder_layer(config, lp, x, cos, sin, lambda q, k, v, s: (
        dense_attention(q, k, v, positions, positions), s), None)
    want_logits = rms_norm(want_hidden, module.final_norm[...], eps) @ lm_head
    np.testing.assert_allclose(hidden_out, want_hidden, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert logits.shape == (B, T, 40) and logits.dtype == jnp.float32


def test_split_pieces_with_a_kv_cache_equal_the_dense_forward(data):
    embeds, hidden, lm_head, positions = data
    module = random_module(lambda: MTPModule(FULL, nnx.Rngs(0)))
    P = T - 2

    @nnx.jit  # one compilation instead of one per eager op and shape
    def run(module, embeds, hidden, lm_head, positions):
        dense_logits, dense_hidden = module.forward(embeds, hidden, lm_head, positions)
        q, k, v, res = module.qkv_and_residual(embeds[:, :P], hidden[:, :P], positions[:, :P])
        q2, k2, v2, res2 = module.qkv_and_residual(embeds[:, P:], hidden[:, P:],
                                                   positions[:, P:])
        attn = dense_attention(q2, jnp.concatenate([k, k2], 1), jnp.concatenate([v, v2], 1),
                               positions[:, P:], positions)
        tail = module.finish(attn, res2)
        out, state = module.run_layer(embeds, hidden, positions, lambda q, k, v, s: (
            dense_attention(q, k, v, positions, positions), s + 1), 0)
        return dict(dense_logits=dense_logits, dense_hidden=dense_hidden, res=res,
                    fused=module.fuse(embeds[:, :P], hidden[:, :P]), tail=tail,
                    tail_logits=module.logits(tail, lm_head), out=out, state=state)

    r = run(module, embeds, hidden, lm_head, positions)
    np.testing.assert_array_equal(r["res"], r["fused"])  # the residual is eh_proj's output
    np.testing.assert_allclose(r["tail"], r["dense_hidden"][:, P:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r["tail_logits"], r["dense_logits"][:, P:], rtol=1e-5, atol=1e-5)
    assert int(r["state"]) == 1
    np.testing.assert_allclose(r["out"], r["dense_hidden"], rtol=1e-6, atol=1e-6)


def _count(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(tree, nnx.Param)))


def _chain(modules, embeds, hidden, lm_head, positions):
    """The DeepSeek-V3 chain by hand: step k reads the embedding of token i+k+1."""
    out = []
    for k, module in enumerate(modules):
        shifted = jnp.pad(embeds[:, k + 1:], ((0, 0), (0, k + 1), (0, 0)))
        logits, hidden = module.forward(shifted, hidden, lm_head, positions)
        out.append(logits)
    return jnp.stack(out)


def test_mtp_eagle_reuses_one_module_mtp_has_one_per_step(data):
    embeds, hidden, lm_head, positions = data
    one_module = nnx.eval_shape(lambda: MTPModule(CONFIG, nnx.Rngs(0)))
    eagle = random_module(lambda: MTPHeads(CONFIG, 1, nnx.Rngs(0)), seed=2)
    vanilla = random_module(lambda: MTPHeads(CONFIG, 3, nnx.Rngs(0)), seed=3)
    assert _count(eagle) == _count(one_module)
    assert _count(vanilla) == 3 * _count(one_module)
    assert eagle.reuses_one_module and eagle.max_draft_steps() is None
    assert not vanilla.reuses_one_module and vanilla.max_draft_steps() == 3
    assert all(eagle.module_for_step(k) is eagle.modules[0] for k in range(5))

    logits, hiddens = eagle.forward(embeds, hidden, lm_head, num_steps=3, positions=positions)
    assert logits.shape == (3, B, T, 40) and hiddens.shape == (3, B, T, 16)
    np.testing.assert_allclose(logits, _chain([eagle.modules[0]] * 3, embeds, hidden, lm_head,
                                              positions), rtol=1e-5, atol=1e-5)
    logits, _ = vanilla.forward(embeds, hidden, lm_head, positions=positions)
    assert logits.shape[0] == 3
    np.testing.assert_allclose(logits, _chain(list(vanilla.modules), embeds, hidden, lm_head,
                                              positions), rtol=1e-5, atol=1e-5)
    # ... and the modules really differ, so step 1 is not module 0 again.
    reused = _chain([vanilla.modules[0]] * 3, embeds, hidden, lm_head, positions)
    assert not np.allclose(logits[1], reused[1], atol=1e-3)
    with pytest.raises(ValueError, match="draft step 3 needs MTP module 3, but there are only 3"):
        vanilla.forward(embeds, hidden, lm_head, num_steps=4)
    with pytest.raises(ValueError, match="num_modules must be a positive int"):
        MTPHeads(CONFIG, 0, nnx.Rngs(0))


def test_chain_step_k_reads_the_token_k_plus_one_ahead(data):
    """Changing token j's embedding changes step 0 only at positions >= j-1 and step 1 only at
    positions >= j-2 (causal attention over inputs shifted by 1 and 2)."""
    embeds, hidden, lm_head, positions = data
    heads = random_module(lambda: MTPHeads(CONFIG, 2, nnx.Rngs(0)), seed=4)
    j = 4
    before, _ = heads.forward(embeds, hidden, lm_head, positions=positions)
    after, _ = heads.forward(embeds.at[:, j].add(1.0), hidden, lm_head, positions=positions)
    changed = np.asarray(jnp.abs(after - before).max(axis=(1, 3)) > 1e-6)  # [step, T]
    np.testing.assert_array_equal(changed[0], np.arange(T) >= j - 1)
    np.testing.assert_array_equal(changed[1], np.arange(T) >= j - 2)


def test_parameters_use_the_target_layer_names():
    module = nnx.eval_shape(lambda: MTPModule(FULL, nnx.Rngs(0)))
    assert set(module.block.keys()) == set(layer_param_shapes(FULL))
    assert module.eh_proj.shape == (32, 16)
    assert {module.enorm.shape, module.hnorm.shape, module.final_norm.shape} == {(16,)}


@pytest.mark.parametrize("tied", [False, True])
def test_target_lm_head(tied):
    target = random_module(lambda: Llama(CONFIG.replace(tie_word_embeddings=tied),
                                         rngs=nnx.Rngs(0)))
    head = target_lm_head(target)
    assert head.shape == (16, 40)
    h = randn(np.random.default_rng(0), 1, 3, 16)
    np.testing.assert_allclose(rms_norm(h, target.final_norm[...], CONFIG.rms_norm_eps) @ head,
                               target.logits(h), rtol=1e-6, atol=1e-6)
