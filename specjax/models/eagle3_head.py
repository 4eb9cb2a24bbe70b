"""The EAGLE-3 draft head (Flax NNX), parameter for parameter the public checkpoint layout.

The head sees the target's hidden states and the target's token embeddings (it owns no
embedding table). One draft step, for a row of tokens:

    first step:  hidden = fuse(captured)          # captured [3, B, T, H] -> fc -> [B, T, H]
    later steps: hidden = the head's own previous `hidden_out`
    q, k, v, residual = qkv_and_residual(embeds, hidden, positions)
    attn_out          = attention(q, k, v)       # dense here; the paged KV pool in the engine
    hidden_out        = finish(attn_out, residual)
    draft logits      = logits(hidden_out)       # [B, T, draft_vocab]; ids -> to_target_ids

`embeds[b, t]` is the target's embedding of the token that FOLLOWS the one whose hidden state
is `hidden[b, t]` (EAGLE's shift by one: hidden state at t + token t+1 -> predicts t+2), and
`positions[b, t]` is the position of that hidden state. Inside the midlayer the q/k/v
projections read concat(input_layernorm(embeds), hidden_norm(hidden)) (2H wide), the residual
is the un-normalised `hidden`; `hidden_out` is taken before the final `norm`.

Parameters are stored `[in, out]` (the public files hold `[out, in]`; see
`specjax.speculative.eagle3_checkpoint`). `d2t` and `t2d` are vocabulary maps, not trainable
parameters: they are `VocabMap` variables, so `nnx.state(head, nnx.Param)` leaves them out.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.config import (DTYPES, RopeScaling, check_attention_fields, rope_from_hf,
                                   rope_scaling_to_hf)
from specjax.models.fused import fuse_projections, linear_parts, projection_sizes
from specjax.models.linear import linear
from specjax.models.llama import HeadAttendFn, dense_attention, rms_norm
from specjax.models.rope import apply_rope, rope_tables

NUM_CAPTURED = 3  # EAGLE-3 fuses three captured target layers


@dataclasses.dataclass(frozen=True)
class Eagle3HeadConfig:
    """Static shape of an EAGLE-3 head (frozen and hashable: safe as a jit static argument).

    The RoPE fields have the names `specjax.models.rope` reads, so the head's rotary tables
    come from the same code as the target's.
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int            # the target's vocabulary (t2d's length)
    draft_vocab_size: int      # the head's output width (d2t's length)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    dtype: str = "float32"
    initializer_range: float = 0.02
    # The target layers the head was trained on (config.json's
    # eagle_config.eagle_aux_hidden_state_layer_ids); None: not recorded.
    aux_hidden_state_layers: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.aux_hidden_state_layers is not None:
            layers = tuple(self.aux_hidden_state_layers)
            if len(layers) != NUM_CAPTURED or any(
                    isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers):
                raise ValueError("Eagle3HeadConfig.aux_hidden_state_layers must be 3 layer "
                                 f"indices >= 0, got {self.aux_hidden_state_layers!r}")
            object.__setattr__(self, "aux_hidden_state_layers", layers)
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                     "vocab_size", "draft_vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Eagle3HeadConfig.{name} must be a positive int, got {value!r}")
        check_attention_fields("Eagle3HeadConfig", self.num_heads, self.num_kv_heads,
                               self.head_dim, self.dtype)
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"Eagle3HeadConfig.draft_vocab_size ({self.draft_vocab_size}) exceeds "
                             f"vocab_size ({self.vocab_size})")

    def replace(self, **changes) -> "Eagle3HeadConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int | None = None,
                   **overrides) -> "Eagle3HeadConfig":
        """A head shaped like one decoder layer of `target_config` (a `ModelConfig`)."""
        fields = dict(
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_heads=target_config.num_heads, num_kv_heads=target_config.num_kv_heads,
            head_dim=target_config.head_dim, vocab_size=target_config.vocab_size,
            draft_vocab_size=draft_vocab_size or target_config.vocab_size,
            rms_norm_eps=target_config.rms_norm_eps, rope_theta=target_config.rope_theta,
            rope_scaling=target_config.rope_scaling, dtype=target_config.dtype)
        fields.update(overrides)
        return cls(**fields)

    # ---- the public config.json (Llama-style plus draft_vocab_size) ------------------------

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], dtype: str | None = None) -> "Eagle3HeadConfig":
        """Read a public EAGLE-3 `config.json`; refuses what the head does not implement."""
        layers = hf.get("num_hidden_layers", 1)
        if layers != 1:
            raise ValueError(f"EAGLE-3 config.json has num_hidden_layers={layers}: the head "
                             "has exactly one midlayer")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} in EAGLE-3 config.json (only silu)")
        target_hidden = hf.get("target_hidden_size")
        if target_hidden is not None and target_hidden != hf["hidden_size"]:
            raise ValueError(f"EAGLE-3 config.json has target_hidden_size={target_hidden} != "
                             f"hidden_size={hf['hidden_size']}: heads narrower than their "
                             "target are not supported")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"unsupported {flag}=true in EAGLE-3 config.json")
        num_heads = hf["num_attention_heads"]
        theta, scaling = rope_from_hf(hf)
        if dtype is None:
            dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
            dtype = dtype if dtype in DTYPES else "float32"
        aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            aux_hidden_state_layers=tuple(aux) if aux is not None else None,
            hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            vocab_size=hf["vocab_size"],
            draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            dtype=dtype, initializer_range=hf.get("initializer_range", 0.02))

    def to_hf_dict(self) -> dict[str, Any]:
        """The public config.json for this head (`from_hf_dict` reads it back equal)."""
        hf: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
            "initializer_range": self.initializer_range,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = rope_scaling_to_hf(self.rope_scaling)
        if self.aux_hidden_state_layers is not None:
            hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids":
                                  list(self.aux_hidden_state_layers)}
        return hf


class VocabMap(nnx.Variable):
    """A non-trainable vocabulary map (d2t, t2d): excluded from `nnx.Param` filters."""


def eagle3_param_shapes(config: Eagle3HeadConfig) -> dict[str, tuple[int, ...]]:
    """specjax shapes (`[in, out]`) of the midlayer's parameters."""
    H, F, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    return {"input_layernorm": (H,), "hidden_norm": (H,), "q_proj": (2 * H, q),
            "k_proj": (2 * H, kv), "v_proj": (2 * H, kv), "o_proj": (q, H),
            "post_attention_layernorm": (H,), "gate_proj": (H, F), "up_proj": (H, F),
            "down_proj": (F, H)}


class Eagle3Head(nnx.Module):
    """EAGLE-3 head: fc [3H -> H], one midlayer, norm, lm_head [H -> draft_vocab], d2t, t2d."""

    def __init__(self, config: Eagle3HeadConfig, rngs: nnx.Rngs):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        init = nnx.initializers.normal(config.initializer_range)
        H = config.hidden_size
        self.fc = nnx.Param(init(rngs.params(), (NUM_CAPTURED * H, H), dtype))
        self.midlayer = nnx.Dict({
            name: nnx.Param(jnp.ones(shape, dtype) if name.endswith("norm")
                            else init(rngs.params(), shape, dtype))
            for name, shape in eagle3_param_shapes(config).items()})
        self.norm = nnx.Param(jnp.ones((H,), dtype))
        self.lm_head = nnx.Param(init(rngs.params(), (H, config.draft_vocab_size), dtype))
        # Identity map by default: draft id i is target id i.
        self.d2t = VocabMap(jnp.zeros((config.draft_vocab_size,), jnp.int32))
        self.t2d = VocabMap(jnp.arange(config.vocab_size) < config.draft_vocab_size)

    def for_inference(self) -> "Eagle3Head":
        """The layout the engine's steps run: a copy whose midlayer has q/k/v and gate/up
        fused (`specjax.models.fused`); the checkpoint layout is unchanged."""
        if "qkv_proj" in self.midlayer:
            return self
        head = nnx.merge(*nnx.split(self))
        head.midlayer = nnx.Dict({name: nnx.Param(array) for name, array
                                  in fuse_projections(self._midlayer_params()).items()})
        return head

    def _midlayer_params(self) -> dict[str, jax.Array]:
        return {name: p[...] for name, p in self.midlayer.items()}

    # ---- pure pieces (the engine's worker composes these around its paged attention) -------

    def fuse(self, captured: jax.Array) -> jax.Array:
        """captured `[3, B, T, H]` (target residual streams, capture layers in ascending order)
        -> `[B, T, H]`: fc over their concatenation [low | mid | high] along the features."""
        C, B, T, H = captured.shape
        if C != NUM_CAPTURED or H != self.config.hidden_size:
            raise ValueError(f"fuse expects captured [3, B, T, {self.config.hidden_size}], "
                             f"got {tuple(captured.shape)}")
        stacked = captured.transpose(1, 2, 0, 3).reshape(B, T, C * H)
        return linear(stacked, self.fc[...])

    def qkv_and_residual(self, embeds: jax.Array, hidden: jax.Array, positions: jax.Array
                         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """embeds, hidden `[B, T, H]`, positions `[B, T]` -> (q `[B, T, heads, hd]`,
        k `[B, T, kv, hd]`, v `[B, T, kv, hd]`, residual `[B, T, H]`); RoPE applied to q, k."""
        cfg = self.config
        lp = self.midlayer
        B, T, _ = hidden.shape
        x = jnp.concatenate([rms_norm(embeds, lp["input_layernorm"][...], cfg.rms_norm_eps),
                             rms_norm(hidden, lp["hidden_norm"][...], cfg.rms_norm_eps)], axis=-1)
        q, k, v = linear_parts(x, self._midlayer_params(), "qkv", projection_sizes(cfg)["qkv"])
        q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = rope_tables(cfg, positions)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, hidden

    def finish(self, attn_out: jax.Array, residual: jax.Array) -> jax.Array:
        """attn_out `[B, T, heads, hd]`, residual `[B, T, H]` -> hidden_out `[B, T, H]`:
        o_proj + residual, then post-attention norm + SwiGLU MLP + residual."""
        cfg = self.config
        lp = self.midlayer
        B, T = attn_out.shape[:2]
        x = residual + linear(attn_out.reshape(B, T, cfg.num_heads * cfg.head_dim),
                              lp["o_proj"][...])
        h = rms_norm(x, lp["post_attention_layernorm"][...], cfg.rms_norm_eps)
        gate, up = linear_parts(h, self._midlayer_params(), "gate_up",
                                projection_sizes(cfg)["gate_up"])
        return x + linear(jax.nn.silu(gate) * up, lp["down_proj"][...])

    def logits(self, hidden_out: jax.Array) -> jax.Array:
        """`[..., H]` -> float32 `[..., draft_vocab]` (final norm + lm_head)."""
        h = rms_norm(hidden_out, self.norm[...], self.config.rms_norm_eps)
        return linear(h, self.lm_head[...]).astype(jnp.float32)

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        """Draft-vocabulary ids -> target ids: `draft + d2t[draft]`."""
        return draft_ids + jnp.take(self.d2t[...], draft_ids, axis=0)

    def to_target_vocab(self, values: jax.Array, fill_value: float = 0.0) -> jax.Array:
        """Scatter `[..., draft_vocab]` values (probabilities, logits) onto `[..., vocab]` at
        the target ids; other ids get `fill_value` (0 for probabilities, -inf for logits)."""
        ids = self.to_target_ids(jnp.arange(self.config.draft_vocab_size))
        out = jnp.full((*values.shape[:-1], self.config.vocab_size), fill_value, values.dtype)
        return out.at[..., ids].set(values)

    def run_layer(self, embeds: jax.Array, hidden: jax.Array, positions: jax.Array,
                  attend: HeadAttendFn, state: Any = None) -> tuple[jax.Array, Any]:
        """The midlayer with a pluggable `attend(q, k, v, state) -> (out, state)` (the paged
        KV pool in the engine): returns (hidden_out `[B, T, H]`, state)."""
        q, k, v, residual = self.qkv_and_residual(embeds, hidden, positions)
        attn_out, state = attend(q, k, v, state)
        return self.finish(attn_out, residual), state

    # ---- dense reference forward (training, tests) -----------------------------------------

    def forward(self, embeds: jax.Array, captured_or_hidden: jax.Array,
                positions: jax.Array | None = None, is_first_step: bool = True
                ) -> tuple[jax.Array, jax.Array]:
        """Dense causal forward over whole rows: `[B, T, H]` embeds and either captured
        `[3, B, T, H]` (is_first_step) or the head's previous hidden_out `[B, T, H]`.

        Returns (draft logits `[B, T, draft_vocab]` float32, hidden_out `[B, T, H]`).
        """
        want = 4 if is_first_step else 3
        if captured_or_hidden.ndim != want:
            raise ValueError(
                f"is_first_step={is_first_step} expects "
                f"{'captured [3, B, T, H]' if is_first_step else 'hidden [B, T, H]'}, "
                f"got shape {tuple(captured_or_hidden.shape)}")
        hidden = self.fuse(captured_or_hidden) if is_first_step else captured_or_hidden
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(hidden.shape[1]), hidden.shape[:2])
        attend = lambda q, k, v, state: (dense_attention(q, k, v, positions, positions), state)
        hidden_out, _ = self.run_layer(embeds, hidden, positions, attend)
        return self.logits(hidden_out), hidden_out
