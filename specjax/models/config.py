"""Static model configuration: a frozen, hashable dataclass (safe as a jit static argument).

`ModelConfig.from_hf_dict` maps a Hugging Face `config.json` onto it and refuses anything the
model code does not implement, naming the field, rather than silently computing something else;
`to_hf_dict` writes one back. Both are generic: what differs between families is read from the
family's record (`models/families.py`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from specjax.models.families import (ALL_BIASES, GATED, NO_WINDOW, PATTERN, UNIFORM, Family,
                                     family_for_hf)

# What a layer's MLP applies to its gate: Llama's SiLU, Gemma's tanh-approximated GELU.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is "linear" (positions / factor) or "llama3"."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """The Mamba-2 mixers of a hybrid decoder (Bamba): `num_heads` heads of `head_dim`
    channels, `num_groups` groups of B/C projections of `state_size`, a causal depthwise
    convolution of `conv_kernel` taps over x, B and C."""

    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int = 4
    chunk_size: int = 256
    conv_bias: bool = True
    time_step_min: float = 0.0
    time_step_max: float = float("inf")

    def __post_init__(self):
        for name in ("num_heads", "head_dim", "num_groups", "state_size", "conv_kernel",
                     "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MambaConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_groups:
            raise ValueError(f"MambaConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_groups ({self.num_groups})")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: x, then B, then C."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size


ATTENTION, MAMBA = "attention", "mamba"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder (Llama 3, Mistral, Qwen2, Qwen3, Gemma 3), or a hybrid one whose
    layers are attention or Mamba-2 mixers (`layer_types`, `mamba`: Bamba).

    Gemma 3 is the Llama layer with four switches: `sandwich_norms`, `hidden_act`
    "gelu_pytorch_tanh", `embed_scale` and `query_pre_attn_scalar`; its local layers are the
    ones with a sliding window, rotated with `rope_local_theta`. Its RMSNorm scales by
    (1 + w): the checkpoint readers store 1 + w, so every norm here multiplies by its weight
    (a GGUF already holds 1 + w)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama's attention_bias)
    o_bias: bool = False  # Llama's attention_bias also biases o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    # Per-layer sliding window (None = full attention). A key at distance >= window is masked.
    sliding_windows: tuple[int | None, ...] | None = None
    dtype: str = "float32"
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    initializer_range: float = 0.02
    # RoPE rotates the first head_dim * partial_rotary_factor features of q and k (Bamba: 0.5).
    partial_rotary_factor: float = 1.0
    # Hybrids: each layer's kind, ATTENTION or MAMBA (None: every layer attends).
    layer_types: tuple[str, ...] | None = None
    mamba: MambaConfig | None = None
    # Gemma 3: each layer's attention output and MLP output normed before the residual adds
    # them (`attn_out_norm`, `ffn_out_norm`), beside the usual pre-norms.
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    # Embeddings multiplied by sqrt(hidden_size) (rounded to the model's dtype, as Gemma does).
    embed_scale: bool = False
    # Attention scores scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    query_pre_attn_scalar: int | float | None = None
    # The RoPE base of the sliding-window layers where it differs from the global layers'
    # (Gemma 3: 10,000 local, 1,000,000 global); no scaling applies to them.
    rope_local_theta: float | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        check_attention_fields("ModelConfig", self.num_heads, self.num_kv_heads, self.head_dim,
                               self.dtype)
        if self.sliding_windows is not None and len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"ModelConfig.sliding_windows has {len(self.sliding_windows)} entries "
                             f"for {self.num_layers} layers")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.sliding_windows, list):
            object.__setattr__(self, "sliding_windows", tuple(self.sliding_windows))
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {
                    ATTENTION, MAMBA}:
                raise ValueError(f"ModelConfig.layer_types must name {self.num_layers} layers, "
                                 f"each {ATTENTION!r} or {MAMBA!r}; got {self.layer_types!r}")
            if (MAMBA in self.layer_types) != (self.mamba is not None):
                raise ValueError("ModelConfig.mamba must be set exactly when a layer is "
                                 f"{MAMBA!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.hidden_act {self.hidden_act!r} is not one of "
                             f"{', '.join(ACTIVATIONS)}")
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or rotary != int(rotary) or int(rotary) % 2:
            raise ValueError(f"ModelConfig.partial_rotary_factor {self.partial_rotary_factor} "
                             f"must leave an even number of rotated features of head_dim "
                             f"{self.head_dim}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def query_scale(self) -> float | None:
        """What q is multiplied by so that attention's head_dim ** -0.5 scales scores by
        query_pre_attn_scalar ** -0.5; None where the two agree."""
        if self.query_pre_attn_scalar is None or self.query_pre_attn_scalar == self.head_dim:
            return None
        return float((self.head_dim / self.query_pre_attn_scalar) ** 0.5)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that attend (and hold K/V in the pool), in order."""
        return tuple(i for i in range(self.num_layers)
                     if self.layer_types is None or self.layer_types[i] == ATTENTION)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token holds in the pool, over every attending layer."""
        return (2 * len(self.kv_layers) * self.num_kv_heads * self.head_dim
                * np.dtype(self.dtype).itemsize)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers that carry a recurrent state instead of K/V (a hybrid's Mamba mixers)."""
        return tuple(i for i in range(self.num_layers)
                     if self.layer_types is not None and self.layer_types[i] == MAMBA)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.recurrent_layers)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def num_params(self) -> int:
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        mixer = 0
        if self.mamba is not None:
            m = self.mamba
            I, C, H = m.intermediate_size, m.conv_dim, m.num_heads
            mixer = d * (I + C + H) + (m.conv_kernel + m.conv_bias) * C + 3 * H + I + I * d
        mixers = len(self.recurrent_layers)
        layers = (self.num_layers - mixers) * attn + mixers * mixer
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        norms = 4 if self.sandwich_norms else 2
        return layers + self.num_layers * (3 * d * f + norms * d) + embed + d

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json: generic, driven by the family's record ----------------

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], dtype: str | None = None) -> "ModelConfig":
        family = family_for_hf(hf.get("model_type"))
        for arch in hf.get("architectures") or []:
            if not arch.endswith("ForCausalLM"):
                raise ValueError(f"unsupported architecture {arch!r} in config.json: only "
                                 "*ForCausalLM decoders are supported")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(key) is not None:
                raise ValueError(f"unsupported {family.title} config: {key} = {hf[key]}")
        if hf.get("use_bidirectional_attention"):
            raise ValueError(f"unsupported {family.title} config: use_bidirectional_attention "
                             "= true")
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        if dtype is None:
            dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
            dtype = dtype if dtype in DTYPES else "float32"
        qkv_bias, o_bias = family.biases(bool(hf.get("attention_bias", False)))
        scalar = family.query_pre_attn_scalar
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=num_layers,
            num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.tie_word_embeddings)),
            qkv_bias=qkv_bias, o_bias=o_bias,
            mlp_bias=family.mlp_bias and bool(hf.get("mlp_bias", False)),
            qk_norm=family.qk_norm, sandwich_norms=family.sandwich_norms,
            hidden_act=_activation_from_hf(hf, family), embed_scale=family.embed_scale,
            query_pre_attn_scalar=None if scalar is None else hf.get("query_pre_attn_scalar",
                                                                     scalar),
            sliding_windows=_windows_from_hf(hf, family, num_layers),
            dtype=dtype, model_type=family.model_type, bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            initializer_range=hf.get("initializer_range", 0.02),
            **_rope_fields_from_hf(hf, family),
            **(bamba_fields(hf) if family.hybrid else {}),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers (and `from_hf_dict`) reads back as the same model;
        a config its family's config.json cannot express is refused, naming the field."""
        family = family_for_hf(self.model_type)
        wrong = _inexpressible(self, family)
        if wrong:
            raise ValueError(f"this ModelConfig has no Hugging Face {family.title} equivalent: "
                             f"{wrong}")
        hf: dict[str, Any] = {
            "architectures": [family.hf_architecture], "model_type": family.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            family.activation_key: self.hidden_act, "dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "initializer_range": self.initializer_range,
            **_rope_to_hf(self, family),
            **_windows_to_hf(self, family),
            **family.hf_extra,
        }
        if family.attention_bias == ALL_BIASES:
            hf["attention_bias"] = self.qkv_bias
        if family.mlp_bias:
            hf["mlp_bias"] = self.mlp_bias
        if family.query_pre_attn_scalar is not None:
            hf["query_pre_attn_scalar"] = self.query_pre_attn_scalar or self.head_dim
        if family.hybrid:
            hf.update(bamba_to_hf(self))
        return hf

    @classmethod
    def from_json_file(cls, path: str | os.PathLike, dtype: str | None = None) -> "ModelConfig":
        with open(path) as f:
            return cls.from_hf_dict(json.load(f), dtype=dtype)


def rope_from_hf(hf: dict[str, Any], partial: bool = False) -> tuple[float, RopeScaling | None]:
    """`partial`: the caller reads partial_rotary_factor itself."""
    # transformers >= 5 writes `rope_parameters` (theta included); older configs use
    # `rope_theta` + `rope_scaling`. Accept both.
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    spec = {**legacy, **params}
    if not partial and hf.get("partial_rotary_factor",
                              spec.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("unsupported rope scaling: partial_rotary_factor != 1.0")
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r} in config.json "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=float(spec["factor"]))
    return theta, RopeScaling(
        rope_type="llama3",
        factor=float(spec["factor"]),
        low_freq_factor=float(spec["low_freq_factor"]),
        high_freq_factor=float(spec["high_freq_factor"]),
        original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
    )


def _rope_fields_from_hf(hf: dict[str, Any], family: Family) -> dict[str, Any]:
    """RoPE's fields: one rotation, or (transformers 5) one per layer type, the global
    layers' scaled and the sliding-window layers' not; a family with a local base where the
    file names none (Gemma 3's rope_local_base_freq) gets its default."""
    partial = family.partial_rotary_factor
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        theta, scaling = rope_from_hf({"rope_parameters": params["full_attention"]})
        local, local_scaling = rope_from_hf({"rope_parameters": params["sliding_attention"]})
        if local_scaling is not None:
            raise ValueError(f"unsupported {family.title} config: rope scaling on the "
                             "sliding-window layers")
    else:
        theta, scaling = rope_from_hf(hf, partial=partial is not None)
        local = None if family.rope_local_theta is None else float(
            hf.get("rope_local_base_freq", family.rope_local_theta))
    fields = dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local)
    if partial is not None:
        spec = {**(hf.get("rope_scaling") or {}), **params}
        fields["partial_rotary_factor"] = float(spec.get(
            "partial_rotary_factor", hf.get("partial_rotary_factor", partial)))
    return fields


def _rope_to_hf(config: ModelConfig, family: Family) -> dict[str, Any]:
    """The family's RoPE keys: per layer type where it has local layers of their own base,
    `rope_parameters` with the rotated fraction where it rotates part of a head, else
    `rope_theta` and `rope_scaling`."""
    scaling = {} if config.rope_scaling is None else rope_scaling_to_hf(config.rope_scaling)
    full = {"rope_type": "default", **scaling, "rope_theta": config.rope_theta}
    if family.rope_local_theta is not None:
        return {"rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": config.rope_local_theta or config.rope_theta}}}
    if family.partial_rotary_factor is not None:
        return {"rope_parameters": {**full,
                                    "partial_rotary_factor": config.partial_rotary_factor}}
    return {"rope_theta": config.rope_theta, **({"rope_scaling": scaling} if scaling else {})}


# config.json's activation names -> ModelConfig.hidden_act
_HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_pytorch_tanh",
                   "gelu_tanh": "gelu_pytorch_tanh"}


def _activation_from_hf(hf: dict[str, Any], family: Family) -> str:
    key = next((k for k in (family.activation_key, "hidden_act") if hf.get(k)), None)
    act = hf[key] if key else family.hidden_act
    if act not in _HF_ACTIVATIONS:
        raise ValueError(f"unsupported {family.title} config: {key} {act!r} (supported: "
                         f"{', '.join(_HF_ACTIVATIONS)})")
    return _HF_ACTIVATIONS[act]


def _windows_from_hf(hf: dict[str, Any], family: Family,
                     num_layers: int) -> tuple[int | None, ...] | None:
    window = hf.get("sliding_window")
    if family.windows == GATED and not hf.get("use_sliding_window", False):
        window = None
    if family.windows == NO_WINDOW or window is None:
        return None
    layer_types = hf.get("layer_types")
    if layer_types is None and family.windows == GATED:
        first = hf.get("max_window_layers", num_layers)
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(num_layers)]
    if layer_types is None:
        return family.layer_windows(num_layers, int(window), hf.get("sliding_window_pattern"))
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def _windows_to_hf(config: ModelConfig, family: Family) -> dict[str, Any]:
    windows = config.sliding_windows or (None,) * config.num_layers
    sizes = {w for w in windows if w is not None}
    if family.windows == PATTERN:
        return {"sliding_window": min(sizes) if sizes else None,
                "layer_types": ["sliding_attention" if w is not None else "full_attention"
                                for w in windows]}
    if family.windows == UNIFORM:
        return {"sliding_window": min(sizes) if sizes else None}
    return {"sliding_window": None} if family.windows == GATED else {}


def _inexpressible(config: ModelConfig, family: Family) -> str:
    """What of `config` its family's config.json cannot say (empty: nothing)."""
    windows = config.sliding_windows or ()
    sizes = {w for w in windows if w is not None}
    fixed = dict(qk_norm=family.qk_norm, sandwich_norms=family.sandwich_norms,
                 embed_scale=family.embed_scale, is_hybrid=family.hybrid)
    if not family.mlp_bias:
        fixed["mlp_bias"] = False
    if family.query_pre_attn_scalar is None:
        fixed["query_scale"] = None
    if family.rope_local_theta is None:
        fixed["rope_local_theta"] = None
    if family.partial_rotary_factor is None:
        fixed["partial_rotary_factor"] = 1.0
    wrong = [f"{k} {getattr(config, k)!r}" for k, v in fixed.items() if getattr(config, k) != v]
    if family.partial_rotary_factor is not None and config.rope_scaling is not None:
        # scaling a partial rotation: never checked against transformers
        wrong.append(f"rope_scaling {config.rope_scaling}")
    if (config.qkv_bias, config.o_bias) not in {family.biases(False), family.biases(True)}:
        wrong.append(f"qkv_bias {config.qkv_bias} with o_bias {config.o_bias}")
    if sizes and (family.windows in (NO_WINDOW, GATED) or len(sizes) > 1 or (
            family.windows == UNIFORM and None in windows)):
        wrong.append(f"sliding_windows {config.sliding_windows}")
    return ", ".join(wrong)


def rope_scaling_to_hf(scaling: RopeScaling) -> dict:
    """The `rope_scaling` entry of a Hugging Face config.json for this scaling."""
    if scaling.rope_type == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    return dataclasses.asdict(scaling)


def check_attention_fields(owner: str, num_heads: int, num_kv_heads: int, head_dim: int,
                           dtype: str) -> None:
    """The checks every attention-carrying config shares; errors name `owner.field`."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{owner}.num_heads ({num_heads}) must be a multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    if head_dim % 2:
        raise ValueError(f"{owner}.head_dim must be even for RoPE, got {head_dim}")
    if dtype not in DTYPES:
        raise ValueError(f"{owner}.dtype must be one of {DTYPES}, got {dtype!r}")


def _hf_float(value: Any) -> float:
    """A float of a config.json (transformers writes infinity as {"__float__": "Infinity"})."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def bamba_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The hybrid fields of a Bamba config.json; refuses what the mixer does not implement."""
    if hf.get("mamba_proj_bias"):
        raise ValueError("unsupported Bamba config: mamba_proj_bias = true")
    layers, hidden = hf["num_hidden_layers"], hf["hidden_size"]
    attention = set(hf.get("attn_layer_indices") or ())
    heads, expand = hf.get("mamba_n_heads", 128), hf.get("mamba_expand", 2)
    head_dim = hf.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = expand * hidden // heads
    if head_dim * heads != expand * hidden:
        raise ValueError(f"Bamba config: mamba_n_heads {heads} x mamba_d_head {head_dim} must "
                         f"equal mamba_expand x hidden_size ({expand * hidden})")
    limit = hf.get("time_step_limit") or (0.0, float("inf"))
    return dict(
        layer_types=tuple(ATTENTION if i in attention else MAMBA for i in range(layers)),
        mamba=MambaConfig(num_heads=heads, head_dim=head_dim,
                          num_groups=hf.get("mamba_n_groups", 1),
                          state_size=hf.get("mamba_d_state", 256),
                          conv_kernel=hf.get("mamba_d_conv", 4),
                          chunk_size=hf.get("mamba_chunk_size", 256),
                          conv_bias=bool(hf.get("mamba_conv_bias", True)),
                          time_step_min=_hf_float(limit[0]), time_step_max=_hf_float(limit[1])),
    )


def bamba_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The hybrid keys of a Bamba config.json (the inverse of `bamba_fields`)."""
    m = config.mamba
    if m.intermediate_size % config.hidden_size:
        raise ValueError(f"this ModelConfig has no Hugging Face Bamba equivalent: mamba "
                         f"intermediate size {m.intermediate_size}, not a multiple of "
                         f"hidden_size {config.hidden_size}")
    limit = [m.time_step_min, m.time_step_max]
    return {
        "attn_layer_indices": list(config.kv_layers),
        "mamba_n_heads": m.num_heads, "mamba_d_head": m.head_dim,
        "mamba_n_groups": m.num_groups, "mamba_d_state": m.state_size,
        "mamba_d_conv": m.conv_kernel, "mamba_expand": m.intermediate_size // config.hidden_size,
        "mamba_chunk_size": m.chunk_size, "mamba_conv_bias": m.conv_bias,
        "mamba_proj_bias": False,
        "time_step_limit": [x if x != float("inf") else {"__float__": "Infinity"} for x in limit],
    }
