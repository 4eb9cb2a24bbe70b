"""The DFlash drafter (block diffusion, Flax NNX): a few decoder layers that propose a block of K
tokens in one forward pass, conditioned on the target's hidden states.

    context    = context_norm(concat(captured) @ fc)        # [B, T, H] per committed token
    block      = [newest token, mask x K] at positions p .. p+K
    every layer: q, k, v of the block rows; the context's own k, v from the SAME layer's
                 input norm and k/v projections ("KV injection"); the block attends to the
                 context (positions < p) and bidirectionally to itself
    drafts     = target LM head(final_norm(block rows 1..K))  # row j predicts position p + j

The drafter owns no vocabulary: block tokens are embedded with the target's table and its
logits come from the target's LM head. The mask token is `config.mask_token_id`: an id inside
the target's vocabulary embeds with the target's table; the id `vocab_size` (one past the
target's last, the default, for targets with no spare token) embeds with the drafter's own
`mask_embedding`.

The decoder layers are a `Llama` body (`body`, vocabulary of one row that holds the mask
embedding, its `final_norm` the drafter's), so they are bit-for-bit target-style layers and
share the target's inference layout (`for_inference`: fused projections, layers stacked or
unrolled as the target's).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.config import ModelConfig
from specjax.models.linear import linear
from specjax.models.llama import AttendFn, Llama, decoder_layer, layer_qkv, rms_norm
from specjax.models.mtp_head import target_lm_head
from specjax.models.rope import rope_tables



def default_target_layers(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """`count` target layers spread from the second to the second-to-last (distinct, sorted)."""
    if num_layers < 3:
        return tuple(range(num_layers))
    count = min(count, num_layers - 2)
    if count == 1:
        return (num_layers // 2,)
    span = num_layers - 3
    return tuple(sorted({1 + round(i * span / (count - 1)) for i in range(count)}))


@dataclasses.dataclass(frozen=True)
class DFlashHeadConfig:
    """Static shape of a DFlash drafter (frozen, hashable)."""

    body: ModelConfig                   # the decoder layers (hidden size = the target's)
    vocab_size: int                     # the target's vocabulary
    target_layer_ids: tuple[int, ...]   # target layers whose residual streams feed `fc`
    mask_token_id: int                  # == vocab_size: the drafter's own mask embedding
    block_size: int = 4                 # the K it was trained for (any K <= 31 runs)

    def __post_init__(self):
        if not self.target_layer_ids:
            raise ValueError("a DFlash drafter needs at least one target layer")
        if not 0 <= self.mask_token_id <= self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside [0, {self.vocab_size}]")

    @property
    def hidden_size(self) -> int:
        return self.body.hidden_size

    @property
    def num_layers(self) -> int:
        return self.body.num_layers

    @staticmethod
    def for_target(target: ModelConfig, num_layers: int, target_layer_ids: tuple[int, ...],
                   block_size: int, mask_token_id: int | None = None,
                   intermediate_size: int | None = None) -> "DFlashHeadConfig":
        """Layers shaped like the target's (its hidden size, heads and RoPE)."""
        body = target.replace(vocab_size=1, num_layers=num_layers, tie_word_embeddings=True,
                              sliding_windows=None, model_type="llama",
                              intermediate_size=intermediate_size or target.intermediate_size)
        return DFlashHeadConfig(body, target.vocab_size, tuple(target_layer_ids),
                                target.vocab_size if mask_token_id is None else mask_token_id,
                                block_size)


class DFlashHead(nnx.Module):
    def __init__(self, config: DFlashHeadConfig, *, rngs: nnx.Rngs):
        self.config = config
        H, C = config.hidden_size, len(config.target_layer_ids)
        dtype = jnp.dtype(config.body.dtype)
        init = nnx.initializers.normal(config.body.initializer_range)
        self.fc = nnx.Param(init(rngs.params(), (C * H, H), dtype))
        self.context_norm = nnx.Param(jnp.ones((H,), dtype))
        self.body = Llama(config.body, rngs=rngs)

    def for_inference(self, scan_layers: bool = True) -> "DFlashHead":
        """The layout the engine's steps run: a copy whose body is in `Llama.for_inference`'s
        layout; the checkpoint layout is unchanged."""
        body = self.body.for_inference(scan_layers)
        if body is self.body:
            return self
        head = nnx.merge(*nnx.split(self))
        head.body = body
        return head

    # -- pieces the engine and the trainer share ------------------------------------------------

    def context(self, captured: jax.Array) -> jax.Array:
        """captured `[C, B, T, H]` (the target's streams at `target_layer_ids`) -> the context
        features `[B, T, H]` injected into every layer."""
        C, B, T, H = captured.shape
        x = captured.transpose(1, 2, 0, 3).reshape(B, T, C * H).astype(self.fc.dtype)
        return rms_norm(linear(x, self.fc[...]), self.context_norm[...],
                        self.config.body.rms_norm_eps)

    def embed_block(self, target: Llama, tokens: jax.Array) -> jax.Array:
        """Block tokens `[B, T]` (target ids, or the mask id past the target's vocabulary)."""
        V = self.config.vocab_size
        own = (tokens >= V)[..., None]
        embeds = target.embed_tokens(jnp.minimum(tokens, V - 1))
        return jnp.where(own, self.body.embed[...][0].astype(embeds.dtype), embeds)

    def layers(self) -> list[dict[str, jax.Array]]:
        """Each decoder layer's parameters (either layout)."""
        if self.body.stacked:
            stacked = {name: p[...] for name, p in self.body.layers.items()}
            return [{n: a[i] for n, a in stacked.items()} for i in range(self.config.num_layers)]
        return [{n: p[...] for n, p in layer.items()} for layer in self.body.layers]

    def run(self, target: Llama, tokens: jax.Array, positions: jax.Array, attend: AttendFn,
            state: Any = None) -> tuple[jax.Array, Any]:
        """The block `tokens` `[B, T]` at `positions` through every layer; `attend(q, k, v,
        layer, state)` attends the block's queries over the injected context (`context_kv`,
        from the KV pool in the engine) and the block's own keys. -> (hidden `[B, T, H]`
        before the final norm, state)."""
        cfg = self.config.body
        x = self.embed_block(target, tokens)
        cos, sin = rope_tables(cfg, positions)
        for index, lp in enumerate(self.layers()):
            x, state = decoder_layer(cfg, lp, x, cos, sin,
                                     lambda q, k, v, s: attend(q, k, v, index, s), state)
        return x, state

    def context_kv(self, context: jax.Array, positions: jax.Array
                   ) -> list[tuple[jax.Array, jax.Array]]:
        """Every layer's injected keys and values `[B, S, kv, hd]` of `context` `[B, S, H]` at
        `positions` `[B, S]`: each layer's own input norm, k/v projections and RoPE."""
        cfg = self.config.body
        cos, sin = rope_tables(cfg, positions)
        return [layer_qkv(cfg, lp, context, cos, sin)[1:] for lp in self.layers()]

    def logits(self, target: Llama, hidden: jax.Array) -> jax.Array:
        """`[..., H]` -> float32 logits over the target's vocabulary `[..., V]`."""
        h = rms_norm(hidden, self.body.final_norm[...], self.config.body.rms_norm_eps)
        return linear(h, target_lm_head(target).astype(h.dtype)).astype(jnp.float32)
