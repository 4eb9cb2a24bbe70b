"""MTP head folders <-> `MTPHeads` (safetensors; the specjax layout, never downloads).

A folder holds `config.json` and `model.safetensors`. The modules are built for one target: their
decoder block has exactly the target's layer structure and the LM head is the target's (not
stored), so loading needs the target's `ModelConfig` and checks every field and tensor shape
against it. Tensors, in specjax's `[in, out]` layout (`"weight_layout": "in_out"` in
config.json), for each module k = 0 .. num_nextn_predict_layers - 1:

    layers.{k}.enorm                 [H]
    layers.{k}.hnorm                 [H]
    layers.{k}.eh_proj               [2H, H]      (input: concat(enorm(embeds), hnorm(hidden)))
    layers.{k}.block.<name>          a `Llama` layer's parameter (input_norm, q_proj [H, heads*hd],
                                     k_proj, v_proj, o_proj, post_norm, gate_proj, up_proj,
                                     down_proj, and the target's biases / q-k norms if it has them)
    layers.{k}.final_norm            [H]

config.json: {"architectures": ["SpecjaxMTPHeads"], "num_nextn_predict_layers", "hidden_size",
"intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
"torch_dtype", ...}. The weights may be saved in a narrower dtype (bfloat16 keeps three modules
for the bundled 7M target well under 10 MB); loading casts them to the target's dtype.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.config import DTYPES, ModelConfig
from specjax.models.checkpoint_io import (CheckpointError, checkpoint_folder, module_from_params,
                                          read_config, read_safetensors, refuse_leftovers,
                                          save_safetensors, tensor_taker)
from specjax.models.llama import layer_param_shapes
from specjax.models.mtp_head import MTPHeads

ARCHITECTURE = "SpecjaxMTPHeads"
WEIGHTS_NAME = "model.safetensors"

# config.json field -> the target ModelConfig attribute it must equal
_CONFIG_FIELDS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "attention_bias": "qkv_bias",
    "o_bias": "o_bias",
    "mlp_bias": "mlp_bias",
    "qk_norm": "qk_norm",
}


def mtp_config_dict(config: ModelConfig, num_modules: int, dtype: str) -> dict:
    """The config.json of `num_modules` MTP modules for a target with `config`."""
    hf = {"architectures": [ARCHITECTURE], "num_nextn_predict_layers": num_modules,
          "weight_layout": "in_out", "torch_dtype": dtype, "rms_norm_eps": config.rms_norm_eps}
    for field, attr in _CONFIG_FIELDS.items():
        hf[field] = getattr(config, attr)
    return hf


def mtp_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One module's tensors (names after `layers.{k}.`) and their shapes."""
    H = config.hidden_size
    shapes = {"enorm": (H,), "hnorm": (H,), "eh_proj": (2 * H, H)}
    shapes.update({f"block.{name}": shape for name, shape in layer_param_shapes(config).items()})
    shapes["final_norm"] = (H,)
    return shapes


def save_mtp_heads(heads: MTPHeads, folder: str | os.PathLike, dtype: str | None = None) -> None:
    """Write `config.json` + `model.safetensors`; `dtype` (e.g. "bfloat16") converts the weights
    on the way out (default: the heads' own dtype)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype or heads.config.dtype
    if dtype not in DTYPES:
        raise ValueError(f"save dtype must be one of {DTYPES}, got {dtype!r}")
    np_dtype = jnp.dtype(dtype)
    tensors = {}
    for k, module in enumerate(heads.modules):
        arrays = {"enorm": module.enorm, "hnorm": module.hnorm, "eh_proj": module.eh_proj,
                  "final_norm": module.final_norm}
        arrays.update({f"block.{name}": p for name, p in module.block.items()})
        for name, value in arrays.items():
            tensors[f"layers.{k}.{name}"] = np.ascontiguousarray(
                np.asarray(value[...]).astype(np_dtype))
    save_safetensors(tensors, folder / WEIGHTS_NAME, metadata={"format": "specjax-mtp"})
    hf = mtp_config_dict(heads.config, heads.num_modules, dtype)
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def load_mtp_heads(folder: str | os.PathLike, target_config: ModelConfig,
                   dtype: str | None = None) -> MTPHeads:
    """Load MTP heads saved by `save_mtp_heads` for a target with `target_config`. The weights
    are cast to `dtype` (default: the target's). Any config field or tensor that does not fit the
    target raises a `CheckpointError` (a ValueError) naming it."""
    folder = checkpoint_folder(folder, "MTP head")
    hf = read_config(folder)
    if ARCHITECTURE not in hf.get("architectures", []):
        raise CheckpointError(f"{folder / 'config.json'}: architectures {hf.get('architectures')} "
                              f"does not name {ARCHITECTURE}")
    if hf.get("weight_layout", "in_out") != "in_out":
        raise CheckpointError(f"{folder / 'config.json'}: weight_layout "
                              f"{hf['weight_layout']!r} is not 'in_out'")
    num_modules = hf.get("num_nextn_predict_layers")
    if isinstance(num_modules, bool) or not isinstance(num_modules, int) or num_modules < 1:
        raise CheckpointError(f"{folder / 'config.json'}: num_nextn_predict_layers must be a "
                              f"positive int, got {num_modules!r}")
    for field, attr in _CONFIG_FIELDS.items():
        want = getattr(target_config, attr)
        got = hf.get(field, want if isinstance(want, bool) else None)
        if got != want:
            raise CheckpointError(f"{folder / 'config.json'}: {field}={got!r} does not match the "
                                  f"target's {attr}={want!r}")
    config = target_config if dtype is None else target_config.replace(dtype=dtype)
    tensors = read_safetensors(folder)
    take = tensor_taker(tensors, jnp.dtype(config.dtype), f"the MTP heads in {folder}")
    modules = {}
    for k in range(num_modules):
        flat = {name: take(f"layers.{k}.{name}", shape)
                for name, shape in mtp_param_shapes(config).items()}
        module = {name: value for name, value in flat.items() if not name.startswith("block.")}
        module["block"] = {name[len("block."):]: value for name, value in flat.items()
                           if name.startswith("block.")}
        modules[k] = module
    refuse_leftovers(tensors, f"the MTP heads in {folder} have tensors that "
                              f"num_nextn_predict_layers={num_modules} and the target's layer "
                              "structure do not name")
    return heads_from_params(config, num_modules, {"modules": modules})


def heads_from_params(config: ModelConfig, num_modules: int, params: dict) -> MTPHeads:
    """Build `MTPHeads` from a pure dict of arrays without random-initialising them."""
    return module_from_params(lambda: MTPHeads(config, num_modules, rngs=nnx.Rngs(0)), params)
