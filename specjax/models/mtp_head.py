"""Multi-token prediction modules (DeepSeek-V3 style) in Flax NNX.

Module k combines the hidden state at position i (the target's for k = 1, module k-1's after)
with the target's embedding of token i+k, and predicts token i+k+1:

    x          = eh_proj(concat(enorm(embeds), hnorm(hidden)))     # [2H -> H]
    q, k, v    = the target-style decoder layer's projections of x (RoPE at `positions`)
    hidden_out = the rest of that layer (o_proj + residual x, post-attention norm, MLP)
    logits     = lm_head(final_norm(hidden_out))

`positions[b, i]` is the position of the hidden state (the embedded token sits one ahead).
The decoder layer has exactly the target's structure (same `ModelConfig`, same parameter names
and `[in, out]` layout as a `Llama` layer, including q/k/v biases and q/k norms where the target
has them); attention is full causal (no sliding window). Each module owns its final norm
(DeepSeek-V3's per-module `shared_head.norm`); the LM head is the target's, passed in as a
`[H, vocab]` matrix (`target_lm_head(target)`).

`MTPHeads` holds the modules: D of them for MTP (module k drafts token k) or a single one that
MTP-Eagle reuses for every draft step. As in the EAGLE-3 head the attention is split out
(`qkv_and_residual` / `finish`, or `run_layer` with an `attend` callback) so the engine can run
it over its paged KV pool; `forward` is the dense reference for training and tests.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.config import ModelConfig
from specjax.models.fused import fuse_projections
from specjax.models.linear import linear
from specjax.models.llama import (HeadAttendFn, Llama, dense_attention, init_params,
                                  layer_finish, layer_param_shapes, layer_qkv, rms_norm)
from specjax.models.rope import rope_tables


def target_lm_head(target: Llama) -> jax.Array:
    """The target's LM head as a `[H, vocab]` matrix (the embedding's transpose if tied)."""
    return target.head_weight()


def _dense_attend(positions: jax.Array) -> HeadAttendFn:
    return lambda q, k, v, state: (dense_attention(q, k, v, positions, positions), state)


def _default_positions(x: jax.Array, positions: jax.Array | None) -> jax.Array:
    if positions is None:
        return jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    return positions


class MTPModule(nnx.Module):
    """One MTP module for a target with `config`: enorm, hnorm, eh_proj [2H -> H], one
    target-style decoder layer (`block`, `Llama` layer names), final_norm."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        init = nnx.initializers.normal(config.initializer_range)
        H = config.hidden_size
        self.enorm = nnx.Param(jnp.ones((H,), dtype))
        self.hnorm = nnx.Param(jnp.ones((H,), dtype))
        self.eh_proj = nnx.Param(init(rngs.params(), (2 * H, H), dtype))
        self.block = nnx.Dict(init_params(layer_param_shapes(config), dtype, init, rngs))
        self.final_norm = nnx.Param(jnp.ones((H,), dtype))

    def _block_params(self) -> dict[str, jax.Array]:
        return {name: p[...] for name, p in self.block.items()}

    # ---- pure pieces ------------------------------------------------------------------------

    def fuse(self, embeds: jax.Array, hidden: jax.Array) -> jax.Array:
        """embeds, hidden `[B, T, H]` -> eh_proj(concat(enorm(embeds), hnorm(hidden)))."""
        eps = self.config.rms_norm_eps
        x = jnp.concatenate([rms_norm(embeds, self.enorm[...], eps),
                             rms_norm(hidden, self.hnorm[...], eps)], axis=-1)
        return linear(x, self.eh_proj[...])

    def qkv_and_residual(self, embeds: jax.Array, hidden: jax.Array, positions: jax.Array
                         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """-> (q `[B, T, heads, hd]`, k, v `[B, T, kv, hd]`, residual `[B, T, H]` = the fused
        input); RoPE applied at `positions` `[B, T]`."""
        x = self.fuse(embeds, hidden)
        cos, sin = rope_tables(self.config, positions)
        q, k, v = layer_qkv(self.config, self._block_params(), x, cos, sin)
        return q, k, v, x

    def finish(self, attn_out: jax.Array, residual: jax.Array) -> jax.Array:
        """attn_out `[B, T, heads, hd]`, residual `[B, T, H]` -> hidden_out `[B, T, H]`
        (before the final norm: this is what the next MTP step reads as `hidden`)."""
        return layer_finish(self.config, self._block_params(), attn_out, residual)

    def logits(self, hidden_out: jax.Array, lm_head: jax.Array) -> jax.Array:
        """`[..., H]` -> float32 `[..., vocab]` through final_norm and the target's
        `lm_head` `[H, vocab]`."""
        h = rms_norm(hidden_out, self.final_norm[...], self.config.rms_norm_eps)
        return linear(h, lm_head).astype(jnp.float32)

    def run_layer(self, embeds: jax.Array, hidden: jax.Array, positions: jax.Array,
                  attend: HeadAttendFn, state: Any = None) -> tuple[jax.Array, Any]:
        """The module up to hidden_out with a pluggable `attend(q, k, v, state) -> (out,
        state)` (the paged KV pool in the engine)."""
        q, k, v, residual = self.qkv_and_residual(embeds, hidden, positions)
        attn_out, state = attend(q, k, v, state)
        return self.finish(attn_out, residual), state

    def forward(self, embeds: jax.Array, hidden: jax.Array, lm_head: jax.Array,
                positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Dense causal forward: -> (logits `[B, T, vocab]` float32, hidden_out `[B, T, H]`)."""
        positions = _default_positions(hidden, positions)
        hidden_out, _ = self.run_layer(embeds, hidden, positions, _dense_attend(positions))
        return self.logits(hidden_out, lm_head), hidden_out


class MTPHeads(nnx.Module):
    """`num_modules` MTP modules. With one module (MTP-Eagle, or vanilla MTP with D = 1) every
    draft step reuses it; with more, draft step k uses module k (so at most `num_modules`
    steps). `module_for_step(k)` is the one rule both the engine and `forward` follow."""

    def __init__(self, config: ModelConfig, num_modules: int, rngs: nnx.Rngs):
        if isinstance(num_modules, bool) or not isinstance(num_modules, int) or num_modules < 1:
            raise ValueError(f"num_modules must be a positive int, got {num_modules!r}")
        self.config = config
        self.num_modules = num_modules
        self.modules = nnx.List([MTPModule(config, rngs) for _ in range(num_modules)])

    def for_inference(self) -> "MTPHeads":
        """The layout the engine's steps run: a copy whose modules' decoder layers have q/k/v
        and gate/up fused (`specjax.models.fused`); the checkpoint layout is unchanged."""
        if "qkv_proj" in self.modules[0].block:
            return self
        heads = nnx.merge(*nnx.split(self))
        for module in heads.modules:
            module.block = nnx.Dict({name: nnx.Param(array) for name, array
                                     in fuse_projections(module._block_params()).items()})
        return heads

    @property
    def reuses_one_module(self) -> bool:
        return self.num_modules == 1

    def max_draft_steps(self) -> int | None:
        """Draft steps these heads can make: unbounded (None) when one module is reused."""
        return None if self.reuses_one_module else self.num_modules

    def module_for_step(self, step: int) -> MTPModule:
        """The module that drafts step `step` (0-based: step 0 predicts the token after the
        target's bonus token)."""
        if self.reuses_one_module:
            return self.modules[0]
        if not 0 <= step < self.num_modules:
            raise ValueError(f"draft step {step} needs MTP module {step}, but there are only "
                             f"{self.num_modules} (steps 0..{self.num_modules - 1})")
        return self.modules[step]

    def forward(self, embeds: jax.Array, hidden: jax.Array, lm_head: jax.Array,
                num_steps: int | None = None, positions: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
        """Dense training-style chain over whole sequences.

        embeds `[B, T, H]`: the target's embeddings of tokens 0..T-1; hidden `[B, T, H]`: the
        target's last residual stream (before its final norm) at positions 0..T-1. Step k
        (0-based) feeds embeds shifted left by k+1 (zeros past the end) with step k-1's
        hidden_out (the target's for k = 0), so logits[k][:, i] predicts token i+k+2; only
        i < T-k-1 have a real input token.

        Returns (logits `[S, B, T, vocab]` float32, hidden_outs `[S, B, T, H]`), S = num_steps
        (default: num_modules).
        """
        num_steps = self.num_modules if num_steps is None else num_steps
        positions = _default_positions(hidden, positions)
        T = hidden.shape[1]
        all_logits, all_hidden = [], []
        for step in range(num_steps):
            module = self.module_for_step(step)
            shift = min(step + 1, T)
            shifted = jnp.concatenate(
                [embeds[:, shift:], jnp.zeros_like(embeds[:, :shift])], axis=1)
            logits, hidden = module.forward(shifted, hidden, lm_head, positions)
            all_logits.append(logits)
            all_hidden.append(hidden)
        return jnp.stack(all_logits), jnp.stack(all_hidden)
