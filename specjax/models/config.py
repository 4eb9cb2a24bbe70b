"""Static model configuration: a frozen, hashable dataclass (safe as a jit static argument).

`ModelConfig.from_hf_dict` maps a Hugging Face `config.json` onto it and refuses anything the
model code does not implement, naming the field, rather than silently computing something else.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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
class ModelConfig:
    """A Llama-family decoder (Llama 3, Mistral, Qwen2, Qwen3)."""

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
        per_layer = attn + 3 * d * f + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + d

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json ------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], dtype: str | None = None) -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r} in config.json "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        archs = hf.get("architectures") or []
        for arch in archs:
            if not arch.endswith("ForCausalLM"):
                raise ValueError(f"unsupported architecture {arch!r} in config.json: only "
                                 "*ForCausalLM decoders are supported")
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        theta, scaling = rope_from_hf(hf)
        if dtype is None:
            dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
            dtype = dtype if dtype in DTYPES else "float32"
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 hard-codes q/k/v biases; Llama's attention_bias covers q/k/v/o; Qwen3 q/k/v only.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_windows=_sliding_windows_from_hf(hf, model_type, num_layers),
            dtype=dtype,
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            initializer_range=hf.get("initializer_range", 0.02),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers (and `from_hf_dict`) reads back as the same model."""
        if self.model_type == "qwen2" and not self.qkv_bias or self.qk_norm and self.model_type != "qwen3":
            raise ValueError("this ModelConfig has no Hugging Face equivalent for its model_type")
        hf: dict[str, Any] = {
            "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias if self.model_type in ("llama", "qwen3") else False,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "initializer_range": self.initializer_range,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = rope_scaling_to_hf(self.rope_scaling)
        windows = {w for w in (self.sliding_windows or ()) if w is not None}
        if windows:
            if self.model_type != "mistral" or len(windows) > 1 or None in self.sliding_windows:
                raise ValueError("only Mistral-style uniform sliding windows can be exported")
            hf["sliding_window"] = windows.pop()
        elif self.model_type in ("mistral", "qwen2", "qwen3"):
            hf["sliding_window"] = None
        return hf

    @classmethod
    def from_json_file(cls, path: str | os.PathLike, dtype: str | None = None) -> "ModelConfig":
        with open(path) as f:
            return cls.from_hf_dict(json.load(f), dtype=dtype)


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters` (theta included); older configs use
    # `rope_theta` + `rope_scaling`. Accept both.
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    spec = {**legacy, **params}
    if hf.get("partial_rotary_factor", spec.get("partial_rotary_factor", 1.0)) != 1.0:
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


def _sliding_windows_from_hf(hf, model_type, num_layers):
    window = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        window = None
    if model_type == "llama" or window is None:
        return None
    layer_types = hf.get("layer_types")
    if layer_types is None and model_type in ("qwen2", "qwen3"):
        first = hf.get("max_window_layers", num_layers)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if layer_types is None:
        return (int(window),) * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


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
