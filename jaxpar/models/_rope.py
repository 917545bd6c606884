"""Rotary position embeddings in Hugging Face's rotate-half convention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.models._config import Llama3RopeScaling, RopeScaling, YarnRopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies of the ``head_dim // 2`` rotary planes, float32.

    Computed on the host in float32, step for step as Hugging Face does in torch, so that
    imported checkpoints reproduce its logits closely.

    Args:
        head_dim: Size of each attention head (even).
        theta: RoPE base.
        scaling: Llama 3.x or YaRN frequency scaling, or None for plain RoPE.

    Returns:
        Array [head_dim // 2] of float32.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, YarnRopeScaling):
        return _yarn_scale(inv_freq, head_dim, theta, scaling)
    return _llama3_scale(inv_freq, scaling)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The multiplier of cos and sin: YaRN's attention factor, else 1."""
    return scaling.attention_factor if isinstance(scaling, YarnRopeScaling) else 1.0


def _yarn_scale(
    inv_freq: np.ndarray, head_dim: int, theta: float, s: YarnRopeScaling
) -> np.ndarray:
    """YaRN: each plane's frequency blended between itself (planes that turn more than
    ``beta_fast`` times over the original context) and itself over ``factor`` (fewer than
    ``beta_slow`` turns), by a linear ramp over the plane index between the two."""

    def plane_turning(turns: float) -> float:
        # The plane index whose wavelength fits ``turns`` times into the original context.
        wavelength = s.original_max_position_embeddings / (turns * 2 * math.pi)
        return head_dim * math.log(wavelength) / (2 * math.log(theta))

    low, high = plane_turning(s.beta_fast), plane_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width: a step
    ramp = np.clip(
        (np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low),
        0,
        1,
    ).astype(np.float32)
    extrapolate = np.float32(1) - ramp
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    interpolated = np.float32(1) / (np.float32(s.factor) * np.power(np.float32(theta), exponent))
    return (interpolated * (1 - extrapolate) + inv_freq * extrapolate).astype(np.float32)


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


def apply_rope(
    x_BTXH: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray, scale: float = 1.0
) -> jax.Array:
    """Rotates ``x`` (queries or keys, any head count X) to its token positions.

    Rotate-half convention: dimension i pairs with i + H/2, as in Hugging Face's Llama,
    so Hugging Face checkpoints load without permuting q/k projection rows.

    Args:
        x_BTXH: Queries [B, T, N, H] or keys [B, T, K, H].
        positions_BT: Integer positions of each token.
        inv_freq: Output of :func:`rope_inv_freq`, [H // 2].
        scale: Multiplier of cos and sin (:func:`rope_attention_factor`), in float32
            before the cast to the compute dtype.

    Returns:
        The rotated array, same shape and dtype as ``x_BTXH``.
    """
    # Angles in float32 whatever the compute dtype: positions up to ~1e5 need the mantissa.
    freqs_BTh = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles_BTH = jnp.concatenate([freqs_BTh, freqs_BTh], axis=-1)
    cos_BTH, sin_BTH = jnp.cos(angles_BTH), jnp.sin(angles_BTH)
    if scale != 1.0:
        cos_BTH, sin_BTH = cos_BTH * np.float32(scale), sin_BTH * np.float32(scale)
    cos_BT1H = cos_BTH[:, :, None, :].astype(x_BTXH.dtype)
    sin_BT1H = sin_BTH[:, :, None, :].astype(x_BTXH.dtype)
    x1, x2 = jnp.split(x_BTXH, 2, axis=-1)
    rotated_BTXH = jnp.concatenate([-x2, x1], axis=-1)
    return x_BTXH * cos_BT1H + rotated_BTXH * sin_BT1H
