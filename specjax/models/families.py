"""Model families as data: one `Family` record each, for everything that tells one family's
checkpoints from another's (its config.json and llama.cpp's GGUF). The translations look
these fields up (`config.ModelConfig.from_hf_dict` / `to_hf_dict`, `gguf_checkpoint`'s
`gguf_config`, `gguf_metadata`, `load_gguf`, `hf_checkpoint`'s norms) rather than naming
families, so a Llama-like family that needs no new layer switch is one record in `FAMILIES`.

What the records do not hold, because it is not a family's: the layer switches themselves
(`ModelConfig`), tensor names (they follow the layer's layout: sandwich norms have their own
names whatever the family), the byte-level pre-tokenizers (`tokenizer.PRE_TOKENIZERS`, by
`tokenizer.ggml.pre`; a family names the ones its files carry) and a hybrid's Mamba-2 mixers
(`config.bamba_fields`, `bamba_to_hf`, `hf_checkpoint`'s Bamba layers: they describe a second
kind of layer, which no other family has, so they stay with the code that builds it).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from specjax.models.checkpoint_io import CheckpointError

# Sliding-window rules, how a config.json says which layers slide.
NO_WINDOW = "none"  # never (transformers' Llama ignores a sliding_window key)
UNIFORM = "uniform"  # every layer, `sliding_window` (or its `layer_types`)
GATED = "gated"  # only with `use_sliding_window`; layers from `max_window_layers` on (Qwen)
PATTERN = "pattern"  # every `global_every`-th layer global, the rest sliding (Gemma 3)
WINDOW_RULES = (NO_WINDOW, UNIFORM, GATED, PATTERN)

# Attention-bias rules: what config.json's `attention_bias` switches on.
ALL_BIASES = "attention_bias"  # q, k, v and o together
QKV_ALWAYS = "qkv"  # q, k, v always biased, o never, whatever the key says (Qwen2)
NO_BIAS = "none"  # nothing; the key is ignored (Mistral)
BIAS_RULES = (ALL_BIASES, QKV_ALWAYS, NO_BIAS)


def _gemma3_query_scalar(hidden_size: int, num_heads: int, head_dim: int) -> int:
    # llama.cpp scales Gemma 3 27B's queries by hidden / heads, every other size's by the
    # head size; no GGUF key holds it.
    return hidden_size // num_heads if hidden_size == 5376 else head_dim


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's checkpoints. Defaults are Llama's."""

    model_type: str  # config.json's model_type, and ModelConfig.model_type
    title: str  # how messages name it
    hf_architecture: str  # config.json's `architectures` entry
    # llama.cpp's `general.architecture` for the family's files (None: no GGUF), and the
    # names read as this family where they are not that one.
    gguf_architecture: str | None = None
    gguf_reads: tuple[str, ...] | None = None
    # `tokenizer.ggml.pre` of the family's byte-level BPE files, its most common first
    # (empty: SentencePiece vocabularies only).
    gguf_pre: tuple[str, ...] = ()
    attention_bias: str = ALL_BIASES
    mlp_bias: bool = False  # config.json's `mlp_bias` biases the MLP
    qk_norm: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # where config.json names none
    activation_key: str = "hidden_act"  # the key its config.json names the activation by
    embed_scale: bool = False
    # config.json's query_pre_attn_scalar where it is silent; None: the family has none.
    query_pre_attn_scalar: int | None = None
    # What its checkpoints' norm weights lack of the scale applied (Gemma: 1 + w); a GGUF
    # holds the scale itself.
    norm_offset: float = 0.0
    tie_word_embeddings: bool = False  # where config.json is silent
    windows: str = NO_WINDOW
    global_every: int | None = None  # PATTERN: every n-th layer attends globally
    # The RoPE base of the sliding-window layers where the file is silent (llama.cpp assumes
    # it too); None: the family rotates every layer alike.
    rope_local_theta: float | None = None
    # config.json's partial_rotary_factor where it is silent; None: it must be 1.
    partial_rotary_factor: float | None = None
    hf_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # written as is
    hybrid: bool = False  # Mamba-2 mixers beside attention (`config.bamba_fields`)
    gguf_permuted: bool = False  # llama.cpp's converter interleaves the q/k rows
    gguf_query_scalar: Callable[[int, int, int], int] | None = None  # from hidden, heads, head_dim

    def __post_init__(self):
        if self.windows not in WINDOW_RULES or (self.windows == PATTERN) != bool(
                self.global_every):
            raise ValueError(f"Family {self.model_type}: windows {self.windows!r} (one of "
                             f"{WINDOW_RULES}; global_every exactly for {PATTERN!r})")
        if self.attention_bias not in BIAS_RULES:
            raise ValueError(f"Family {self.model_type}: attention_bias {self.attention_bias!r} "
                             f"is not one of {BIAS_RULES}")

    @property
    def gguf_names(self) -> tuple[str, ...]:
        """The `general.architecture` values read as this family."""
        if self.gguf_reads is not None:
            return self.gguf_reads
        return () if self.gguf_architecture is None else (self.gguf_architecture,)

    def biases(self, attention_bias: bool) -> tuple[bool, bool]:
        """(qkv_bias, o_bias) for config.json's attention_bias."""
        if self.attention_bias == QKV_ALWAYS:
            return True, False
        on = self.attention_bias == ALL_BIASES and attention_bias
        return on, on

    def layer_windows(self, num_layers: int, window: int,
                      global_every: int | None = None) -> tuple[int | None, ...]:
        """Each layer's window where the file gives one size and no layer list
        (`global_every` overrides the record's, PATTERN only)."""
        if self.windows == PATTERN:
            every = global_every or self.global_every
            return tuple(None if (i + 1) % every == 0 else window for i in range(num_layers))
        return (window,) * num_layers

    def gguf_fields(self, hidden_size: int, num_heads: int, head_dim: int, num_layers: int,
                    window: int | None) -> dict[str, Any]:
        """The `ModelConfig` fields llama.cpp assumes of a file of this family (no key holds
        them), given its sizes and its one sliding window (None: none)."""
        fields = dict(qkv_bias=self.attention_bias == QKV_ALWAYS, o_bias=False, mlp_bias=False,
                      qk_norm=self.qk_norm, sandwich_norms=self.sandwich_norms,
                      hidden_act=self.hidden_act, embed_scale=self.embed_scale,
                      rope_local_theta=self.rope_local_theta,
                      sliding_windows=self.layer_windows(num_layers, window) if window else None)
        if self.gguf_query_scalar is not None:
            fields["query_pre_attn_scalar"] = self.gguf_query_scalar(hidden_size, num_heads,
                                                                     head_dim)
        return fields


FAMILIES = (
    Family("llama", "Llama", "LlamaForCausalLM", gguf_architecture="llama",
           gguf_pre=("llama-bpe", "smollm"), mlp_bias=True, gguf_permuted=True),
    # llama.cpp writes Mistral as "llama" (such a file loads back as the Llama it computes as;
    # "mistral", transformers' name for them, is read too). Nemo's and Small 3's files split
    # text as tekken.
    Family("mistral", "Mistral", "MistralForCausalLM", gguf_architecture="llama",
           gguf_reads=("mistral",), gguf_pre=("tekken",), attention_bias=NO_BIAS,
           windows=UNIFORM, gguf_permuted=True),
    # Qwen's files keep Hugging Face's q/k rows: llama.cpp rotates them NeoX-style.
    Family("qwen2", "Qwen2", "Qwen2ForCausalLM", gguf_architecture="qwen2", gguf_pre=("qwen2",),
           attention_bias=QKV_ALWAYS, windows=GATED),
    Family("qwen3", "Qwen3", "Qwen3ForCausalLM", gguf_architecture="qwen3", gguf_pre=("qwen2",),
           qk_norm=True, windows=GATED),
    Family("gemma3_text", "Gemma 3", "Gemma3ForCausalLM", gguf_architecture="gemma3",
           qk_norm=True, sandwich_norms=True, hidden_act="gelu_pytorch_tanh",
           activation_key="hidden_activation", embed_scale=True, query_pre_attn_scalar=256,
           norm_offset=1.0, tie_word_embeddings=True, windows=PATTERN, global_every=6,
           rope_local_theta=10000.0, gguf_query_scalar=_gemma3_query_scalar,
           hf_extra={"final_logit_softcapping": None, "attn_logit_softcapping": None,
                     "pad_token_id": 0}),
    Family("bamba", "Bamba", "BambaForCausalLM", mlp_bias=True, partial_rotary_factor=0.5,
           hybrid=True, hf_extra={"pad_token_id": None}),
)
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}
BY_GGUF = {name: f for f in FAMILIES for name in f.gguf_names}
if len(BY_MODEL_TYPE) < len(FAMILIES) or len(BY_GGUF) < sum(len(f.gguf_names) for f in FAMILIES):
    raise ValueError("FAMILIES names a model_type or a GGUF architecture twice")


def family_for_hf(model_type: str | None) -> Family:
    """The family of a config.json's (and a `ModelConfig`'s) model_type."""
    if model_type not in BY_MODEL_TYPE:
        raise ValueError(f"unsupported model_type {model_type!r} (supported: "
                         f"{', '.join(BY_MODEL_TYPE)})")
    return BY_MODEL_TYPE[model_type]


def family_for_gguf(architecture: str | None) -> Family:
    """The family of a GGUF file's `general.architecture`."""
    if architecture not in BY_GGUF:
        raise CheckpointError(f"GGUF architecture {architecture!r} is not supported "
                              f"(supported: {', '.join(BY_GGUF)})")
    return BY_GGUF[architecture]
