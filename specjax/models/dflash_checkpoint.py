"""DFlash drafter folders <-> `DFlashHead` (safetensors; never downloads).

A folder holds `config.json` and `model.safetensors`. Linear weights are `[out, in]`, as in
Hugging Face and the public DFlash / EAGLE-3 drafters:

    fc.weight                        [H, C*H]   (input: concat of the C target streams)
    hidden_norm.weight               [H]        (the context features' norm)
    mask_embedding                   [H]        (the mask token past the target's vocabulary)
    layers.{i}.input_layernorm.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight,
    layers.{i}.post_attention_layernorm.weight, layers.{i}.mlp.{gate,up,down}_proj.weight
    norm.weight                      [H]        (before the target's LM head)

config.json: {"architectures": ["SpecjaxDFlashDrafter"], "hidden_size", "intermediate_size",
"num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
"rope_theta", "vocab_size" (the target's), "target_layer_ids" (0-based target layers fused by
fc), "mask_token_id", "block_size" (the K it was trained for), "torch_dtype"}. The token
embedding and the LM head are the target's (not stored); loading checks the shapes against the
target.

A DSpark drafter (`specjax.models.dspark_head`) is this folder with architecture
"SpecjaxDSparkDrafter", "markov_rank" in config.json and the tensors that module lists.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.checkpoint_io import (CheckpointError, checkpoint_folder, module_from_params,
                                          read_config, read_safetensors, refuse_leftovers,
                                          save_safetensors, tensor_taker)
from specjax.models.config import DTYPES, ModelConfig
from specjax.models.dflash_head import DFlashHead, DFlashHeadConfig
from specjax.models.dspark_head import DSparkHead, DSparkHeadConfig
from specjax.models.hf_checkpoint import layer_tensors, take_layers

ARCHITECTURE = "SpecjaxDFlashDrafter"
DSPARK_ARCHITECTURE = "SpecjaxDSparkDrafter"
WEIGHTS_NAME = "model.safetensors"
# config.json key -> the body's ModelConfig field (the body is no Hugging Face model: it keeps
# whatever layer switches its target has)
_BODY_FIELDS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
                "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
                "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta"}


def save_dflash_head(head: DFlashHead, folder: str | os.PathLike, dtype: str | None = None
                     ) -> None:
    """Write `config.json` + `model.safetensors`; `dtype` (e.g. "bfloat16") converts the
    weights on the way out."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head.config
    dtype = dtype or cfg.body.dtype
    if dtype not in DTYPES:
        raise ValueError(f"save dtype must be one of {DTYPES}, got {dtype!r}")
    np_dtype = jnp.dtype(dtype)
    arr = lambda x: np.ascontiguousarray(np.asarray(x[...]).astype(np_dtype))
    tensors = {"fc.weight": np.ascontiguousarray(arr(head.fc).T),
               "hidden_norm.weight": arr(head.context_norm),
               "mask_embedding": arr(head.body.embed)[0],
               "norm.weight": arr(head.body.final_norm)}
    tensors.update(layer_tensors(head.body.unstacked() if not head.body.stacked else head.body,
                                 np_dtype, "layers."))
    dspark = isinstance(head, DSparkHead)
    if dspark:
        f32 = lambda x: np.ascontiguousarray(np.asarray(x[...], np.float32))
        tensors.update({"markov.embedding.weight": arr(head.markov_in),
                        "markov.proj.weight": np.ascontiguousarray(arr(head.markov_out).T),
                        "confidence.weight": f32(head.confidence)[None],
                        "confidence.calibration": f32(head.calibration)})
    save_safetensors(tensors, folder / WEIGHTS_NAME,
                     metadata={"format": "specjax-dspark" if dspark else "specjax-dflash"})
    hf = {"architectures": [DSPARK_ARCHITECTURE if dspark else ARCHITECTURE],
          **{k: getattr(cfg.body, field) for k, field in _BODY_FIELDS.items()},
          "vocab_size": cfg.vocab_size, "target_layer_ids": list(cfg.target_layer_ids),
          "mask_token_id": cfg.mask_token_id, "block_size": cfg.block_size, "torch_dtype": dtype}
    if dspark:
        hf["markov_rank"] = cfg.markov_rank
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def load_dflash_head(folder: str | os.PathLike, target: ModelConfig, dtype: str | None = None
                     ) -> DFlashHead:
    """Load a drafter saved by `save_dflash_head` for a target with config `target`; weights
    cast to `dtype` (default: the target's). A DSpark folder gives a `DSparkHead`. A field or
    tensor that does not fit the target raises a `CheckpointError` (a ValueError) naming it."""
    folder = checkpoint_folder(folder, "DFlash drafter")
    hf = read_config(folder)
    where = folder / "config.json"
    names = hf.get("architectures", [])
    if ARCHITECTURE not in names and DSPARK_ARCHITECTURE not in names:
        raise CheckpointError(f"{where}: architectures {hf.get('architectures')} names neither "
                              f"{ARCHITECTURE} nor {DSPARK_ARCHITECTURE}")
    dspark = DSPARK_ARCHITECTURE in names
    missing = [k for k in (*list(_BODY_FIELDS)[:6], "vocab_size", "target_layer_ids")
               if k not in hf]
    if missing:
        raise CheckpointError(f"{where}: missing {', '.join(missing)}")
    if hf["vocab_size"] != target.vocab_size or hf["hidden_size"] != target.hidden_size:
        raise CheckpointError(f"{where}: vocab_size {hf['vocab_size']} / hidden_size "
                              f"{hf['hidden_size']} do not match the target's "
                              f"{target.vocab_size} / {target.hidden_size}: it was trained for "
                              "another target")
    layers = hf["target_layer_ids"]
    if (not isinstance(layers, list) or not layers
            or not all(isinstance(x, int) and 0 <= x < target.num_layers for x in layers)):
        raise CheckpointError(f"{where}: target_layer_ids {layers!r} must name layers of the "
                              f"target's {target.num_layers}")
    body = target.replace(
        vocab_size=1, tie_word_embeddings=True, sliding_windows=None, model_type="llama",
        dtype=dtype or target.dtype, num_layers=hf["num_hidden_layers"],
        intermediate_size=hf["intermediate_size"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"],
        rms_norm_eps=hf.get("rms_norm_eps", target.rms_norm_eps),
        rope_theta=hf.get("rope_theta", target.rope_theta))
    try:
        config = DFlashHeadConfig(body, target.vocab_size, tuple(layers),
                                  hf.get("mask_token_id", target.vocab_size),
                                  hf.get("block_size", 4))
        if dspark:
            if not isinstance(hf.get("markov_rank"), int):
                raise ValueError(f"markov_rank {hf.get('markov_rank')!r} must be an int")
            config = DSparkHeadConfig.of(config, hf["markov_rank"])
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    tensors = read_safetensors(folder)
    take = tensor_taker(tensors, jnp.dtype(body.dtype), f"the DFlash drafter in {folder}")
    H = body.hidden_size
    params = {"fc": take("fc.weight", (len(layers) * H, H), transpose=True),
              "context_norm": take("hidden_norm.weight", (H,)),
              "body": {"embed": take("mask_embedding", (H,))[None],
                       "final_norm": take("norm.weight", (H,)),
                       "layers": take_layers(body, take, "layers.")}}
    if dspark:
        V, r, K = target.vocab_size, config.markov_rank, config.block_size
        f32 = tensor_taker(tensors, jnp.dtype(jnp.float32), f"the DSpark drafter in {folder}")
        params.update(markov_in=take("markov.embedding.weight", (V, r)),
                      markov_out=take("markov.proj.weight", (r, V), transpose=True),
                      confidence=f32("confidence.weight", (1, H + r))[0],
                      calibration=f32("confidence.calibration", (2, K, 3)))
    refuse_leftovers(tensors, f"the DFlash drafter in {folder} has tensors its config does "
                              "not name")
    build = DSparkHead if dspark else DFlashHead
    return module_from_params(lambda: build(config, rngs=nnx.Rngs(0)), params)
