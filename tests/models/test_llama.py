"""Model behaviour that parity with transformers does not pin down on its own."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import Llama, ModelConfig
from specjax.models.dense_greedy import dense_greedy

CONFIG = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model():
    return Llama(CONFIG, rngs=nnx.Rngs(0))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_kv_heads"):
        CONFIG.replace(num_kv_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        CONFIG.replace(hidden_size=0)
    with pytest.raises(ValueError, match="dtype"):
        CONFIG.replace(dtype="int8")
    with pytest.raises(ValueError, match="sliding_windows"):
        CONFIG.replace(sliding_windows=(4,))


def test_config_is_hashable_static_argument():
    assert hash(CONFIG) == hash(CONFIG.replace())


def test_capture_layer_out_of_range(model):
    with pytest.raises(ValueError, match="capture layer 4"):
        model.forward(jnp.zeros((1, 3), jnp.int32), capture_layers=(4,))


def test_capture_order_and_last_layer(model):
    tokens = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    logits, captured = model.forward(tokens, capture_layers=(3, 0))
    assert captured.shape == (2, 1, 5, CONFIG.hidden_size)
    # The last layer's residual stream is what the LM head reads.
    np.testing.assert_allclose(np.asarray(model.logits(captured[0])), np.asarray(logits),
                               atol=1e-5)
    assert not np.allclose(np.asarray(captured[0]), np.asarray(captured[1]))


def test_sliding_window_limits_what_a_token_sees():
    # One layer with a window of 2: the last position sees only the last two tokens.
    one = CONFIG.replace(num_layers=1, sliding_windows=(2,))
    a = jnp.asarray([[7, 8, 9, 1, 2]], jnp.int32)
    b = jnp.asarray([[3, 4, 5, 1, 2]], jnp.int32)
    windowed = Llama(one, rngs=nnx.Rngs(1))
    np.testing.assert_allclose(np.asarray(windowed(a))[0, -1], np.asarray(windowed(b))[0, -1],
                               atol=1e-6)
    full = Llama(one.replace(sliding_windows=None), rngs=nnx.Rngs(1))
    assert not np.allclose(np.asarray(full(a))[0, -1], np.asarray(full(b))[0, -1])


def test_dense_greedy_matches_argmax_chain(model):
    prompt = [1, 2, 3]
    out = dense_greedy(model, prompt, 5)
    seq = list(prompt)
    for _ in range(5):
        seq.append(int(jnp.argmax(model(jnp.asarray([seq], jnp.int32))[0, -1])))
    assert out == seq[3:]


def test_dense_greedy_stops_after_eos(model):
    free = dense_greedy(model, [1, 2, 3], 6)
    eos = free[2]
    stopped = dense_greedy(model, [1, 2, 3], 6, eos_token_ids=(eos,))
    assert stopped == free[:free.index(eos) + 1]


def test_dense_greedy_rejects_overlong(model):
    with pytest.raises(ValueError, match="context of 64"):
        dense_greedy(model, [1] * 60, 10)


def test_jit_through_split_merge_traces_params(model):
    graphdef, state = nnx.split(model)
    calls = []

    @jax.jit
    def f(state, tokens):
        calls.append(1)
        return nnx.merge(graphdef, state)(tokens)

    tokens = jnp.asarray([[1, 2, 3]], jnp.int32)
    f(state, tokens)
    scaled = jax.tree.map(lambda x: x * 1.01, state)
    f(scaled, tokens)  # new parameter values, same shapes: no retrace
    assert len(calls) == 1


def test_unstacked_layout_computes_the_same(model):
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)
    flat = model.unstacked()
    assert model.stacked and not flat.stacked and flat.unstacked() is flat
    a_logits, a_captured = model.forward(tokens, capture_layers=(1, 3))
    b_logits, b_captured = flat.forward(tokens, capture_layers=(1, 3))
    np.testing.assert_allclose(np.asarray(a_logits), np.asarray(b_logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(a_captured), np.asarray(b_captured), atol=1e-5)
    for name, stacked in model.layer_params().items():  # same arrays, other layout
        np.testing.assert_array_equal(np.asarray(flat.layer_params()[name]), np.asarray(stacked))


def test_inference_layouts_compute_the_same(model):
    """Fused q/k/v and gate/up, scanned (the engine's default) or unrolled: the same logits,
    captured streams and checkpoint-named parameters as the model they came from."""
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)
    want_logits, want_captured = model.forward(tokens, capture_layers=(0, 2))
    for scan in (True, False):
        m = model.for_inference(scan_layers=scan)
        assert m.fused and m.stacked == scan and m.for_inference(scan_layers=scan) is m
        logits, captured = m.forward(tokens, capture_layers=(0, 2))
        np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-5)
        np.testing.assert_allclose(np.asarray(captured), np.asarray(want_captured), atol=1e-5)
        assert sorted(m.layer_params()) == sorted(model.layer_params())
