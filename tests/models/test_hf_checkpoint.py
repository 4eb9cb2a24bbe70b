"""Loading errors name the problem; sharded folders load; save -> load round-trips exactly."""
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from specjax.models import (CheckpointError, Llama, ModelConfig, load_hf_checkpoint,
                            read_safetensors, save_hf_checkpoint)

CONFIG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=8, qkv_bias=True, model_type="qwen2")
TOKENS = jnp.asarray([[1, 5, 9, 2, 7, 3]], jnp.int32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = Llama(CONFIG, rngs=nnx.Rngs(3))
    folder = tmp_path_factory.mktemp("ckpt")
    save_hf_checkpoint(model, folder)
    return model, folder


@pytest.fixture
def copy(saved, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(saved[1], folder)
    return folder


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_round_trip_is_exact(saved):
    model, folder = saved
    again = load_hf_checkpoint(folder)
    assert again.config == model.config
    np.testing.assert_array_equal(np.asarray(again(TOKENS)), np.asarray(model(TOKENS)))


def test_sharded_index_loads(saved, tmp_path):
    model, folder = saved
    tensors = read_safetensors(folder)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(folder / "config.json", tmp_path)
    again = load_hf_checkpoint(tmp_path)
    np.testing.assert_array_equal(np.asarray(again(TOKENS)), np.asarray(model(TOKENS)))


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nope")


def test_missing_config(copy):
    (copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(copy)


def test_missing_weights(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf_checkpoint(copy)


def test_missing_shard(copy):
    (copy / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_hf_checkpoint(copy)


def test_unsupported_model_type(copy):
    _edit_config(copy, model_type="gpt2")
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_hf_checkpoint(copy)


def test_unsupported_architecture(copy):
    _edit_config(copy, architectures=["Qwen2ForSequenceClassification"])
    with pytest.raises(ValueError, match="Qwen2ForSequenceClassification"):
        load_hf_checkpoint(copy)


def test_unsupported_rope_scaling(copy):
    _edit_config(copy, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        load_hf_checkpoint(copy)


def test_shape_mismatch_names_tensor_and_shapes(copy):
    _edit_config(copy, intermediate_size=32)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*"
                                              r"\(24, 16\).*expected \(32, 16\)"):
        load_hf_checkpoint(copy)


def test_missing_tensor_named(copy):
    tensors = read_safetensors(copy)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias.*missing"):
        load_hf_checkpoint(copy)


def test_unexpected_tensor_named(copy):
    tensors = read_safetensors(copy)
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(8, np.float32)
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match="q_norm"):
        load_hf_checkpoint(copy)


def test_dtype_override(saved):
    _, folder = saved
    model = load_hf_checkpoint(folder, dtype="bfloat16")
    assert model.layers["q_proj"][...].dtype == jnp.bfloat16
