"""Prefill over cached context: new tokens of several positions per row attending to the
row's cached keys and to themselves (every chunk of a chunked prefill, every prefix hit).

Implementations, chosen by the run's ``prefill_attention`` option (``"auto"``:
:func:`~jaxpar.models._kernel_choice.attention_impls` for the platform and dtype):

- ``"xla"`` (every backend, the reference): :func:`~jaxpar.models._attention_ops.
  context_prefill_attention`, grouped einsums with an f32 score block ``[T, C + T]`` per
  head. At 32k cached tokens and 512-token chunks of Llama-3-8B that is 2 GiB per layer.
- ``"pallas_tpu"`` (TPU): JAX's ragged paged-attention kernel
  (``pallas.ops.tpu.ragged_paged_attention``), flash-style: K/V blocks stream through VMEM,
  no score block. It reads a ``[pages, page_size, 2K, H]`` pool with K and V interleaved;
  the cache's pool is ``[K, A, Z, H]`` per K and V, so the kernel reads a buffer of the
  rows' context and new tokens laid out as its pool (:func:`~jaxpar.models.
  _attention_kernels.continued_kv`): one activation-sized copy per layer, ``(C + T) * 2K *
  H`` elements. Takes soft caps and static windows; sinks run XLA.
- ``"cudnn"`` (GPU, bf16/fp16): cuDNN's fused attention over the same buffer, masked by the
  queries' absolute positions (a ``[B, 1, T, C + T]`` bias, one head's scores in size).
  Soft caps and sinks run XLA.

Kernels fall back to XLA where they cannot take the input: a traced window (stacked
layers of different kinds), sinks, a head_dim or dtype the TPU kernel does not lower, or
block tables over SMEM (:func:`~jaxpar.models._attention_kernels.ragged_tpu_fits`). Every
path runs per shard inside :func:`jaxpar.spec.logical_shard_map`, split as prefill is:
batch over dp, heads over tp (a replicated kv head sliced out per shard), queries over sp
with the context and new keys whole on every shard.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.errors import ConfigError
from jaxpar.models import _attention_kernels as kern
from jaxpar.models._attention_ops import (
    KV_SCORE_AXES,
    PREFILL_IMPLS,
    Q_AXES,
    _interpret,
    context_prefill_attention,
    kernel_scaled_q,
    static_window,
)
from jaxpar.models._kernel_choice import HALF, attention_impls
from jaxpar.spec import Module, active_mesh, active_platform, logical_shard_map

__all__ = ["context_attention_impl", "prefill_over_context"]


def context_attention_impl(impl: str, dtype, *, softcap=None, sinks=None) -> str:
    """The implementation a prefill over context runs for the ``prefill_attention`` choice
    ``impl`` (before the shape checks of :func:`prefill_over_context`).

    Raises:
        ConfigError: an unknown ``impl``.
    """
    if impl not in PREFILL_IMPLS:
        raise ConfigError(
            f"unknown prefill attention impl {impl!r} for prefill over context; "
            f"legal: {', '.join(PREFILL_IMPLS)}"
        )
    if impl == "auto":
        impl = attention_impls(active_platform(), dtype)[0]
    if sinks is not None:
        return "xla"  # no kernel adds a sink logit to its softmax
    if impl == "cudnn" and (softcap is not None or jnp.dtype(dtype) not in HALF):
        return "xla"  # cuDNN flash attention: bf16/fp16 only, no soft cap
    return impl


def prefill_over_context(
    q_BTNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    k_ctx_BCKH: jax.Array,
    v_ctx_BCKH: jax.Array,
    *,
    start_B: jax.Array,
    lengths_B: jax.Array,
    window: int | jax.Array | None,
    impl: str = "auto",
    interpret: bool | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks_N: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of new tokens that continue cached ones, by ``impl``.

    Same contract as :func:`~jaxpar.models._attention_ops.context_prefill_attention`: row
    b's ``start_B[b]`` cached keys (``k_ctx_BCKH[b, :start]``) come before its new tokens at
    positions ``start + 0..T-1``, of which ``lengths_B[b]`` are real; rows of padding
    queries come out as zeros on kernel paths.

    Args:
        impl: The run's ``prefill_attention`` choice (see the module docstring).
        interpret: Run the Pallas kernel in interpret mode (tests on CPU); default: whether
            an :func:`~jaxpar.models.interpret_kernels` context is active.

    Returns:
        out_BTNH in q's dtype.

    Raises:
        ConfigError: an unknown ``impl``.
    """
    impl = context_attention_impl(impl, q_BTNH.dtype, softcap=softcap, sinks=sinks_N)
    b, t, n, h = q_BTNH.shape
    keys = k_ctx_BCKH.shape[1] + t
    if not static_window(window):
        impl = "xla"
    if impl == "pallas_tpu" and not kern.ragged_tpu_fits(b, keys, h, q_BTNH.dtype):
        impl = "xla"
    if impl == "xla":
        return context_prefill_attention(
            q_BTNH,
            k_BTKH,
            v_BTKH,
            k_ctx_BCKH,
            v_ctx_BCKH,
            start_B=start_B,
            lengths_B=lengths_B,
            window=window,
            scale=scale,
            softcap=softcap,
            sinks_N=sinks_N,
        )
    group = n // k_BTKH.shape[2]
    if impl == "cudnn":
        q_BTNH = kernel_scaled_q(q_BTNH, scale)
        body = functools.partial(kern.context_prefill_cudnn, group=group, window=window)
    else:
        body = functools.partial(
            kern.context_prefill_ragged_tpu,
            group=group,
            window=window,
            scale=h**-0.5 if scale is None else scale,
            softcap=softcap,
            interpret=_interpret(interpret),
            target=_one_device_target(),
        )
    dtype = q_BTNH.dtype
    kv = [x.astype(dtype) for x in (k_BTKH, v_BTKH, k_ctx_BCKH, v_ctx_BCKH)]
    sharded = logical_shard_map(
        body,
        in_axes=(Q_AXES, *(KV_SCORE_AXES,) * 4, ("batch",), ("batch",), ("heads",), ("seq",)),
        out_axes=Q_AXES,
        module=Module.ATTENTION,
    )
    head_ids_N = jnp.arange(n, dtype=jnp.int32)
    seq_ids_T = jnp.arange(t, dtype=jnp.int32)
    return sharded(q_BTNH, *kv, start_B, lengths_B, head_ids_N, seq_ids_T)


def _one_device_target():
    """The abstract mesh of a one-device sharding context over a concrete device (where
    :func:`~jaxpar.spec.logical_shard_map` calls the kernel outside any shard_map, so
    Mosaic could not otherwise tell which chip it compiles for), else None."""
    mesh = active_mesh()
    if isinstance(mesh, jax.sharding.Mesh) and mesh.size == 1:
        return mesh.abstract_mesh
    return None
