"""MTP head folders: exact round trip, bfloat16 save cast back to the target's dtype, and clear
errors naming the field or tensor that does not fit the target."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from specjax.models import CheckpointError, ModelConfig
from specjax.models.mtp_checkpoint import load_mtp_heads, save_mtp_heads
from specjax.models.mtp_head import MTPHeads

CONFIG = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-5)


def random_heads(config, num_modules, seed=1):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MTPHeads(config, num_modules, nnx.Rngs(0))))
    leaves, tree = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray(rng.standard_normal(x.shape) * 0.3 + (len(x.shape) == 1), jnp.float32)
              for x in leaves]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def leaves(module):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(module, nnx.Param))]


@pytest.fixture(scope="module")
def heads():
    return random_heads(CONFIG, 3)


def test_round_trip_is_exact(heads, tmp_path):
    save_mtp_heads(heads, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["SpecjaxMTPHeads"]
    assert config["num_nextn_predict_layers"] == 3 and config["hidden_size"] == 16
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"layers.2.enorm", "layers.0.hnorm", "layers.1.eh_proj", "layers.0.block.q_proj",
            "layers.2.final_norm"} <= names
    loaded = load_mtp_heads(tmp_path, CONFIG)
    assert loaded.num_modules == 3
    for a, b in zip(leaves(heads), leaves(loaded), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bfloat16_save_loads_in_the_target_dtype(heads, tmp_path):
    save_mtp_heads(heads, tmp_path, dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_mtp_heads(tmp_path, CONFIG)
    for a, b in zip(leaves(heads), leaves(loaded), strict=True):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(a.astype(jnp.bfloat16).astype(np.float32), b)


def test_one_module_mtp_eagle(tmp_path):
    save_mtp_heads(random_heads(CONFIG, 1), tmp_path)
    assert load_mtp_heads(tmp_path, CONFIG).reuses_one_module


def test_wrong_hidden_size_names_the_field(heads, tmp_path):
    save_mtp_heads(heads, tmp_path)
    with pytest.raises(CheckpointError, match="hidden_size=16 does not match the target's "
                                              "hidden_size=32"):
        load_mtp_heads(tmp_path, CONFIG.replace(hidden_size=32))


def test_wrong_tensor_shape_names_the_tensor(heads, tmp_path):
    save_mtp_heads(heads, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["layers.1.eh_proj"] = tensors["layers.1.eh_proj"][:, :8]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'layers.1.eh_proj' has shape \(32, 8\), expected "
                                         r"\(32, 16\)"):
        load_mtp_heads(tmp_path, CONFIG)


def test_missing_and_extra_tensors(heads, tmp_path):
    save_mtp_heads(heads, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["layers.2.block.down_proj"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="'layers.2.block.down_proj' is missing"):
        load_mtp_heads(tmp_path, CONFIG)
    # The target has q/k/v biases the saved modules lack: the first missing one is named.
    save_mtp_heads(heads, tmp_path)
    with pytest.raises(ValueError, match="attention_bias=False does not match"):
        load_mtp_heads(tmp_path, CONFIG.replace(qkv_bias=True))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["layers.0.block.extra"] = np.zeros((2,), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.0.block.extra"):
        load_mtp_heads(tmp_path, CONFIG)
