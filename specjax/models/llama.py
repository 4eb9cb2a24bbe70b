"""Llama-family decoder in Flax NNX: Llama 3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

Layer parameters come in two layouts. Stacked (the default): one array per parameter with a
leading `[L]` axis, run under `lax.scan`, so the compiled program holds one layer body
whatever the depth -- what keeps compiling a step a matter of seconds. Unstacked
(`model.unstacked()`): one array per layer, run as an unrolled loop (L copies of the layer in
every program). `model.for_inference()`, what the engine runs, fuses q/k/v and gate/up
(`specjax.models.fused`) in either layout: stacked by default, unrolled with
`scan_layers=False` -- the engine's default on CPU, where XLA copies a scanned layer's weights
out of the stack before its matmuls (`python -m specjax.bench xla` times the layouts).

The layer body takes an `attend` callback: the dense reference forward here plugs in causal
attention over the run itself; the paged engine plugs in attention over its KV pool, reusing
every other line of the layer.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.cpu_matmul import quant
from pallas_kernels.paged_attention.reference import NO_WINDOW, dense_attention
from specjax.models.config import ModelConfig
from specjax.models.fused import (fuse_projections, linear_parts, projection_sizes,
                                  unfuse_projections)
from specjax.models.linear import linear
from specjax.models.rope import apply_rope, local_rope_config, rope_tables

# Per-layer attention: (q [B,T,H,hd], k [B,T,KV,hd], v [B,T,KV,hd], layer index, state) ->
# (out [B,T,H,hd], new state). `state` (e.g. the paged KV pool) is carried through the layer
# loop rather than scanned over, so XLA updates it in place.
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
# A drafter head's one layer: the same without the layer index.
HeadAttendFn = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]



def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Normalise in float32, cast back, then scale (the Hugging Face order, for exact parity)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def layer_windows(config: ModelConfig) -> jax.Array:
    """`[L_kv]` int32: each attention layer's sliding window (`config.kv_layers`: every layer
    but a hybrid's recurrent ones), NO_WINDOW for full attention."""
    windows = config.sliding_windows or (None,) * config.num_layers
    return jnp.asarray([windows[i] or NO_WINDOW for i in config.kv_layers], jnp.int32)


def layer_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's parameters (the stacked arrays add a leading `[L]`)."""
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    shapes = {
        "input_norm": (d,), "q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv),
        "o_proj": (q, d), "post_norm": (d,), "gate_proj": (d, f), "up_proj": (d, f),
        "down_proj": (f, d),
    }
    if config.qkv_bias:
        shapes.update(q_bias=(q,), k_bias=(kv,), v_bias=(kv,))
    if config.o_bias:
        shapes["o_bias"] = (d,)
    if config.mlp_bias:
        shapes.update(gate_bias=(f,), up_bias=(f,), down_bias=(d,))
    if config.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    if config.sandwich_norms:
        shapes.update(attn_out_norm=(d,), ffn_out_norm=(d,))
    return shapes


def layer_rope(config: ModelConfig, positions: jax.Array) -> Callable[[Any], tuple]:
    """`index -> (cos, sin)` for layer `index` (an int, or traced under `lax.scan`): the
    global tables, or the local ones on a sliding-window layer of a model whose local layers
    rotate with their own base (Gemma 3). Each table is computed once per forward."""
    tables = rope_tables(config, positions)
    local = local_rope_config(config)
    if local is None:
        return lambda index: tables
    local_tables = rope_tables(local, positions)
    is_local = [w is not None for w in config.sliding_windows]
    flags = jnp.asarray(is_local)

    def pick(index):
        if isinstance(index, int):
            return local_tables if is_local[index] else tables
        return tuple(jnp.where(flags[index], a, b) for a, b in zip(local_tables, tables))
    return pick


def activation(config: ModelConfig, x: jax.Array) -> jax.Array:
    """The MLP's gate activation (`ModelConfig.hidden_act`)."""
    if config.hidden_act == "gelu_pytorch_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)


def init_params(shapes: dict[str, tuple[int, ...]], dtype, init, rngs: nnx.Rngs,
                fixed: dict[str, Callable[[], jax.Array]] | None = None
                ) -> dict[str, nnx.Param]:
    """Fresh parameters by name, in `shapes`' order: `fixed[name]()` where given, norms ones,
    biases zeros, the rest drawn from `init` (one key each, so the same shapes and seed give
    the same values)."""
    params = {}
    for name, shape in shapes.items():
        if fixed and name in fixed:
            params[name] = nnx.Param(fixed[name]())
        elif name.endswith("norm"):
            params[name] = nnx.Param(jnp.ones(shape, dtype))
        elif name.endswith("bias"):
            params[name] = nnx.Param(jnp.zeros(shape, dtype))
        else:
            params[name] = nnx.Param(init(rngs.params(), shape, dtype))
    return params


class Llama(nnx.Module):
    """The target model. `model(tokens) -> logits`; see `forward` for hidden-state capture."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        init = nnx.initializers.normal(config.initializer_range)
        L, d = config.num_layers, config.hidden_size
        self.embed = nnx.Param(init(rngs.params(), (config.vocab_size, d), dtype))
        self.layers = nnx.Dict(init_params(
            {name: (L, *shape) for name, shape in layer_param_shapes(config).items()},
            dtype, init, rngs))
        self.final_norm = nnx.Param(jnp.ones((d,), dtype))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(init(rngs.params(), (d, config.vocab_size), dtype))

    # -- pieces reused by the engine's paged forward -------------------------------------------

    @property
    def stacked(self) -> bool:
        return isinstance(self.layers, nnx.Dict)

    def layer_params(self) -> dict[str, jax.Array]:
        """Stacked layer parameters as plain arrays under their checkpoint names,
        `{name: [L, ...]}` (any layout). Quantized layers of different types (a `_K_M`
        GGUF's, held unrolled) do not stack: those parameters come dequantized to float32."""
        sizes = projection_sizes(self.config)
        if self.stacked:
            return unfuse_projections({name: p[...] for name, p in self.layers.items()}, sizes)
        layers = self._unfused_layers()
        return {name: _stack([layer[name] for layer in layers]) for name in layers[0]}

    def _unfused_layers(self) -> list[dict[str, jax.Array]]:
        sizes = projection_sizes(self.config)
        return [unfuse_projections({n: p[...] for n, p in layer.items()}, sizes)
                for layer in self.layers]

    @property
    def fused(self) -> bool:
        """Whether q/k/v and gate/up are concatenated (`specjax.models.fused`)."""
        names = self.layers if self.stacked else self.layers[0]
        return "gate_up_proj" in names

    def restacked(self, fused: bool = False) -> "Llama":
        """The same model in the stacked layout, q/k/v and gate/up concatenated if `fused`."""
        if self.stacked and fused == self.fused:
            return self
        model = nnx.merge(*nnx.split(self))
        stacked = self.layer_params()
        if fused:
            stacked = fuse_projections(stacked)
        model.layers = nnx.Dict({name: nnx.Param(array) for name, array in stacked.items()})
        return model

    def unstacked(self, fused: bool = False) -> "Llama":
        """The same model with one parameter set per layer (sharing every array unless
        `fused`: then each layer's q/k/v and gate/up are concatenated into one weight)."""
        if not self.stacked and fused == self.fused:
            return self
        model = nnx.merge(*nnx.split(self))
        if not self.stacked:  # each layer as it is (its types its own), unfused
            layers = self._unfused_layers()
        else:
            if fused or not self.fused:
                # Already as asked, or fusing more: each layer a view of the stacked arrays.
                stacked = {name: p[...] for name, p in self.layers.items()}
            else:
                stacked = self.layer_params()
            stacked = {name: layer_views(array) for name, array in stacked.items()}
            layers = [{name: views[i] for name, views in stacked.items()}
                      for i in range(self.config.num_layers)]
        if fused:
            layers = [fuse_projections(layer) for layer in layers]
        model.layers = nnx.List([nnx.Dict({name: nnx.Param(array)
                                           for name, array in layer.items()})
                                 for layer in layers])
        return model

    def for_inference(self, scan_layers: bool = True) -> "Llama":
        """The layout the engine's steps run: q/k/v and gate/up fused, layers stacked (run
        under `lax.scan`) or, with `scan_layers=False`, unrolled."""
        return self.restacked(fused=True) if scan_layers else self.unstacked(fused=True)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens `[B, T]` -> `[B, T, D]` (from a quantized GGUF's tied embedding, kept as its
        LM head `[D, V]` quantized: only the looked-up rows are dequantized)."""
        embed = self.embed[...]
        if quant.is_quantized(embed):
            x = quant.take_columns(embed, tokens).astype(self.config.dtype)
        else:
            x = jnp.take(embed, tokens, axis=0)
        if self.config.embed_scale:
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)
        return x

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm + LM head: `[..., D]` -> float32 `[..., V]`."""
        h = rms_norm(hidden, self.final_norm[...], self.config.rms_norm_eps)
        return linear(h, self.head_weight()).astype(jnp.float32)

    def head_weight(self) -> jax.Array:
        """The LM head `[D, V]` (the embedding's transpose if tied), or the packed copy
        `specjax.models.linear.packed_for_cpu` gave it, or a quantized GGUF's (the embedding
        itself, kept in the head's layout)."""
        if hasattr(self, "lm_head"):
            return self.lm_head[...]
        embed = self.embed[...]
        return embed if quant.is_quantized(embed) else embed.T

    def run_layers(self, x: jax.Array, positions: jax.Array, attend: AttendFn, state: Any,
                   capture_layers: Sequence[int] = ()) -> tuple[jax.Array, jax.Array, Any]:
        """Run every decoder layer.

        x `[B, T, D]`, positions `[B, T]`; `state` is carried through the layers and handed to
        `attend` with the layer index. Returns (x `[B, T, D]`, captured `[C, B, T, D]` residual
        streams after each layer in `capture_layers`, final state).
        """
        cfg = self.config
        rope = layer_rope(cfg, positions)
        if not self.stacked:
            captured = {}
            for index, layer in enumerate(self.layers):
                lp = {name: p[...] for name, p in layer.items()}
                x, state = decoder_layer(cfg, lp, x, *rope(index),
                                         lambda q, k, v, s: attend(q, k, v, index, s), state)
                captured[index] = x
            stack = jnp.stack([captured[i] for i in capture_layers]) if capture_layers else \
                jnp.zeros((0, *x.shape), x.dtype)
            return x, stack, state
        capture = jnp.asarray(tuple(capture_layers), jnp.int32).reshape(-1)
        captured0 = jnp.zeros((capture.shape[0], *x.shape), x.dtype)

        def body(carry, xs):
            x, captured, state = carry
            lp, index = xs
            x, state = decoder_layer(cfg, lp, x, *rope(index),
                                     lambda q, k, v, s: attend(q, k, v, index, s), state)
            hit = (capture == index)[:, None, None, None]
            captured = jnp.where(hit, x[None], captured)
            return (x, captured, state), None

        xs = ({name: p[...] for name, p in self.layers.items()}, jnp.arange(cfg.num_layers))
        (x, captured, state), _ = jax.lax.scan(body, (x, captured0, state), xs)
        return x, captured, state

    # -- dense reference forward (no cache) -----------------------------------------------------

    def forward(self, tokens: jax.Array, positions: jax.Array | None = None,
                capture_layers: Sequence[int] = ()) -> tuple[jax.Array, jax.Array]:
        """Dense causal forward over whole sequences.

        tokens `[B, T]` int32 -> (logits `[B, T, V]` float32, captured `[C, B, T, D]`), where
        captured[c] is the residual stream after layer `capture_layers[c]` (0-based; Hugging
        Face's `hidden_states[i + 1]`).
        """
        _check_capture_layers(self.config, capture_layers)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        windows = layer_windows(self.config)
        attend = lambda q, k, v, layer, state: (
            dense_attention(q, k, v, positions, positions, windows[layer]), state)
        x, captured, _ = self.run_layers(self.embed_tokens(tokens), positions, attend, None,
                                         capture_layers)
        return self.logits(x), captured

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """tokens `[B, T]` int32 -> logits `[B, T, V]` float32."""
        return self.forward(tokens, positions)[0]


def _check_capture_layers(config: ModelConfig, layers: Sequence[int]) -> None:
    for layer in layers:
        if not 0 <= layer < config.num_layers:
            raise ValueError(f"capture layer {layer} is outside the model's "
                             f"{config.num_layers} layers (0..{config.num_layers - 1})")


def layer_qkv(cfg: ModelConfig, lp: dict[str, jax.Array], x: jax.Array, cos: jax.Array,
              sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x `[B, T, H]` -> q `[B, T, heads, hd]`, k, v `[B, T, kv, hd]` (norm, biases, q/k norm,
    RoPE)."""
    B, T, _ = x.shape
    hd = cfg.head_dim
    h = rms_norm(x, lp["input_norm"], cfg.rms_norm_eps)
    q, k, v = linear_parts(h, lp, "qkv", projection_sizes(cfg)["qkv"], cfg.qkv_bias)
    q = q.reshape(B, T, cfg.num_heads, hd)
    k = k.reshape(B, T, cfg.num_kv_heads, hd)
    v = v.reshape(B, T, cfg.num_kv_heads, hd)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    if cfg.query_scale is not None:  # attention scales by head_dim ** -0.5 itself
        q = q * jnp.asarray(cfg.query_scale, q.dtype)
    return q, apply_rope(k, cos, sin), v


def layer_finish(cfg: ModelConfig, lp: dict[str, jax.Array], attn: jax.Array,
                 residual: jax.Array) -> jax.Array:
    """attn `[B, T, heads, hd]`, residual `[B, T, H]` -> layer output `[B, T, H]`."""
    B, T = attn.shape[:2]
    attn = linear(attn.reshape(B, T, cfg.num_heads * cfg.head_dim), lp["o_proj"])
    if cfg.o_bias:
        attn = attn + lp["o_bias"]
    if cfg.sandwich_norms:
        attn = rms_norm(attn, lp["attn_out_norm"], cfg.rms_norm_eps)
    return mlp_block(cfg, lp, residual + attn)


def mlp_block(cfg: ModelConfig, lp: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """The second half of every layer (attention or recurrent): x `[B, T, H]` plus the gated
    MLP of its post-norm."""
    h = rms_norm(x, lp["post_norm"], cfg.rms_norm_eps)
    gate, up = linear_parts(h, lp, "gate_up", projection_sizes(cfg)["gate_up"], cfg.mlp_bias)
    down = linear(activation(cfg, gate) * up, lp["down_proj"])
    if cfg.mlp_bias:
        down = down + lp["down_bias"]
    if cfg.sandwich_norms:
        down = rms_norm(down, lp["ffn_out_norm"], cfg.rms_norm_eps)
    return x + down


def decoder_layer(cfg: ModelConfig, lp: dict[str, jax.Array], x: jax.Array, cos: jax.Array,
                  sin: jax.Array, attend: Callable, state: Any) -> tuple[jax.Array, Any]:
    """One pre-norm decoder layer on x `[B, T, D]` with this layer's params `lp`;
    `attend(q, k, v, state) -> (out, state)`. Split around its attention (`layer_qkv`,
    `layer_finish`) so that drafter blocks (MTP) are bit-for-bit target layers."""
    q, k, v = layer_qkv(cfg, lp, x, cos, sin)
    attn, state = attend(q, k, v, state)
    return layer_finish(cfg, lp, attn, x), state


def _stack(arrays: list[jax.Array]) -> jax.Array:
    """Layers' arrays as one `[L, ...]`; quantized ones of different types dequantized first
    (`layer_params`)."""
    if len({(a.shape, a.dtype) for a in arrays}) > 1 and any(map(quant.is_quantized, arrays)):
        arrays = [quant.dequantize(a) if quant.is_quantized(a) else a for a in arrays]
    return jnp.stack(arrays)


def layer_views(stacked: jax.Array) -> list[jax.Array]:
    """The layers of a stacked array `[L, ...]`. On one CPU device each is a view of its
    memory, no copy (a CPU array's numpy view shares its buffer, and `device_put` shares an
    aligned numpy array's; a misaligned layer is copied): a model unrolled for the steps
    holds its weights once, not a stacked copy beside an unrolled one."""
    devices = stacked.devices() if isinstance(stacked, jax.Array) else set()
    if len(devices) != 1 or next(iter(devices)).platform != "cpu":
        return list(stacked)
    device, host = next(iter(devices)), np.asarray(stacked)
    return [jax.device_put(host[i], device) for i in range(host.shape[0])]
