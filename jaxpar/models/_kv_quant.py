"""A quantized KV cache: int8 or fp8 (e4m3) keys and values, one float32 scale per token
per kv head.

Why per token and per kv head: a token's key (or value) vector of one head is written
once, at prefill insert or at its decode step, and never rewritten, so its scale is
known the moment it is written (symmetric absmax over ``head_dim``: int8 ``absmax/127``,
fp8 ``absmax/448``) and no later write rescales what is already stored. A per-head,
per-tensor scale would need calibration; a per-page scale would change under every
decode write.

Layout: a quantized tensor is a :class:`QuantKV`, a pytree of the values (the float
tensor's shape, in the narrow dtype) and the scales (the same shape with the last dim,
``head_dim``, reduced to 1). Every cache form stores a :class:`QuantKV` where it stored
an array: the contiguous ``[B, K, S, H]`` / ``[L, B, S, K, H]``, the paged ``[K, A, Z, H]``
/ ``[L, K, A, Z, H]`` and prefill's ``[B, T, K, H]``. Because the scales keep every dim
but the last, every write and read of the cache (a scatter of a row's token, a page
gather) applies to them unchanged, and their logical axes are the values' with
``head_dim`` unnamed (:func:`kv_axes`): the spec layer splits them exactly as their values
(kv heads over ``tp``, pages over the batch shards). A cache of another shape (a latent
MLA cache ``[..., R]``) quantizes the same way: one scale per vector.

Writes quantize (:func:`quantize_kv`) where the new keys and values are written; reads
dequantize (:func:`dequantize_kv`) right after the gather, so XLA fuses the widening and
the scale multiply into the gather or into the attention's dot operand and no dequantized
cache is ever stored. A kernel reading the pool itself takes the scales as inputs (the
Pallas GPU paged-attention kernel) or is not used for a quantized cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError

#: ``kv_cache_dtype`` values and their stored dtypes.
KV_CACHE_DTYPES: dict[str, Any] = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
#: The largest magnitude each format stores (symmetric, no zero point).
KV_MAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}
#: The scales' dtype: float32, so the scale adds no rounding of its own (4 bytes per
#: token per kv head, against ``head_dim`` bytes of values).
SCALE_DTYPE = jnp.float32


def check_kv_cache_dtype(mode: str | None) -> None:
    """Raises ConfigError for a KV cache format jaxpar does not implement."""
    if mode is not None and mode not in KV_CACHE_DTYPES:
        legal = ", ".join(["None", *KV_CACHE_DTYPES])
        raise ConfigError(f"kv_cache_dtype={mode!r}; legal: {legal}")


@flax.struct.dataclass
class QuantKV:
    """Quantized keys or values: ``values [..., H]`` (int8 / fp8) and ``scale [..., 1]``
    (float32); the float tensor is ``values * scale``.

    ``shape``, ``dtype`` and ``ndim`` are the values', and indexing indexes both (a
    stacked cache's layer ``x[i]``), so code that only reads shapes or slices leading
    dims treats it as the array it stands for.
    """

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return self.values.ndim

    def __getitem__(self, index: Any) -> QuantKV:
        return QuantKV(self.values[index], self.scale[index])


def is_quantized(x: Any) -> bool:
    """Whether ``x`` (one layer's or a stacked cache tensor) is a :class:`QuantKV`."""
    return isinstance(x, QuantKV)


def kv_dtype(mode: str | None, dtype: Any) -> Any:
    """The dtype K/V values are stored in: ``mode``'s, or the compute ``dtype``."""
    return dtype if mode is None else KV_CACHE_DTYPES[mode]


def quantize_kv(x: jax.Array, mode: str | None) -> jax.Array | QuantKV:
    """``x [..., H]`` quantized per vector (symmetric absmax over the last dim); ``x``
    itself when ``mode`` is None. An all-zero vector gets scale 1 (stored zeros)."""
    if mode is None:
        return x
    x_f = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x_f), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / KV_MAX[mode], 1.0).astype(SCALE_DTYPE)
    v = jnp.clip(x_f / scale, -KV_MAX[mode], KV_MAX[mode])
    if mode == "int8":
        v = jnp.round(v)
    return QuantKV(v.astype(KV_CACHE_DTYPES[mode]), scale)


def dequantize_kv(x: jax.Array | QuantKV, dtype: Any) -> jax.Array:
    """The float tensor in ``dtype``: ``values * scale`` (widened and multiplied in
    float32, one rounding to ``dtype``), or ``x.astype(dtype)`` for a float tensor."""
    if not isinstance(x, QuantKV):
        return x.astype(dtype)
    return (x.values.astype(jnp.float32) * x.scale.astype(jnp.float32)).astype(dtype)


def as_stored(new: jax.Array, like: jax.Array | QuantKV) -> jax.Array | QuantKV:
    """New keys or values made like the cache tensor ``like`` stores them: quantized
    (with ``like``'s format) for a :class:`QuantKV`, else cast to its dtype; ``new``
    itself when it is quantized already."""
    if isinstance(new, QuantKV):
        return new  # quantized already (a disaggregated transfer carries the scales)
    if not isinstance(like, QuantKV):
        return new.astype(like.dtype)
    mode = "int8" if like.dtype == jnp.dtype(jnp.int8) else "fp8"
    return quantize_kv(new, mode)


def quantize_tree(tree: Any, mode: str | None) -> Any:
    """Every array of a K or V tree (per-layer tuple, or stacked) quantized."""
    return jax.tree.map(lambda x: quantize_kv(x, mode), tree)


def kv_map(fn: Callable[..., jax.Array], x: Any, *rest: Any) -> Any:
    """``fn`` on a cache tensor's arrays: once for a float array, on values and on scales
    (with the matching parts of ``rest``) for a :class:`QuantKV`. For shape-generic moves
    (scatters, gathers, pads, transposes over any dim but the last)."""
    if not isinstance(x, QuantKV):
        return fn(x, *rest)
    values = fn(x.values, *(r.values if isinstance(r, QuantKV) else r for r in rest))
    scale = fn(x.scale, *(r.scale if isinstance(r, QuantKV) else r for r in rest))
    return QuantKV(values, scale)


def empty_kv(shape: tuple[int, ...], dtype: Any, mode: str | None) -> jax.Array | QuantKV:
    """A zero cache tensor of ``shape`` (values) in ``dtype``, or quantized (scales 1)."""
    if mode is None:
        return jnp.zeros(shape, dtype)
    return QuantKV(jnp.zeros(shape, KV_CACHE_DTYPES[mode]), jnp.ones((*shape[:-1], 1), SCALE_DTYPE))


def kv_axes(axes: tuple[str | None, ...], mode: str | None) -> Any:
    """Logical axes of a cache tensor with axes ``axes``: a :class:`QuantKV` of the
    values' and the scales' (the last dim unnamed: it has size 1) when quantized."""
    if mode is None:
        return axes
    return QuantKV(tuple(axes), (*axes[:-1], None))


def kv_bytes_per_vector(head_dim: int, dtype: Any, mode: str | None) -> int:
    """Bytes one token's key (or value) of one kv head takes: ``head_dim`` values in
    the stored dtype, plus its float32 scale when quantized."""
    if mode is None:
        return head_dim * np.dtype(dtype).itemsize
    return head_dim * np.dtype(KV_CACHE_DTYPES[mode]).itemsize + np.dtype(SCALE_DTYPE).itemsize
