"""Public EAGLE-3 head folders <-> `Eagle3Head` (safetensors only; never downloads).

A folder holds `config.json` (Llama-style plus `draft_vocab_size`) and `model.safetensors`
(or a sharded set named by `model.safetensors.index.json`) with these tensors, linear weights
stored `[out, in]` as in PyTorch:

    fc.weight                                   [H, 3H]
    midlayer.input_layernorm.weight             [H]
    midlayer.hidden_norm.weight                 [H]
    midlayer.self_attn.q_proj.weight            [heads*hd, 2H]
    midlayer.self_attn.{k,v}_proj.weight        [kv*hd, 2H]
    midlayer.self_attn.o_proj.weight            [H, heads*hd]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up}_proj.weight          [F, H]
    midlayer.mlp.down_proj.weight               [H, F]
    norm.weight                                 [H]
    lm_head.weight                              [draft_vocab, H]
    d2t                                         [draft_vocab] int (target id = draft id + d2t)
    t2d                                         [vocab] bool (target ids in the draft vocab)

`embed_tokens.weight` (some heads ship a copy of the target's) and rotary `inv_freq` buffers
are ignored: the head uses the target's embedding. A head whose draft vocabulary is the whole
target vocabulary may omit d2t/t2d (the identity map). Many public heads are distributed as
`pytorch_model.bin`; convert those to safetensors first (reading pickles needs torch).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.checkpoint_io import (CheckpointError, checked_shape, checkpoint_folder,
                                          module_from_params, read_config, read_safetensors,
                                          refuse_leftovers, save_safetensors, tensor_taker)
from specjax.models.eagle3_head import Eagle3Head, Eagle3HeadConfig, eagle3_param_shapes

# midlayer param -> (public name, transposed in the file?)
MIDLAYER_NAMES = {
    "input_layernorm": ("midlayer.input_layernorm.weight", False),
    "hidden_norm": ("midlayer.hidden_norm.weight", False),
    "q_proj": ("midlayer.self_attn.q_proj.weight", True),
    "k_proj": ("midlayer.self_attn.k_proj.weight", True),
    "v_proj": ("midlayer.self_attn.v_proj.weight", True),
    "o_proj": ("midlayer.self_attn.o_proj.weight", True),
    "post_attention_layernorm": ("midlayer.post_attention_layernorm.weight", False),
    "gate_proj": ("midlayer.mlp.gate_proj.weight", True),
    "up_proj": ("midlayer.mlp.up_proj.weight", True),
    "down_proj": ("midlayer.mlp.down_proj.weight", True),
}
_IGNORED = re.compile(r"^(embed_tokens\.weight|.*rotary_emb\.inv_freq)$")


def _weights_present(folder: Path) -> None:
    if (folder / "model.safetensors.index.json").exists() or any(folder.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in folder.glob("*.bin"))
    if pickles:
        raise CheckpointError(
            f"{folder} holds only PyTorch pickle weights ({', '.join(pickles[:3])}); specjax "
            "reads safetensors only: convert it, e.g. `safetensors.torch.save_file(torch.load("
            "'pytorch_model.bin'), 'model.safetensors')`")
    raise CheckpointError(f"no *.safetensors weights in {folder}")


def load_eagle3_head(folder: str | os.PathLike, dtype: str | None = None) -> Eagle3Head:
    """Load a public EAGLE-3 head folder. `dtype` overrides config.json's (e.g. "float32")."""
    folder = checkpoint_folder(folder, "EAGLE-3 head")
    config = Eagle3HeadConfig.from_hf_dict(read_config(folder), dtype=dtype)
    _weights_present(folder)
    tensors = read_safetensors(folder)
    np_dtype = jnp.dtype(config.dtype)

    take = tensor_taker(tensors, np_dtype, f"the EAGLE-3 head in {folder}")

    H, Vd = config.hidden_size, config.draft_vocab_size
    params = {
        "fc": take("fc.weight", (3 * H, H), transpose=True),
        "midlayer": {},
        "norm": take("norm.weight", (H,)),
        "lm_head": take("lm_head.weight", (H, Vd), transpose=True),
    }
    for key, shape in eagle3_param_shapes(config).items():
        name, transpose = MIDLAYER_NAMES[key]
        params["midlayer"][key] = take(name, shape, transpose)
    params["d2t"], params["t2d"] = _vocab_maps(tensors, config, folder)
    refuse_leftovers((n for n in tensors if not _IGNORED.match(n)),
                     f"EAGLE-3 head in {folder} has tensors the public layout does not name")
    return head_from_params(config, params)


def _vocab_maps(tensors: dict, config: Eagle3HeadConfig, folder: Path
                ) -> tuple[np.ndarray, np.ndarray]:
    V, Vd = config.vocab_size, config.draft_vocab_size
    if "d2t" not in tensors and "t2d" not in tensors and Vd == V:
        return np.zeros((Vd,), np.int32), np.ones((V,), bool)
    for name in ("d2t", "t2d"):
        if name not in tensors:
            raise CheckpointError(f"tensor {name!r} is missing from the EAGLE-3 head in {folder} "
                                  f"(needed: draft_vocab_size {Vd} < vocab_size {V})")
    d2t = checked_shape("d2t", tensors.pop("d2t"), (Vd,))
    t2d = checked_shape("t2d", tensors.pop("t2d"), (V,))
    if not np.issubdtype(d2t.dtype, np.integer):
        raise CheckpointError(f"tensor 'd2t' has dtype {d2t.dtype}, expected an integer type")
    targets = np.arange(Vd, dtype=np.int64) + d2t.astype(np.int64)
    if targets.min() < 0 or targets.max() >= V:
        raise CheckpointError(f"tensor 'd2t' maps draft ids outside the target vocabulary "
                              f"[0, {V}): range [{targets.min()}, {targets.max()}]")
    t2d = t2d.astype(bool)
    expected = np.zeros((V,), bool)
    expected[targets] = True
    if not np.array_equal(t2d, expected):
        raise CheckpointError("tensors 't2d' and 'd2t' disagree: t2d must mark exactly the "
                              f"target ids draft + d2t[draft] ({int(t2d.sum())} marked, "
                              f"{int(expected.sum())} mapped)")
    return d2t.astype(np.int32), t2d


def head_from_params(config: Eagle3HeadConfig, params: dict) -> Eagle3Head:
    """Build an `Eagle3Head` from a pure dict of arrays without random-initialising it."""
    return module_from_params(lambda: Eagle3Head(config, rngs=nnx.Rngs(0)), params)


def save_eagle3_head(head: Eagle3Head, folder: str | os.PathLike, dtype: str | None = None) -> None:
    """Write `config.json` + `model.safetensors` in the public layout (`load_eagle3_head`
    reads it back exactly). `dtype` converts the weights (and config.json) on the way out."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = head.config if dtype is None else head.config.replace(dtype=dtype)
    np_dtype = jnp.dtype(config.dtype)

    def arr(x, transpose: bool = False) -> np.ndarray:
        a = np.asarray(x[...]).astype(np_dtype)
        return np.ascontiguousarray(a.T if transpose else a)

    tensors = {"fc.weight": arr(head.fc, True), "norm.weight": arr(head.norm),
               "lm_head.weight": arr(head.lm_head, True),
               "d2t": np.asarray(head.d2t[...]).astype(np.int64),
               "t2d": np.asarray(head.t2d[...]).astype(bool)}
    for key, (name, transpose) in MIDLAYER_NAMES.items():
        tensors[name] = arr(head.midlayer[key], transpose)
    save_safetensors(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
