"""Greedy continuation with the dense reference forward (no KV cache).

Quadratic in length, so only for short checks (model cards, tests, the CLI until the paged
engine exists); the whole loop runs on device in one `fori_loop` over a fixed-size buffer.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.llama import Llama


@functools.partial(jax.jit, static_argnums=(0, 4))
def _greedy_loop(graphdef, state, buffer, prompt_len, steps):
    model = nnx.merge(graphdef, state)

    def body(i, buf):
        pos = prompt_len + i
        logits = model(buf)[0, pos - 1]
        return buf.at[0, pos].set(jnp.argmax(logits).astype(buf.dtype))

    return jax.lax.fori_loop(0, steps, body, buffer)


def dense_greedy(model: Llama, prompt: Sequence[int], max_new_tokens: int,
                 eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Greedy-decode up to `max_new_tokens` after `prompt`; stops after the first EOS id."""
    if not prompt:
        raise ValueError("prompt must contain at least one token")
    total = len(prompt) + max_new_tokens
    if total > model.config.max_position_embeddings:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"context of {model.config.max_position_embeddings} positions")
    size = 1 << (total - 1).bit_length()  # power-of-two buffers bound the number of compiles
    buffer = jnp.zeros((1, size), jnp.int32).at[0, :len(prompt)].set(jnp.asarray(prompt))
    graphdef, state = nnx.split(model)
    out = _greedy_loop(graphdef, state, buffer, len(prompt), max_new_tokens)
    new = [int(t) for t in out[0, len(prompt):total]]
    for i, token in enumerate(new):
        if token in eos_token_ids:
            return new[:i + 1]
    return new
