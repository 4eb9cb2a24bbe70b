"""`quantize="q8_0"` / `"q4_0"`: a float checkpoint's weights quantized at load.

For people without a GGUF: each dense projection becomes GGUF's own blocks (quantized by the
`gguf` package, as llama.cpp's converter would) and then the kernel's packed layout
(`pallas_kernels.cpu_matmul.quant`), exactly as a GGUF file of that type loads. The LM head
(a tied embedding included, which then serves the token lookup too) is quantized to Q8_0
whatever the kind, as llama.cpp keeps its output layer at a higher precision than the rest: it
is the one projection whose every error reaches the sampled token. Weights whose sizes are not
whole panels of 32 outputs and blocks of 32 inputs stay float.
"""
from __future__ import annotations

from typing import TypeVar

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.cpu_matmul import PANEL, quant
from specjax.models.linear import is_quantized
from specjax.models.roles import PROJECTIONS

QUANTIZE = {"q8_0": "Q8_0", "q4_0": "Q4_0"}
HEAD_TYPE = "Q8_0"

M = TypeVar("M", bound=nnx.Module)


def check_quantize(kind: str | None) -> None:
    if kind is not None and kind not in QUANTIZE:
        raise ValueError(f"quantize={kind!r} is not one of {', '.join(QUANTIZE)} (or None)")


def quantized_weight(w, qtype: str):
    """A float weight `[..., in, out]` as the packed quantized layout `[..., P, in / 32, R]`,
    or None where its sizes do not allow it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    *lead, k, n = w.shape
    if n % PANEL or k % 32 or k == 0:
        return None
    rows = np.asarray(w, np.float32).reshape(-1, k, n)
    t = GGMLQuantizationType[qtype]
    packed = [quant.pack_gguf(quantize(np.ascontiguousarray(r.T), t), qtype) for r in rows]
    return np.stack(packed).reshape(*lead, *packed[0].shape)


def quantize_model(model: M, kind: str) -> M:
    """A copy of `model` (a target in its checkpoint layout) with its projections quantized to
    `kind` and its LM head to Q8_0 (module docstring)."""
    check_quantize(kind)
    if is_quantized(model):
        raise ValueError("quantize= applies to float checkpoints; this model's weights are "
                         "quantized already (a GGUF keeps its own types; dtype='float32' "
                         "dequantizes them)")
    qtype = QUANTIZE[kind]
    module = nnx.merge(*nnx.split(model))
    config = getattr(module, "config", None)
    if getattr(config, "tie_word_embeddings", False) and hasattr(module, "embed") \
            and not hasattr(module, "lm_head"):
        head = quantized_weight(np.asarray(module.embed[...]).T, HEAD_TYPE)
        if head is not None:
            module.embed = nnx.Param(jnp.asarray(head))  # the head's layout, looked up by column
    graphdef, state = nnx.split(module)

    def convert(tree, top=False):
        out = {}
        for name, value in tree.items():
            if isinstance(value, dict):
                out[name] = convert(value)
            elif name in PROJECTIONS and getattr(value, "ndim", 0) >= 2 \
                    and not quant.is_quantized(value):
                q = quantized_weight(value, HEAD_TYPE if top and name == "lm_head" else qtype)
                out[name] = value if q is None else jnp.asarray(q)
            else:
                out[name] = value
        return out

    nnx.replace_by_pure_dict(state, convert(nnx.to_pure_dict(state), top=True))
    return nnx.merge(graphdef, state)
