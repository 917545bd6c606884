"""Rotary position embeddings in Hugging Face's rotate-half convention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.models._config import Llama3RopeScaling


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None
) -> np.ndarray:
    """Inverse frequencies of the ``head_dim // 2`` rotary planes, float32.

    Computed on the host in float32, step for step as Hugging Face does in torch, so that
    imported checkpoints reproduce its logits closely.

    Args:
        head_dim: Size of each attention head (even).
        theta: RoPE base.
        scaling: Llama 3.x frequency scaling, or None for plain RoPE.

    Returns:
        Array [head_dim // 2] of float32.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: np.ndarray, s: Llama3RopeScaling) -> np.ndarray:
    """Llama 3 scaling: long wavelengths divided by ``factor``, short ones kept, a smooth
    interpolation in between."""
    old_len = float(s.original_max_position_embeddings)
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(s.factor), inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_BTXH: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates ``x`` (queries or keys, any head count X) to its token positions.

    Rotate-half convention: dimension i pairs with i + H/2, as in Hugging Face's Llama,
    so Hugging Face checkpoints load without permuting q/k projection rows.

    Args:
        x_BTXH: Queries [B, T, N, H] or keys [B, T, K, H].
        positions_BT: Integer positions of each token.
        inv_freq: Output of :func:`rope_inv_freq`, [H // 2].

    Returns:
        The rotated array, same shape and dtype as ``x_BTXH``.
    """
    # Angles in float32 whatever the compute dtype: positions up to ~1e5 need the mantissa.
    freqs_BTh = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles_BTH = jnp.concatenate([freqs_BTh, freqs_BTh], axis=-1)
    cos_BT1H = jnp.cos(angles_BTH)[:, :, None, :].astype(x_BTXH.dtype)
    sin_BT1H = jnp.sin(angles_BTH)[:, :, None, :].astype(x_BTXH.dtype)
    x1, x2 = jnp.split(x_BTXH, 2, axis=-1)
    rotated_BTXH = jnp.concatenate([-x2, x1], axis=-1)
    return x_BTXH * cos_BT1H + rotated_BTXH * sin_BT1H
