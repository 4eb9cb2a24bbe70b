"""Every parameter's role, in one table: what it is (a projection, a norm, a bias, the
embedding), its name in a Hugging Face checkpoint and in a GGUF file, and the axis tensor
parallelism splits it on.

The loaders (`hf_checkpoint`, `gguf_checkpoint`), the CPU packing (`linear.PROJECTIONS`),
quantize-at-load and the sharding plan (`specjax.core.sharding`) read their names from here, so
a parameter added to a layer is named once. Both checkpoint formats store a projection
`[out, in]`; specjax keeps `[in, out]` (`Role.transposed`).
"""
from __future__ import annotations

import dataclasses

PROJECTION, NORM, BIAS, EMBEDDING = "projection", "norm", "bias", "embedding"


@dataclasses.dataclass(frozen=True)
class Role:
    kind: str
    hf: str | None = None          # after "model.layers.{i}." (OTHER's: their loaders name them)
    gguf: str | None = None        # after "blk.{i}."
    # The axis split over the "tp" mesh axis (negative: from the end); None: replicated.
    # Column projections (and their biases) split by output features, row ones by input.
    tp_axis: int | None = None
    sandwich_hf: str | None = None  # the HF name in Gemma 3's sandwich-norm layers
    sandwich_only: bool = False    # only in sandwich-norm layers

    @property
    def transposed(self) -> bool:
        return self.kind == PROJECTION


def _attention(p: str, column: bool) -> dict[str, Role]:
    gguf = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}[p]
    axis = -1 if column else -2
    return {f"{p}_proj": Role(PROJECTION, f"self_attn.{p}_proj.weight", f"{gguf}.weight", axis),
            f"{p}_bias": Role(BIAS, f"self_attn.{p}_proj.bias", f"{gguf}.bias",
                              -1 if column else None)}


def _mlp(p: str, column: bool) -> dict[str, Role]:
    return {f"{p}_proj": Role(PROJECTION, f"mlp.{p}_proj.weight", f"ffn_{p}.weight",
                              -1 if column else -2),
            f"{p}_bias": Role(BIAS, f"mlp.{p}_proj.bias", None, -1 if column else None)}


# A decoder layer's parameters, as checkpoints hold them (one weight a projection).
LAYER: dict[str, Role] = {
    "input_norm": Role(NORM, "input_layernorm.weight", "attn_norm.weight"),
    # Gemma 3: the norm before the MLP is `pre_feedforward_layernorm`, and
    # `post_attention_layernorm` norms the attention's output (GGUF names both as Llama does).
    "post_norm": Role(NORM, "post_attention_layernorm.weight", "ffn_norm.weight",
                      sandwich_hf="pre_feedforward_layernorm.weight"),
    "attn_out_norm": Role(NORM, "post_attention_layernorm.weight",
                          "post_attention_norm.weight", sandwich_only=True),
    "ffn_out_norm": Role(NORM, "post_feedforward_layernorm.weight", "post_ffw_norm.weight",
                         sandwich_only=True),
    "q_norm": Role(NORM, "self_attn.q_norm.weight", "attn_q_norm.weight"),
    "k_norm": Role(NORM, "self_attn.k_norm.weight", "attn_k_norm.weight"),
    **_attention("q", True), **_attention("k", True), **_attention("v", True),
    **_attention("o", False),
    **_mlp("gate", True), **_mlp("up", True), **_mlp("down", False),
}

# The inference layout's fused projections (`fused.FUSED_GROUPS`), and the projections of the
# heads and other families, which their own loaders name.
OTHER: dict[str, Role] = {
    "embed": Role(EMBEDDING, tp_axis=0),
    "lm_head": Role(PROJECTION, tp_axis=-1),
    "final_norm": Role(NORM),
    **{name: Role(PROJECTION) for name in (
        "qkv_proj", "gate_up_proj",               # fused (tensor parallelism keeps them apart)
        "fc", "eh_proj", "markov_out",            # EAGLE-3 / DFlash, MTP, DSpark
        "in_proj", "out_proj")},                  # Bamba's mixer
}

ROLES: dict[str, Role] = {**LAYER, **OTHER}
PROJECTIONS = frozenset(n for n, r in ROLES.items() if r.kind == PROJECTION)
TP_AXIS = {n: r.tp_axis for n, r in ROLES.items() if r.tp_axis is not None}


def hf_layer_names(sandwich_norms: bool) -> dict[str, tuple[str, bool]]:
    """specjax layer param -> (Hugging Face name after "model.layers.{i}.", transpose?)."""
    return {name: ((r.sandwich_hf if sandwich_norms and r.sandwich_hf else r.hf), r.transposed)
            for name, r in LAYER.items() if sandwich_norms or not r.sandwich_only}


def gguf_layer_names() -> dict[str, str]:
    """specjax layer param -> GGUF tensor name after "blk.{i}." (a sandwich-norm layer's
    too: llama.cpp's names do not collide)."""
    return {name: r.gguf for name, r in LAYER.items() if r.gguf}
