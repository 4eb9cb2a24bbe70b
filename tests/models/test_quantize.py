"""`quantize=`: a float checkpoint's projections become GGUF's blocks (the `gguf` package's
own quantization) in the kernel's layout, the LM head Q8_0, everything else untouched."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pallas_kernels.cpu_matmul import quant
from specjax import LLM
from specjax.models import Llama, ModelConfig
from specjax.models.quantize import quantize_model

CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=64,
                     tie_word_embeddings=True)


def gguf_round_trip(w: np.ndarray, qtype: str) -> np.ndarray:
    """W `[in, out]` quantized and dequantized by the gguf package, as llama.cpp would."""
    t = GGMLQuantizationType[qtype]
    return dequantize(quantize(np.ascontiguousarray(w.T), t), t).reshape(w.shape[::-1]).T


@pytest.mark.parametrize("kind, qtype", [("q4_0", "Q4_0"), ("q8_0", "Q8_0")])
def test_projections_become_the_gguf_packages_blocks(kind, qtype):
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    q = quantize_model(model, kind)
    layers, before = q.layer_params(), model.layer_params()
    for name in ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert quant.format_of(layers[name]).qtype == qtype, name
        for i in range(CONFIG.num_layers):
            np.testing.assert_array_equal(np.asarray(quant.dequantize(layers[name][i])),
                                          gguf_round_trip(np.asarray(before[name][i]), qtype))
    np.testing.assert_array_equal(np.asarray(layers["input_norm"]),
                                  np.asarray(before["input_norm"]))
    # the tied embedding: the LM head's layout at Q8_0, looked up by column
    assert quant.format_of(q.embed[...]) == quant.FORMATS["Q8_0"]
    head = gguf_round_trip(np.asarray(model.embed[...]).T, "Q8_0")
    assert q.head_weight().shape == (8, 2, 1088)  # 256 outputs, 64 inputs: 8 panels x 2 blocks
    np.testing.assert_array_equal(np.asarray(q.embed_tokens(jnp.asarray([[3, 200]]))),
                                  head.T[[[3, 200]]])
    assert not quant.is_quantized(model.embed[...])  # the original is left as it was


def test_bad_kinds_and_quantized_models_are_refused_by_name():
    model = quantize_model(Llama(CONFIG, rngs=nnx.Rngs(0)), "q8_0")
    with pytest.raises(ValueError, match="quantized already"):
        quantize_model(model, "q4_0")
    with pytest.raises(ValueError, match="quantize='q2_k' is not one of q8_0, q4_0"):
        LLM("bundled", quantize="q2_k")  # before anything loads
