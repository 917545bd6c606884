"""Rotary position embeddings in Hugging Face's rotate-half convention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.models._config import (
    DynamicRopeScaling,
    LinearRopeScaling,
    Llama3RopeScaling,
    RopeScaling,
    YarnRopeScaling,
)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies of the ``head_dim // 2`` rotary planes, float32.

    Computed on the host in float32, step for step as Hugging Face does in torch, so that
    imported checkpoints reproduce its logits closely.

    Args:
        head_dim: Size of each attention head (even).
        theta: RoPE base.
        scaling: Llama 3.x, YaRN or linear frequency scaling, or None for plain RoPE.
            Dynamic NTK gives plain RoPE's frequencies here, those of a sequence within
            the original context; :func:`dynamic_inv_freq` gives a longer one's.

    Returns:
        Array [head_dim // 2] of float32.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)
    if scaling is None or isinstance(scaling, DynamicRopeScaling):
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if isinstance(scaling, YarnRopeScaling):
        return _yarn_scale(inv_freq, head_dim, theta, scaling)
    return _llama3_scale(inv_freq, scaling)


def dynamic_inv_freq(
    head_dim: int, theta: float, s: DynamicRopeScaling, seq_len_B: jax.Array
) -> jax.Array:
    """Dynamic NTK inverse frequencies ``[B, head_dim // 2]`` (f32) of rows whose sequences
    are ``seq_len_B`` positions long (see :class:`DynamicRopeScaling`): plain RoPE's up to
    the original context, the base grown as transformers' ``_compute_dynamic_ntk_parameters``
    grows it past it."""
    original = s.original_max_position_embeddings
    seq_B = jnp.maximum(seq_len_B.astype(jnp.float32), np.float32(original))
    growth_B = np.float32(s.factor) * seq_B / np.float32(original) - np.float32(s.factor - 1)
    base_B = np.float32(theta) * growth_B ** np.float32(head_dim / (head_dim - 2))
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return 1.0 / jnp.power(base_B[:, None], jnp.asarray(exponent)[None, :])


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
        inv_freq: Output of :func:`rope_inv_freq`, [H // 2], or per row [B, H // 2]
            (:func:`dynamic_inv_freq`).
        scale: Multiplier of cos and sin (:func:`rope_attention_factor`), in float32
            before the cast to the compute dtype.

    Returns:
        The rotated array, same shape and dtype as ``x_BTXH``.
    """
    # Angles in float32 whatever the compute dtype: positions up to ~1e5 need the mantissa.
    inv_freq = jnp.asarray(inv_freq)
    inv_x1h = inv_freq[:, None, :] if inv_freq.ndim == 2 else inv_freq
    freqs_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_x1h
    angles_BTH = jnp.concatenate([freqs_BTh, freqs_BTh], axis=-1)
    cos_BTH, sin_BTH = jnp.cos(angles_BTH), jnp.sin(angles_BTH)
    if scale != 1.0:
        cos_BTH, sin_BTH = cos_BTH * np.float32(scale), sin_BTH * np.float32(scale)
    cos_BT1H = cos_BTH[:, :, None, :].astype(x_BTXH.dtype)
    sin_BT1H = sin_BTH[:, :, None, :].astype(x_BTXH.dtype)
    x1, x2 = jnp.split(x_BTXH, 2, axis=-1)
    rotated_BTXH = jnp.concatenate([-x2, x1], axis=-1)
    return x_BTXH * cos_BT1H + rotated_BTXH * sin_BT1H
