"""Rotary position embeddings (rotate-half layout, as in Hugging Face Llama/Qwen/Mistral)."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """`[rotary_dim // 2]` float32, with linear or llama3 frequency scaling applied."""
    dim = getattr(config, "rotary_dim", config.head_dim)  # drafter head configs rotate all
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    # llama3: leave high frequencies alone, divide low frequencies by `factor`, interpolate between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(config: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions `[..., T]` int -> (cos, sin) each `[..., T, rotary_dim // 2]` float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies(config))
    return jnp.cos(angles), jnp.sin(angles)


def local_rope_config(config: ModelConfig) -> ModelConfig | None:
    """The rotary of a model's sliding-window layers where it differs from its global
    layers' (`rope_local_theta`, Gemma 3), else None."""
    local = getattr(config, "rope_local_theta", None)
    if local is None or not any(getattr(config, "sliding_windows", None) or ()):
        return None
    return config.replace(rope_theta=local, rope_scaling=None, rope_local_theta=None)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x `[B, T, heads, head_dim]`; cos/sin `[B, T, rotary_dim // 2]`: the first rotary_dim
    features rotate, the rest pass through (partial rotary, Bamba)."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    rotary = 2 * cos.shape[-1]
    x1, x2 = jnp.split(x[..., :rotary], 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary:]], axis=-1)
