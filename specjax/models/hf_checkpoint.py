"""Hugging Face checkpoint folders <-> `Llama`, without torch and without any download.

A folder holds `config.json` and either `model.safetensors`, a sharded set named by
`model.safetensors.index.json`, or other `*.safetensors` files. Hugging Face stores linear
weights as `[out, in]`; specjax stores `[in, out]` stacked over layers.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.checkpoint_io import (checkpoint_folder, module_from_params, read_safetensors,
                                          refuse_leftovers, save_safetensors, tensor_taker)
from specjax.models.bamba import Bamba, layer_shapes
from specjax.models.config import ModelConfig
from specjax.models.families import family_for_hf
from specjax.models.llama import Llama, layer_param_shapes
from specjax.models.roles import hf_layer_names

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LLAMA_NAMES = hf_layer_names(sandwich_norms=False)   # what Bamba's attention layers share


def layer_names(config: ModelConfig) -> dict[str, tuple[str, bool]]:
    """specjax layer param -> (Hugging Face suffix, transpose?) for this config."""
    return hf_layer_names(config.sandwich_norms)


def norm_offset(config: ModelConfig) -> float:
    """What a checkpoint's norm weights lack: Gemma scales by (1 + w), specjax by its weight."""
    return family_for_hf(config.model_type).norm_offset


def _offset_norms(params: dict, offset: float) -> dict:
    """Every norm weight (`*norm`, any depth of `params`) plus `offset`."""
    if not offset:
        return params
    return {name: _offset_norms(value, offset) if isinstance(value, dict)
            else value + offset if name.endswith("norm") else value
            for name, value in params.items()}
# Bamba's names where they differ from Llama's (its attention layers share the rest); the
# convolution's `[C, 1, K]` weight is stored `[K, C]`.
_BAMBA_NAMES = {
    "post_norm": ("pre_ff_layernorm.weight", False),
    **{f"{p}_{kind}": (f"feed_forward.{p}_proj.{'weight' if kind == 'proj' else 'bias'}",
                       kind == "proj")
       for p in ("gate", "up", "down") for kind in ("proj", "bias")},
    "in_proj": ("mamba.in_proj.weight", True),
    "conv_weight": ("mamba.conv1d.weight", None),
    "conv_bias": ("mamba.conv1d.bias", False),
    "dt_bias": ("mamba.dt_bias", False),
    "A_log": ("mamba.A_log", False),
    "D": ("mamba.D", False),
    "mixer_norm": ("mamba.norm.weight", False),
    "out_proj": ("mamba.out_proj.weight", True),
}


def load_hf_checkpoint(path: str | os.PathLike, dtype: str | None = None) -> Llama:
    """Load a local Hugging Face folder of a supported family (`families.FAMILIES`) into a
    `Llama` (a hybrid's, Bamba's, into a `Bamba`).

    `dtype` overrides the checkpoint's (e.g. "float32" for parity checks). Never downloads.
    """
    folder = checkpoint_folder(path, "checkpoint")
    config = ModelConfig.from_json_file(folder / "config.json", dtype=dtype)
    tensors = read_safetensors(folder)
    np_dtype = jnp.dtype(config.dtype)

    take = tensor_taker(tensors, np_dtype, f"the checkpoint in {folder}")

    V, D = config.vocab_size, config.hidden_size
    hybrid = config.is_hybrid
    params = {"embed": take("model.embed_tokens.weight", (V, D)),
              "final_norm": take("model.final_layernorm.weight" if hybrid else "model.norm.weight",
                                 (D,))}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    else:
        params["lm_head"] = take("lm_head.weight", (D, V), transpose=True)
    params["layers"] = (take_bamba_layers(config, take) if hybrid
                        else take_layers(config, take, "model.layers."))
    refuse_leftovers((n for n in tensors if not _IGNORED.match(n)),
                     f"checkpoint has tensors this {config.model_type} config does not use")
    return model_from_params(config, _offset_norms(params, norm_offset(config)))


def take_layers(config: ModelConfig, take, prefix: str) -> dict[str, np.ndarray]:
    """Every layer's parameters, stacked `[L, ...]`, from tensors named
    `{prefix}{i}.<Hugging Face suffix>` (`take` from `tensor_taker`)."""
    names = layer_names(config)
    return {key: np.stack([take(f"{prefix}{i}.{names[key][0]}", shape, names[key][1])
                           for i in range(config.num_layers)])
            for key, shape in layer_param_shapes(config).items()}


def _bamba_name(key: str) -> tuple[str, bool | None]:
    return _BAMBA_NAMES.get(key) or _LLAMA_NAMES[key]


def take_bamba_layers(config: ModelConfig, take) -> dict[int, dict[str, np.ndarray]]:
    """A Bamba's layers, one dict per layer (their kinds differ)."""
    layers = {}
    for i in range(config.num_layers):
        layer = {}
        for key, shape in layer_shapes(config, i).items():
            suffix, transpose = _bamba_name(key)
            name = f"model.layers.{i}.{suffix}"
            if transpose is None:  # conv1d [C, 1, K] -> [K, C]
                K, C = shape
                layer[key] = take(name, (C, 1, K)).reshape(C, K).T
            else:
                layer[key] = take(name, shape, transpose)
        layers[i] = layer
    return layers


def bamba_layer_tensors(model: Bamba, np_dtype) -> dict[str, np.ndarray]:
    """The inverse of `take_bamba_layers`."""
    tensors = {}
    for i, layer in enumerate(model.unstacked(fused=False).layers):
        for key, param in layer.items():
            suffix, transpose = _bamba_name(key)
            array = np.asarray(param[...]).astype(np_dtype)
            if transpose is None:
                array = array.T[:, None, :]
            elif transpose:
                array = array.T
            tensors[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(array)
    return tensors


def layer_tensors(model: Llama, np_dtype, prefix: str) -> dict[str, np.ndarray]:
    """The inverse of `take_layers`: `{prefix}{i}.<suffix>` -> `[out, in]` arrays."""
    tensors, names = {}, layer_names(model.config)
    offset = norm_offset(model.config)
    for key, stacked in model.layer_params().items():
        suffix, transpose = names[key]
        stacked = np.asarray(stacked).astype(np.float32)
        stacked = (stacked - offset if key.endswith("norm") else stacked).astype(np_dtype)
        for i in range(model.config.num_layers):
            tensors[f"{prefix}{i}.{suffix}"] = np.ascontiguousarray(
                stacked[i].T if transpose else stacked[i])
    return tensors


def model_from_params(config: ModelConfig, params: dict) -> Llama:
    """Build a `Llama` from a pure dict of arrays without random-initialising it first."""
    cls = Bamba if config.is_hybrid else Llama
    return module_from_params(lambda: cls(config, rngs=nnx.Rngs(0)), params)


def save_hf_checkpoint(model: Llama, path: str | os.PathLike, dtype: str | None = None) -> None:
    """Write `config.json` + `model.safetensors` in the Hugging Face layout (transformers loads it)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config if dtype is None else model.config.replace(dtype=dtype)
    np_dtype = jnp.dtype(config.dtype)
    arr = lambda x: np.ascontiguousarray(np.asarray(x[...]).astype(np_dtype))
    hybrid = config.is_hybrid
    final_norm = np.asarray(model.final_norm[...]).astype(np.float32) - norm_offset(config)
    tensors = {"model.embed_tokens.weight": arr(model.embed),
               "model.final_layernorm.weight" if hybrid else "model.norm.weight":
                   final_norm.astype(np_dtype)}
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = np.ascontiguousarray(arr(model.lm_head).T)
    tensors.update(bamba_layer_tensors(model, np_dtype) if hybrid
                   else layer_tensors(model, np_dtype, "model.layers."))
    save_safetensors(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
