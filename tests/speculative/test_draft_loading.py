"""A draft model named by path is read in its own format: a GGUF's quantized weights stay
quantized (in the target's float32 a 0.5B draft model is 2 GB and read at 4x its file's bytes
every draft step), multiplied against x rounded as the target's is; a folder in the target's
dtype."""
import jax
import numpy as np
from flax import nnx

from pallas_kernels.cpu_matmul import quant
from specjax.models import Llama, ModelConfig, save_hf_checkpoint
from specjax.models.gguf_checkpoint import gguf_metadata, gguf_tensors, write_gguf
from specjax.models.linear import is_quantized, with_activation_bits
from specjax.speculative.workers.loading import read_llama

CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=64)


def test_a_gguf_draft_keeps_its_quantized_weights_a_folder_takes_the_targets_dtype(tmp_path):
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    tensors = gguf_tensors(model)
    types = {n: "Q8_0" for n, a in tensors.items() if a.ndim == 2 and a.shape[0] % 32 == 0}
    meta = {**gguf_metadata(CONFIG), "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": [f"t{i}" for i in range(256)],
            "tokenizer.ggml.token_type": [1] * 256, "tokenizer.ggml.merges": []}
    path = write_gguf(tmp_path / "draft.gguf", meta, tensors, types)
    draft = read_llama(str(path), "bfloat16", model)
    assert is_quantized(draft) and draft.config.dtype == "float32"

    def x_bits(module):
        weights = [a for a in jax.tree.leaves(nnx.state(module)) if quant.is_quantized(a)]
        assert weights
        return {quant.x_bits(a) for a in weights}

    assert x_bits(draft) == {16}
    assert x_bits(read_llama(str(path), "bfloat16", with_activation_bits(draft, 8))) == {8}
    save_hf_checkpoint(model, tmp_path / "folder")
    folder = read_llama(str(tmp_path / "folder"), "bfloat16", model)
    assert not is_quantized(folder) and folder.config.dtype == "bfloat16"
    assert np.asarray(folder.embed[...]).dtype.name == "bfloat16"
