"""Held-out loss and greedy continuations for trained models."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Tokenizer

from specjax.models.dense_greedy import dense_greedy


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token loss in nats: logits `[B, T, V]`, targets `[B, T]` -> scalar."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


@partial(jax.jit, static_argnums=0)
def _window_losses(graphdef: nnx.GraphDef, state: nnx.State, windows: jax.Array) -> jax.Array:
    """windows `[B, T + 1]` -> summed next-token loss per window `[B]`."""
    logits = nnx.merge(graphdef, state)(windows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).sum(axis=1)


def loss_over_windows(model: nnx.Module, windows: np.ndarray, batch_size: int = 8) -> float:
    """Mean loss over every target of `windows` `[N, T + 1]`. The last batch is padded with copies of
    the first window, whose losses are discarded, so only one shape is compiled."""
    graphdef, state = nnx.split(model)
    total = 0.0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        real = len(chunk)
        if real < batch_size:
            chunk = np.concatenate([chunk, np.repeat(windows[:1], batch_size - real, 0)])
        total += float(np.asarray(_window_losses(graphdef, state, jnp.asarray(chunk)))[:real].sum())
    return total / max(len(windows) * (windows.shape[1] - 1), 1)


def perplexity(loss: float) -> float:
    return math.exp(loss)


def greedy_continue(model: nnx.Module, tok: Tokenizer, prompt: str, max_new_tokens: int = 64,
                    bos_id: int | None = None, eos_id: int | None = None) -> str:
    """Greedy continuation with the dense reference forward (EOS ends it and is not shown)."""
    ids = ([bos_id] if bos_id is not None else []) + tok.encode(prompt, add_special_tokens=False).ids
    new = dense_greedy(model, ids, max_new_tokens, () if eos_id is None else (eos_id,))
    if new and new[-1] == eos_id:
        new = new[:-1]
    return tok.decode(new, skip_special_tokens=False)
