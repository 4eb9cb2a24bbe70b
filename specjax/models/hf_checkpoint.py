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
from safetensors import safe_open
from safetensors.numpy import save_file

from specjax.models.config import ModelConfig
from specjax.models.llama import Llama, layer_param_shapes

# specjax layer param -> (Hugging Face suffix after "model.layers.{i}.", transpose?)
_LAYER_NAMES = {
    "input_norm": ("input_layernorm.weight", False),
    "post_norm": ("post_attention_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "o_bias": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
    "gate_bias": ("mlp.gate_proj.bias", False),
    "up_bias": ("mlp.up_proj.bias", False),
    "down_bias": ("mlp.down_proj.bias", False),
}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file or tensor."""


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / name for name in weight_map.values()})
        for f in files:
            if not f.exists():
                raise FileNotFoundError(f"{f} is named by {index.name} but missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def read_safetensors(folder: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint folder as numpy arrays (bfloat16 via ml_dtypes)."""
    tensors: dict[str, np.ndarray] = {}
    for path in _safetensors_files(Path(folder)):
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def checked_shape(name: str, array: np.ndarray, expected: tuple[int, ...]) -> np.ndarray:
    if tuple(array.shape) != tuple(expected):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(array.shape)}, expected "
                              f"{tuple(expected)} from config.json")
    return array


def tensor_taker(tensors: dict[str, np.ndarray], np_dtype, where: str):
    """`take(name, expected, transpose=False)`: pop a tensor from `tensors`, check its shape
    (named in the error, in the file's own layout) and return it in our layout and dtype."""

    def take(name: str, expected: tuple[int, ...], transpose: bool = False) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"tensor {name!r} is missing from {where}")
        # Compare in the file's own layout so the message matches what the user sees on disk.
        file_shape = tuple(reversed(expected)) if transpose else expected
        array = checked_shape(name, tensors.pop(name), file_shape)
        return (array.T if transpose else array).astype(np_dtype)

    return take


def load_hf_checkpoint(path: str | os.PathLike, dtype: str | None = None) -> Llama:
    """Load a local Hugging Face Llama/Mistral/Qwen2/Qwen3 folder into a `Llama`.

    `dtype` overrides the checkpoint's (e.g. "float32" for parity checks). Never downloads.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder / 'config.json'} is missing")
    config = ModelConfig.from_json_file(folder / "config.json", dtype=dtype)
    tensors = read_safetensors(folder)
    np_dtype = jnp.dtype(config.dtype)

    take = tensor_taker(tensors, np_dtype, f"the checkpoint in {folder}")

    V, D, L = config.vocab_size, config.hidden_size, config.num_layers
    params = {"embed": take("model.embed_tokens.weight", (V, D)),
              "final_norm": take("model.norm.weight", (D,)), "layers": {}}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    else:
        params["lm_head"] = take("lm_head.weight", (D, V), transpose=True)
    for key, shape in layer_param_shapes(config).items():
        suffix, transpose = _LAYER_NAMES[key]
        params["layers"][key] = np.stack(
            [take(f"model.layers.{i}.{suffix}", shape, transpose) for i in range(L)])
    unexpected = sorted(n for n in tensors if not _IGNORED.match(n))
    if unexpected:
        raise CheckpointError(f"checkpoint has tensors this {config.model_type} config does not "
                              f"use: {', '.join(unexpected[:5])}"
                              + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""))
    return model_from_params(config, params)


def model_from_params(config: ModelConfig, params: dict) -> Llama:
    """Build a `Llama` from a pure dict of arrays without random-initialising it first."""
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state,
        {k: ({n: jnp.asarray(a) for n, a in v.items()} if isinstance(v, dict) else jnp.asarray(v))
         for k, v in params.items()})
    return nnx.merge(graphdef, state)


def save_hf_checkpoint(model: Llama, path: str | os.PathLike, dtype: str | None = None) -> None:
    """Write `config.json` + `model.safetensors` in the Hugging Face layout (transformers loads it)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config if dtype is None else model.config.replace(dtype=dtype)
    np_dtype = jnp.dtype(config.dtype)
    arr = lambda x: np.ascontiguousarray(np.asarray(x[...]).astype(np_dtype))
    tensors = {"model.embed_tokens.weight": arr(model.embed),
               "model.norm.weight": arr(model.final_norm)}
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = np.ascontiguousarray(arr(model.lm_head).T)
    for key, stacked in model.layer_params().items():
        suffix, transpose = _LAYER_NAMES[key]
        stacked = np.asarray(stacked).astype(np_dtype)
        for i in range(config.num_layers):
            tensors[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(
                stacked[i].T if transpose else stacked[i])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
