"""Bamba: a hybrid decoder whose layers are either Llama attention or Mamba-2 mixers, each
followed by the same gated MLP (Hugging Face `BambaForCausalLM`).

A Mamba-2 mixer carries, per sequence, a recurrent state instead of K/V: the last
`conv_kernel - 1` inputs of its causal convolution `[K-1, C]` and the SSM state `[H, P, N]`.
Where those come from and where they go is the caller's business (`Recurrence`): the dense
forward here starts every row from zeros and drops them; the engine reads each slot's state
and commits the state at the depth a step accepted (`specjax.core.recurrent`). So that any
depth can be committed, a mixer hands back a `MixerTape`: its convolution window, its scan
inputs and -- when asked -- its state after every position.

`Bamba` subclasses `Llama` for what they share (embedding, LM head, attention layers, the
engine's interface); its layers are always one parameter set per layer (kinds differ).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct

from pallas_kernels.ssm_scan import ssm_scan
from pallas_kernels.ssm_scan.reference import ssm_scan_states_reference
from specjax.models.config import ATTENTION, ModelConfig
from specjax.models.fused import fuse_projections, projection_sizes, unfuse_projections
from specjax.models.linear import linear
from specjax.models.llama import (AttendFn, Llama, init_params, layer_finish,
                                  layer_param_shapes, layer_qkv, mlp_block, rms_norm)
from specjax.models.rope import rope_tables


def mixer_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One Mamba-2 layer's parameters (the MLP half is the attention layers')."""
    m, d = config.mamba, config.hidden_size
    I, C, H = m.intermediate_size, m.conv_dim, m.num_heads
    shapes = {"input_norm": (d,), "in_proj": (d, I + C + H), "conv_weight": (m.conv_kernel, C),
              "dt_bias": (H,), "A_log": (H,), "D": (H,), "mixer_norm": (I,),
              "out_proj": (I, d)}
    if m.conv_bias:
        shapes["conv_bias"] = (C,)
    mlp = {"post_norm", "gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias"}
    shapes.update({k: v for k, v in layer_param_shapes(config).items() if k in mlp})
    return shapes


def layer_shapes(config: ModelConfig, index: int) -> dict[str, tuple[int, ...]]:
    return (layer_param_shapes(config) if config.layer_types[index] == ATTENTION
            else mixer_param_shapes(config))


@struct.dataclass
class MixerTape:
    """What one Mamba-2 mixer leaves over a run of T positions: enough to commit the state
    after any of them (`specjax.core.recurrent.commit_mixer`)."""

    conv_seq: jax.Array      # [B, K-1+T, C]: the previous window, then the run's conv inputs
    x: jax.Array             # [B, T, H, P] float32: scan inputs
    dt: jax.Array            # [B, T, H] float32: step sizes, 0 past the run's real positions
    b: jax.Array             # [B, T, G, N] float32
    c: jax.Array             # [B, T, G, N] float32
    a: jax.Array             # [H] float32: the decay rates (-exp(A_log))
    h0: jax.Array            # [B, H, P, N] float32: the state before the run
    h_final: jax.Array       # [B, H, P, N] float32: after the last real position
    states: jax.Array | None = None  # [B, T, H, P, N] float32: after every position


class Recurrence(Protocol):
    """Where a forward's mixers get their state and leave their tapes (by recurrent index:
    the mixer's rank among `config.recurrent_layers`)."""

    valid: jax.Array | None   # [B, T] bool: the positions that are real (others: padding)
    keep_states: bool         # whether tapes carry the state after every position

    def initial(self, index: int) -> tuple[jax.Array, jax.Array]: ...   # conv0, h0

    def record(self, index: int, tape: MixerTape) -> None: ...


class ZeroRecurrence:
    """The dense forward's: every row starts from zero state, every position is real, and
    the tapes are dropped."""

    valid, keep_states = None, False

    def __init__(self, config: ModelConfig, batch: int):
        self.config, self.batch = config, batch

    def initial(self, index):
        conv, ssm = state_shapes(self.config)
        dtype = jnp.dtype(self.config.dtype)
        return (jnp.zeros((self.batch, *conv), dtype),
                jnp.zeros((self.batch, *ssm), jnp.float32))

    def record(self, index, tape):
        pass


def state_shapes(config: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One sequence's state in one mixer: (conv window `[K-1, C]`, SSM state `[H, P, N]`)."""
    m = config.mamba
    return (m.conv_kernel - 1, m.conv_dim), (m.num_heads, m.head_dim, m.state_size)


def gated_group_norm(y: jax.Array, gate: jax.Array, weight: jax.Array, groups: int,
                     eps: float) -> jax.Array:
    """Hugging Face's BambaRMSNormGated: y * silu(gate), RMS-normalised per group, scaled."""
    y = y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    shape = y.shape
    y = y.reshape(*shape[:-1], groups, shape[-1] // groups)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps)
    return weight * y.reshape(shape).astype(weight.dtype)


def mamba_mixer(cfg: ModelConfig, lp: dict[str, jax.Array], h: jax.Array, conv0: jax.Array,
                h0: jax.Array, valid: jax.Array | None, keep_states: bool
                ) -> tuple[jax.Array, MixerTape]:
    """h `[B, T, D]` (normed) from the state (conv0 `[B, K-1, C]`, h0 `[B, H, P, N]`) ->
    (out `[B, T, D]`, tape). Positions where `valid` is False leave the state unchanged."""
    m = cfg.mamba
    B, T, _ = h.shape
    I, C, H, P, G, N = (m.intermediate_size, m.conv_dim, m.num_heads, m.head_dim,
                        m.num_groups, m.state_size)
    proj = linear(h, lp["in_proj"])
    gate, xbc, dt = proj[..., :I], proj[..., I:I + C], proj[..., I + C:]
    seq = jnp.concatenate([conv0.astype(xbc.dtype), xbc], axis=1)            # [B, K-1+T, C]
    w = lp["conv_weight"]
    conv = sum(seq[:, k:k + T] * w[k] for k in range(m.conv_kernel))
    if m.conv_bias:
        conv = conv + lp["conv_bias"]
    xbc = jax.nn.silu(conv)
    x = xbc[..., :I].reshape(B, T, H, P).astype(jnp.float32)
    b = xbc[..., I:I + G * N].reshape(B, T, G, N).astype(jnp.float32)
    c = xbc[..., I + G * N:].reshape(B, T, G, N).astype(jnp.float32)
    dt = jax.nn.softplus(dt.astype(jnp.float32) + lp["dt_bias"].astype(jnp.float32))
    dt = jnp.clip(dt, m.time_step_min, m.time_step_max)
    if valid is not None:
        dt = jnp.where(valid[..., None], dt, 0.0)
    A = -jnp.exp(lp["A_log"].astype(jnp.float32))
    h0 = h0.astype(jnp.float32)
    if keep_states:
        y, states = ssm_scan_states_reference(x, dt, A, b, c, h0)
        h_final = states[:, -1]
    else:
        (y, h_final), states = ssm_scan(x, dt, A, b, c, h0), None
    y = y + lp["D"].astype(jnp.float32)[:, None] * x
    y = gated_group_norm(y.reshape(B, T, I), gate, lp["mixer_norm"], G, cfg.rms_norm_eps)
    out = linear(y.astype(h.dtype), lp["out_proj"])
    return out, MixerTape(conv_seq=seq, x=x, dt=dt, b=b, c=c, a=A, h0=h0, h_final=h_final,
                          states=states)


class Bamba(Llama):
    """The hybrid target. `model(tokens) -> logits`; the engine runs `run_layers` with a paged
    `attend` and a `Recurrence` over its slots' states."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if not config.is_hybrid:
            raise ValueError("Bamba needs a config with Mamba layers (layer_types, mamba)")
        self.config = config
        dtype = jnp.dtype(config.dtype)
        init = nnx.initializers.normal(config.initializer_range)
        d, H = config.hidden_size, config.mamba.num_heads
        self.embed = nnx.Param(init(rngs.params(), (config.vocab_size, d), dtype))
        # Hugging Face's initial values; made per layer (one shared array would be donated
        # twice by a training step).
        fixed = {"A_log": lambda: jnp.log(jnp.arange(1, H + 1, dtype=jnp.float32)).astype(dtype),
                 "D": lambda: jnp.ones((H,), dtype), "dt_bias": lambda: jnp.ones((H,), dtype)}
        self.layers = nnx.List([nnx.Dict(init_params(layer_shapes(config, i), dtype, init, rngs,
                                                     fixed))
                                for i in range(config.num_layers)])
        self.final_norm = nnx.Param(jnp.ones((d,), dtype))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(init(rngs.params(), (d, config.vocab_size), dtype))

    @property
    def stacked(self) -> bool:
        return False

    def layer_params(self):
        raise NotImplementedError("Bamba's layers differ by kind: read model.layers[i]")

    def unstacked(self, fused: bool = False) -> "Bamba":
        """The same model with (`fused`) or without its q/k/v and gate/up concatenated."""
        if fused == ("gate_up_proj" in self.layers[0]):
            return self
        sizes = projection_sizes(self.config)
        change = fuse_projections if fused else lambda p: unfuse_projections(p, sizes)
        model = nnx.merge(*nnx.split(self))
        model.layers = nnx.List([nnx.Dict({n: nnx.Param(a) for n, a in change(
            {n: p[...] for n, p in layer.items()}).items()}) for layer in self.layers])
        return model

    def restacked(self, fused: bool = False) -> "Bamba":
        """Bamba's layers differ by kind: they stay one parameter set per layer."""
        return self.unstacked(fused)

    def for_inference(self, scan_layers: bool = True) -> "Bamba":
        """Fused q/k/v and gate/up; layers unrolled whatever `scan_layers` says (they differ
        by kind)."""
        return self.unstacked(fused=True)

    def run_layers(self, x: jax.Array, positions: jax.Array, attend: AttendFn, state: Any,
                   capture_layers: Sequence[int] = (), recurrence: Recurrence | None = None
                   ) -> tuple[jax.Array, jax.Array, Any]:
        """As `Llama.run_layers`; attention layers call `attend` with their rank among the
        attention layers (the pool holds only theirs), mixers take their state from
        `recurrence` (default: zeros) and leave their tapes there."""
        cfg = self.config
        if recurrence is None:
            recurrence = ZeroRecurrence(cfg, x.shape[0])
        cos, sin = rope_tables(cfg, positions)
        kv_rank = {layer: r for r, layer in enumerate(cfg.kv_layers)}
        mixer_rank = {layer: r for r, layer in enumerate(cfg.recurrent_layers)}
        captured = {}
        for index, layer in enumerate(self.layers):
            lp = {name: p[...] for name, p in layer.items()}
            if index in kv_rank:
                q, k, v = layer_qkv(cfg, lp, x, cos, sin)
                attn, state = attend(q, k, v, kv_rank[index], state)
                x = layer_finish(cfg, lp, attn, x)
            else:
                r = mixer_rank[index]
                conv0, h0 = recurrence.initial(r)
                out, tape = mamba_mixer(cfg, lp, rms_norm(x, lp["input_norm"], cfg.rms_norm_eps),
                                        conv0, h0, recurrence.valid, recurrence.keep_states)
                recurrence.record(r, tape)
                x = mlp_block(cfg, lp, x + out)
            captured[index] = x
        stack = jnp.stack([captured[i] for i in capture_layers]) if capture_layers else \
            jnp.zeros((0, *x.shape), x.dtype)
        return x, stack, state
