"""Decode attention over the paged KV cache (:mod:`jaxpar.models._paged`).

Implementations, chosen by the run's ``paged_attention`` option
(:class:`~jaxpar.models.ExecutionOptions`; ``"auto"`` follows a named ``decode_attention``,
else :func:`paged_attention_impl` for the platform):

- ``"xla"`` (every backend, the reference): each row's pages are gathered from the pool,
  ``[K, B, N * Z, H]``, and attended to with f32 scores and softmax. The gather reads only
  the ``N`` pages of the block tables the step was given, so a step's cost follows its
  live rows; nothing copies the pool.
- ``"pallas_gpu"`` (GPU): JAX's Pallas Triton paged-attention kernel
  (``pallas.ops.gpu.paged_attention``), which reads the ``[K, A, Z, H]`` pool and the
  block tables as they lie and streams only each row's pages below its length. ``"auto"``
  picks it on GPU for bf16/fp16. JAX 0.12 deprecates the Pallas Triton ops, this one
  included; it is still the only fused paged decode JAX offers on GPU.
- ``"cudnn"``: runs XLA here. cuDNN's attention can read paged K/V, but JAX's cuDNN
  wrapper takes no page tables.
- ``"pallas_tpu"`` (TPU): JAX's Pallas TPU paged-attention kernel
  (``pallas.ops.tpu.paged_attention``), same layout, pages DMA'd block by block into VMEM.
  ``"auto"`` picks it on TPU for bf16 (``decode_attention="pallas_tpu"`` names it for the
  paged cache; the contiguous cache has no TPU decode kernel and runs XLA).
- ``"auto"``: :func:`paged_attention_impl` for the platform the program is compiled for
  and the query dtype; f32 stays on XLA, the exact path, as for the contiguous cache.

A kernel named explicitly also runs f32 (the interpret-mode tests compare it tightly). A
kernel falls back to XLA where it cannot take the input: a sliding window (neither kernel
masks one), a pool dtype other than q's (casting the pool would copy it every step), and
shapes it cannot tile (``paged_gpu_blocks``, ``paged_tpu_block`` in
:mod:`jaxpar.models._attention_kernels`).

Every implementation runs per shard inside :func:`jaxpar.spec.logical_shard_map`: block
tables hold page ids local to their batch shard (see ``_paged``), which only the shard's
own slice of the pool resolves.

Prefill over cached context (several new tokens per row: chunks, prefix hits) is
:mod:`jaxpar.models._context_attention`; on TPU it runs JAX's ragged paged-attention kernel
(``pallas.ops.tpu.ragged_paged_attention``), which wants one combined pool
``[pages, page_size, 2K, H]`` with K and V interleaved, another layout than this cache's: it
reads the rows' context laid out that way per call, not these pages in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.errors import ConfigError
from jaxpar.models import _attention_kernels as kern
from jaxpar.models._attention_kernels import MASKED, key_mask, kv_replicated
from jaxpar.models._attention_ops import (
    DECODE_IMPLS,
    _interpret,
    kernel_scaled_q,
    scale_probs,
    scale_scores,
    softcap_scores,
    softmax_with_sinks,
    split_scale,
)
from jaxpar.models._kernel_choice import paged_attention_impl
from jaxpar.models._kv_quant import QuantKV, kv_map
from jaxpar.models._paged import PAGE_AXES, TABLE_AXES, PagedLayer
from jaxpar.spec import Module, active_platform, logical_shard_map

DECODE_Q_AXES = ("batch", "heads", "head_dim")
#: What :func:`paged_decode_attention` takes: ``ExecutionOptions.paged_attention``'s choices.
PAGED_DECODE_IMPLS = DECODE_IMPLS


def _resolve(impl: str, dtype) -> str:
    if impl not in PAGED_DECODE_IMPLS:
        legal = ", ".join(PAGED_DECODE_IMPLS)
        raise ConfigError(f"unknown paged attention impl {impl!r}; legal: {legal}")
    if impl == "auto":
        return paged_attention_impl(active_platform(), dtype)
    if impl == "cudnn":
        return "xla"  # JAX's cuDNN wrapper takes no page tables
    return impl


def paged_xla(
    q_BNH,
    k_KAZH,
    v_KAZH,
    tables_BN,
    lengths_B,
    head_ids_N,
    sinks_N=None,
    *,
    group,
    window,
    scale=None,
    softcap=None,
):
    """One shard of grouped decode attention over the rows' pages (see the module doc).

    ``lengths_B``: valid keys per row, the new token included (its query sits at
    ``lengths_B - 1``). ``head_ids_N``: this shard's global query-head ids (to find the kv
    head when kv heads are replicated over tp). ``sinks_N``: this shard's query heads'
    sink logits (GPT-OSS), or None.
    """
    b, n, h = q_BNH.shape
    k_local = k_KAZH.shape[0]
    s = tables_BN.shape[1] * k_KAZH.shape[2]
    if kv_replicated(n, k_local, group):
        # Every local query head reads the one kv head of its group: gather only its pages.
        kv = head_ids_N[0] // group

        def gather(pool_KAZX):  # values, or a quantized pool's scales (X = 1)
            return pool_KAZX[kv, tables_BN].reshape(1, b, s, pool_KAZX.shape[-1])

        q_KBGH = q_BNH[None]
    else:

        def gather(pool_KAZX):
            return pool_KAZX[:, tables_BN].reshape(k_local, b, s, pool_KAZX.shape[-1])

        q_KBGH = q_BNH.reshape(b, k_local, group, h).transpose(1, 0, 2, 3)
    # A quantized pool: its scales gathered as its values, applied outside the
    # contractions (see ``decode_xla``); the values are widened as the dots' operand.
    k_KBSH, k_scale_KBS = split_scale(kv_map(gather, k_KAZH))
    v_KBSH, v_scale_KBS = split_scale(kv_map(gather, v_KAZH))
    k_KBSH, v_KBSH = k_KBSH.astype(q_BNH.dtype), v_KBSH.astype(q_BNH.dtype)
    # (K, B) lead both operands, in that order: batched dots with no transpose of the
    # gathered keys and values.
    s_KBGS = jnp.einsum("KBGH,KBSH->KBGS", q_KBGH, k_KBSH, preferred_element_type=jnp.float32)
    s_KBGS = scale_scores(s_KBGS, k_scale_KBS)
    s_KBGS = softcap_scores(s_KBGS * (h**-0.5 if scale is None else scale), softcap)
    k_pos_S = jnp.arange(s, dtype=jnp.int32)
    valid_BS = k_pos_S[None, :] < lengths_B[:, None]
    mask_BS = key_mask((lengths_B - 1)[:, None], k_pos_S, valid_BS, window)[:, 0]
    s_KBGS = jnp.where(mask_BS[None, :, None], s_KBGS, MASKED)
    # Query heads lie [K, G] in q_KBGH (a replicated kv head: [1, n]), so do their sinks.
    k_q, g_q = q_KBGH.shape[0], q_KBGH.shape[2]
    sinks_K1G1 = None if sinks_N is None else sinks_N.reshape(k_q, 1, g_q, 1)
    p_KBGS = scale_probs(softmax_with_sinks(s_KBGS, sinks_K1G1), v_scale_KBS).astype(q_BNH.dtype)
    out_KBGH = jnp.einsum("KBGS,KBSH->KBGH", p_KBGS, v_KBSH, preferred_element_type=jnp.float32)
    return out_KBGH.transpose(1, 0, 2, 3).reshape(b, n, h).astype(q_BNH.dtype)


def _kernel_body(impl: str, q_BNH: jax.Array, kv: PagedLayer, group: int, interpret: bool):
    """The per-shard kernel body for ``impl``, or None where its kernel cannot take the
    input (XLA then). Shapes are checked on the global arrays: a shard splits only batch,
    heads and pages, which no constraint reads."""
    quantized = isinstance(kv.k_KAZH, QuantKV)
    if quantized and impl != "pallas_gpu":
        return None  # the Pallas TPU kernel here takes no per-token scales: XLA reads them
    if not quantized and kv.k_KAZH.dtype != q_BNH.dtype:
        return None  # the kernels read the pool as is; a cast would copy it every step
    n_pages, page_size, h = kv.block_tables_BN.shape[1], kv.k_KAZH.shape[2], q_BNH.shape[2]
    if impl == "pallas_gpu":
        blocks = kern.paged_gpu_blocks(n_pages, page_size, h)
        if blocks is None:
            return None
        return functools.partial(
            kern.paged_decode_pallas_gpu, group=group, blocks=blocks, interpret=interpret
        )
    per_block = kern.paged_tpu_block(n_pages, page_size, h, q_BNH.dtype)
    if per_block is None:
        return None
    return functools.partial(
        kern.paged_decode_pallas_tpu, group=group, pages_per_block=per_block, interpret=interpret
    )


def paged_decode_attention(
    q_BNH: jax.Array,
    kv: PagedLayer,
    *,
    lengths_B: jax.Array,
    window: int | jax.Array | None,
    impl: str = "auto",
    interpret: bool | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks_N: jax.Array | None = None,
) -> jax.Array:
    """One new query per row over its pages, which already hold its key and value.

    Args:
        q_BNH: The new token's queries.
        kv: The layer's pool ``[K, A, Z, H]`` and the rows' block tables ``[B, N]``.
        lengths_B: Valid keys per row, the new token included.
        window: Sliding-window size (static or traced), or None.
        impl: The run's ``paged_attention`` choice (see the module docstring).
        interpret: Run a Pallas kernel in interpret mode (tests on CPU); default: whether
            an :func:`~jaxpar.models.interpret_kernels` context is active.
        scale: Score scale; None: ``1/sqrt(H)``.
        softcap: Gemma 2's score soft cap, or None; neither kernel caps, so XLA runs.
        sinks_N: GPT-OSS's per-head sink logits (f32), or None; no kernel takes them, so
            XLA runs.

    Returns:
        out_BNH in q's dtype.

    Raises:
        ConfigError: an unknown ``impl``.
    """
    impl = _resolve(impl, q_BNH.dtype)
    n = q_BNH.shape[1]
    group = n // kv.k_KAZH.shape[0]
    body = None
    # Neither kernel masks a sliding window, soft-caps scores or adds sinks.
    if impl != "xla" and window is None and softcap is None and sinks_N is None:
        body = _kernel_body(impl, q_BNH, kv, group, _interpret(interpret))
    if body is None:
        body = functools.partial(
            paged_xla, group=group, window=window, scale=scale, softcap=softcap
        )
    else:
        q_BNH = kernel_scaled_q(q_BNH, scale)
    in_axes = (DECODE_Q_AXES, PAGE_AXES, PAGE_AXES, TABLE_AXES, ("batch",), ("heads",))
    args = (q_BNH, kv.k_KAZH, kv.v_KAZH, kv.block_tables_BN, lengths_B)
    heads_N = jnp.arange(n, dtype=jnp.int32)
    if sinks_N is not None:  # the sinks split with their query heads
        in_axes, args = (*in_axes, ("heads",)), (*args, heads_N, sinks_N)
    else:
        args = (*args, heads_N)
    sharded = logical_shard_map(
        body, in_axes=in_axes, out_axes=DECODE_Q_AXES, module=Module.ATTENTION
    )
    return sharded(*args)
