"""Attention cores behind one API: exact XLA einsums, or a backend's fused kernel.

Implementations (``impl``):

- ``"xla"``: grouped einsums, f32 scores and softmax. Exact; the reference every other path
  and the Hugging Face comparisons are checked against. XLA partitions it itself.
- ``"cudnn"`` (GPU, bf16/fp16 only): prefill through
  ``jax.nn.dot_product_attention(implementation="cudnn")``; decode through JAX's cuDNN
  wrapper in head-major layout, which reads the ``[B, K, S, H]`` cache where it lies.
- ``"pallas_tpu"`` (prefill, TPU): the Pallas splash-attention kernel.
- ``"pallas_gpu"`` (decode, GPU): the Pallas Triton decode kernel, which reads only each
  row's valid keys. JAX deprecates it (0.12: the Pallas Triton ops and backend are on
  their way out), so "auto" picks cuDNN; it stays selectable by name.
- ``"auto"``: :func:`attention_impls` for the platform the program is compiled for (the
  sharding context's mesh, else ``jax.default_backend()``) and the query dtype.

A named kernel is used for any dtype it takes (the Pallas kernels also run f32, which the
interpret-mode tests use for tight comparisons); ``"cudnn"`` with f32 runs XLA.

TPU decode stays on XLA: the Pallas TPU decode ops do not read this cache layout. Paged
attention wants ``[K, pages, page_size, H]`` (kv heads outermost: our ``[B, K, S, H]``
would need a whole-cache transpose per step) and ragged paged attention wants
``[pages, page_size, 2K, H]`` with K and V interleaved.

Kernel paths run per shard inside :func:`jaxpar.spec.logical_shard_map` (XLA cannot
partition a Pallas or cuDNN call): heads over tp, batch over dp/sp/ep, queries over sp in
prefill with K/V gathered. A path falls back to XLA where its kernel cannot take the input
(f32, too short a cache, splash block sizes, or query positions other than 0..T-1), and
for Gemma: scores soft-capped (no kernel caps them) or a window given as a traced value
(stacked layers of different kinds); for GPT-OSS, attention sinks (no kernel adds a sink
logit to its softmax). A score scale other than ``1/sqrt(H)`` (Gemma's
``query_pre_attn_scalar``) reaches the kernels folded into q.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.errors import ConfigError
from jaxpar.models import _attention_kernels as kern
from jaxpar.models._attention_kernels import MASKED, key_mask
from jaxpar.models._cache import LAYER_KV_AXES
from jaxpar.models._kernel_choice import HALF as _HALF
from jaxpar.models._kernel_choice import attention_impls
from jaxpar.models._kv_quant import QuantKV
from jaxpar.spec import Module, active_platform, logical_shard_map

__all__ = [
    "DECODE_IMPLS",
    "NO_WINDOW",
    "PREFILL_IMPLS",
    "attention_impls",
    "context_prefill_attention",
    "decode_attention",
    "interpret_kernels",
    "key_mask",
    "prefill_attention",
]

PREFILL_IMPLS = ("auto", "xla", "cudnn", "pallas_tpu")
# "pallas_tpu": the paged cache's TPU kernel (``_paged_attention``); the contiguous cache
# has no TPU decode kernel and runs XLA for it.
DECODE_IMPLS = ("auto", "xla", "cudnn", "pallas_gpu", "pallas_tpu")
#: A traced window meaning "none": wider than any sequence. A stacked model whose layers
#: differ (Gemma's sliding and global layers under scan) passes its window as a traced
#: int32, this for the global layers; the fused kernels take only static windows, so a
#: traced one runs the XLA path.
NO_WINDOW = 2**30

Q_AXES = ("batch", "seq", "heads", "head_dim")  # also the model's query constraint
# Keys replicated over the sequence: under sp each shard's queries see every earlier key.
KV_SCORE_AXES = ("batch", None, "kv_heads", "head_dim")
POS_AXES = ("batch", "seq")
DECODE_Q_AXES = ("batch", "heads", "head_dim")
CACHE_AXES = LAYER_KV_AXES


_INTERPRET = contextvars.ContextVar("jaxpar_interpret_kernels", default=False)


@contextlib.contextmanager
def interpret_kernels() -> Iterator[None]:
    """Runs every Pallas kernel traced inside in interpret mode (``interpret=True``).

    For checking the kernel paths of a whole model or engine on a CPU, under the real
    shardings: name the kernels in the model config (``prefill_attention="pallas_tpu"``,
    ``decode_attention="pallas_gpu"``), then build and run the engine inside this context,
    which is where its steps are traced. cuDNN has no interpreter; it is not affected.
    """
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def _interpret(interpret: bool | None) -> bool:
    return _INTERPRET.get() if interpret is None else interpret


def static_window(window) -> bool:
    """Whether ``window`` is None or a Python int (what a fused kernel can mask)."""
    return window is None or isinstance(window, int)


def kernel_scaled_q(q_xNH: jax.Array, scale: float | None) -> jax.Array:
    """``q`` prepared for a fused kernel, which scales scores by ``1/sqrt(H)``: multiplied
    by ``scale * sqrt(H)`` where the model's scale differs (Gemma's query_pre_attn_scalar)."""
    h = q_xNH.shape[-1]
    if scale is None or abs(scale * h**0.5 - 1.0) < 1e-12:
        return q_xNH
    return q_xNH * jnp.asarray(scale * h**0.5, q_xNH.dtype)


def softcap_scores(s_x: jax.Array, softcap: float | None) -> jax.Array:
    """Gemma 2's soft cap ``c * tanh(s / c)`` on f32 scores (identity when None)."""
    if softcap is None:
        return s_x
    return jnp.tanh(s_x / softcap) * softcap


def softmax_with_sinks(s_x: jax.Array, sinks_x: jax.Array | None) -> jax.Array:
    """Softmax over the last axis of f32 scores; with ``sinks_x`` (broadcastable to
    ``s_x[..., :1]``: GPT-OSS's per-head sink logit) each denominator also holds
    ``exp(sink)``, a key whose value is zero, so a row's weights may sum to less than 1.
    Identical to Hugging Face's concatenate-softmax-drop, without the copy of the scores."""
    if sinks_x is None:
        return jax.nn.softmax(s_x, axis=-1)
    sinks_x = sinks_x.astype(s_x.dtype)
    m_x = jnp.maximum(jnp.max(s_x, axis=-1, keepdims=True), sinks_x)
    e_x = jnp.exp(s_x - m_x)
    return e_x / (jnp.sum(e_x, axis=-1, keepdims=True) + jnp.exp(sinks_x - m_x))


def _resolve(impl: str, legal: tuple[str, ...], which: int, dtype, softcap=None, sinks=None) -> str:
    if impl not in legal:
        raise ConfigError(f"unknown attention impl {impl!r}; legal: {', '.join(legal)}")
    if softcap is not None or sinks is not None:
        # No fused kernel soft-caps scores or adds sinks; ModelConfig refuses a kernel named
        # explicitly with attention.softcap or attention.sinks, so only "auto" (or "xla") gets here.
        return "xla"
    if impl == "auto":
        return attention_impls(active_platform(), dtype)[which]
    if impl == "cudnn" and jnp.dtype(dtype) not in _HALF:
        return "xla"  # cuDNN flash attention takes bf16/fp16 only
    return impl


# --- XLA (exact reference) ------------------------------------------------------------------


def prefill_xla(
    q_BTNH, k_BSKH, v_BSKH, q_pos_BT, lengths_B, window, scale=None, softcap=None, sinks_N=None
):
    """Grouped-einsum prefill attention (see :func:`prefill_attention`)."""
    k_pos_S = jnp.arange(k_BSKH.shape[1], dtype=jnp.int32)
    valid_BS = k_pos_S[None, :] < lengths_B[:, None]
    return attend_xla(
        q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_S, valid_BS, window, scale, softcap, sinks_N
    )


def attend_xla(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    q_pos_BT,
    k_pos_S,
    valid_BS,
    window,
    scale=None,
    softcap=None,
    sinks_N=None,
):
    """Grouped-einsum attention of queries at ``q_pos_BT`` over keys at ``k_pos_S``
    (``[S]`` or per row ``[B, S]``), of which ``valid_BS`` may be seen (causal, windowed).
    Scores are scaled by ``scale`` (default ``1/sqrt(H)``) and soft-capped (``softcap``)
    before the mask, as Hugging Face's Gemma 2 does; ``sinks_N`` (GPT-OSS) joins each
    head's softmax denominator (:func:`softmax_with_sinks`)."""
    b, t, n, h = q_BTNH.shape
    k_heads = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(b, t, k_heads, n // k_heads, h)
    k_BSKH, v_BSKH = k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype)
    s_BKGTS = jnp.einsum(
        "BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32
    ) * (h**-0.5 if scale is None else scale)
    s_BKGTS = softcap_scores(s_BKGTS, softcap)
    mask_BTS = key_mask(q_pos_BT, k_pos_S, valid_BS, window)
    s_BKGTS = jnp.where(mask_BTS[:, None, None], s_BKGTS, MASKED)
    sinks_1KG11 = None if sinks_N is None else sinks_N.reshape(1, k_heads, n // k_heads, 1, 1)
    p_BKGTS = softmax_with_sinks(s_BKGTS, sinks_1KG11).astype(q_BTNH.dtype)
    out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", p_BKGTS, v_BSKH)
    return out_BTKGH.reshape(b, t, n, h)


def decode_xla(q_BNH, k_BKSH, v_BKSH, lengths_B, window, scale=None, softcap=None, sinks_N=None):
    """Grouped decode attention on the [B,K,S,H] cache, which is not transposed.

    Both contractions over the cache read it in its own dtype with f32 accumulation. On
    XLA:CPU they are products and sums, not dot_general: decode reads each cached key and
    value once, a bandwidth-bound reduction; as a batched dot over (B, K) XLA:CPU drops
    size-1 batch dims with a reshape that it fuses into the cache write, duplicating the
    write (and the cache buffer) per reader. Elsewhere they are dots: as products, XLA:TPU
    materialises an f32 copy of the cache to multiply (measured on v5e with kv heads
    replicated over tp: 39% of parameter + cache bytes per step; 0% as dots).

    A quantized cache (:class:`~jaxpar.models.QuantKV` k and v) is read the same way,
    its values widened as the contractions' operand; the per-key scales apply outside
    them (:func:`scale_scores`, :func:`scale_probs`), so no dequantized cache is formed.
    """
    b, n, h = q_BNH.shape
    k_BKSH, k_scale_BKS = split_scale(k_BKSH)
    v_BKSH, v_scale_BKS = split_scale(v_BKSH)
    k_heads, s = k_BKSH.shape[1], k_BKSH.shape[2]
    q_BKGH = q_BNH.reshape(b, k_heads, n // k_heads, h)
    k_BKSH, v_BKSH = k_BKSH.astype(q_BNH.dtype), v_BKSH.astype(q_BNH.dtype)
    as_dots = active_platform() != "cpu"
    if as_dots:
        s_BKGS = jnp.einsum("BKGH,BKSH->BKGS", q_BKGH, k_BKSH, preferred_element_type=jnp.float32)
    else:
        qk_BKGSH = q_BKGH[:, :, :, None, :].astype(jnp.float32) * k_BKSH[:, :, None].astype(
            jnp.float32
        )
        s_BKGS = jnp.sum(qk_BKGSH, axis=-1)
    s_BKGS = scale_scores(s_BKGS, k_scale_BKS)
    s_BKGS = softcap_scores(s_BKGS * (h**-0.5 if scale is None else scale), softcap)
    k_pos_S = jnp.arange(s, dtype=jnp.int32)
    valid_BS = k_pos_S[None, :] < lengths_B[:, None]
    mask_BS = key_mask((lengths_B - 1)[:, None], k_pos_S, valid_BS, window)[:, 0]
    s_BKGS = jnp.where(mask_BS[:, None, None], s_BKGS, MASKED)
    sinks_1KG1 = None if sinks_N is None else sinks_N.reshape(1, k_heads, n // k_heads, 1)
    p_BKGS = scale_probs(softmax_with_sinks(s_BKGS, sinks_1KG1), v_scale_BKS).astype(q_BNH.dtype)
    if as_dots:
        out_BKGH = jnp.einsum("BKGS,BKSH->BKGH", p_BKGS, v_BKSH, preferred_element_type=jnp.float32)
    else:
        out_BKGH = jnp.sum(p_BKGS[..., None] * v_BKSH[:, :, None], axis=-2, dtype=jnp.float32)
    return out_BKGH.astype(q_BNH.dtype).reshape(b, n, h)


def split_scale(x: Any) -> tuple[jax.Array, jax.Array | None]:
    """(values, per-key scales without their size-1 last dim) of a quantized cache
    tensor; (the array, None) of a float one."""
    if isinstance(x, QuantKV):
        return x.values, x.scale[..., 0]
    return x, None


def scale_scores(s_XYGS: jax.Array, k_scale_XYS: jax.Array | None) -> jax.Array:
    """Scores over quantized keys times each key's scale: ``q . (k_q * s) = (q . k_q) * s``
    (f32, after the contraction). ``X, Y``: the two leading dims both operands share."""
    if k_scale_XYS is None:
        return s_XYGS
    return s_XYGS * k_scale_XYS[:, :, None, :].astype(jnp.float32)


def scale_probs(p_XYGS: jax.Array, v_scale_XYS: jax.Array | None) -> jax.Array:
    """Softmax weights times each value's scale: ``sum p (v_q * s) = sum (p * s) v_q``
    (before the contraction over keys, as the Pallas GPU paged kernel applies them)."""
    if v_scale_XYS is None:
        return p_XYGS
    return p_XYGS * v_scale_XYS[:, :, None, :].astype(p_XYGS.dtype)


# --- Public API -----------------------------------------------------------------------------


def prefill_attention(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    *,
    q_pos_BT: jax.Array,
    lengths_B: jax.Array,
    window: int | jax.Array | None,
    impl: str = "auto",
    interpret: bool | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks_N: jax.Array | None = None,
) -> jax.Array:
    """Causal self-attention of a right-padded prompt, grouped-query heads.

    Head n reads kv head ``n // (N // K)``; scale ``1/sqrt(H)``; softmax statistics in f32.
    Key j is visible from query i iff ``j <= i``, ``j < lengths_B[b]`` and (with a window)
    ``i - window < j``. Rows of padding queries are finite but unspecified (kernel paths
    give 0); their outputs are unused.

    Args:
        q_BTNH: Queries; their absolute positions are ``q_pos_BT``.
        k_BSKH: Keys at positions 0..S-1; v_BSKH likewise.
        q_pos_BT: Absolute query positions (sharded like q under sequence parallelism).
            Kernel paths require ``T == S`` and ``q_pos_BT[b] == arange(T)``, the prompt's
            layout: they take positions from the layout (and fall back to XLA if T != S).
        lengths_B: Real tokens per row; keys at positions >= length are padding.
        window: Sliding-window size, or None; a traced int32 (a stacked model's layers
            differ) runs XLA.
        impl: One of :data:`PREFILL_IMPLS` (see the module docstring).
        interpret: Run Pallas kernels in interpret mode (tests on CPU); default: whether
            an :func:`interpret_kernels` context is active.
        scale: Score scale; None: ``1/sqrt(H)``.
        softcap: Gemma 2's score soft cap, or None; with one, XLA runs (no kernel caps).
        sinks_N: GPT-OSS's per-head sink logits (f32), or None; with them, XLA runs.

    Returns:
        out_BTNH in q's dtype.

    Raises:
        ConfigError: an unknown ``impl``.
    """
    impl = _resolve(impl, PREFILL_IMPLS, 0, q_BTNH.dtype, softcap, sinks_N)
    if not static_window(window):
        impl = "xla"
    b, t, n, h = q_BTNH.shape
    s = k_BSKH.shape[1]
    group = n // k_BSKH.shape[2]
    if impl == "pallas_tpu" and (t != s or kern.splash_blocks(t, s) is None):
        impl = "xla"  # splash needs S and the local queries in whole blocks (kv: 128)
    if impl == "xla" or t != s:
        return prefill_xla(
            q_BTNH, k_BSKH, v_BSKH, q_pos_BT, lengths_B, window, scale, softcap, sinks_N
        )
    q_BTNH = kernel_scaled_q(q_BTNH, scale)
    if impl == "cudnn":
        body = functools.partial(kern.prefill_cudnn, group=group, window=window)
    else:
        body = functools.partial(
            _splash_checked,
            t_global=t,
            group=group,
            window=window,
            interpret=_interpret(interpret),
        )
    k_BSKH, v_BSKH = k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype)
    sharded = logical_shard_map(
        body,
        in_axes=(Q_AXES, KV_SCORE_AXES, KV_SCORE_AXES, POS_AXES, ("batch",), ("heads",), ("seq",)),
        out_axes=Q_AXES,
        module=Module.ATTENTION,
    )
    head_ids_N = jnp.arange(n, dtype=jnp.int32)
    seq_ids_T = jnp.arange(t, dtype=jnp.int32)
    return sharded(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, lengths_B, head_ids_N, seq_ids_T)


def _splash_checked(q_BTNH, *args, t_global: int, **kwargs):
    # Block sizes were checked on the global T; the local T (under sp) must fit as well.
    if kern.splash_blocks(q_BTNH.shape[1], t_global) is None:
        raise ConfigError(
            f"splash prefill: {q_BTNH.shape[1]} local queries (of {t_global}) fit no q block"
        )
    return kern.prefill_splash(q_BTNH, *args, **kwargs)


def context_prefill_attention(
    q_BTNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    k_ctx_BCKH: jax.Array,
    v_ctx_BCKH: jax.Array,
    *,
    start_B: jax.Array,
    lengths_B: jax.Array,
    window: int | jax.Array | None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks_N: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of new tokens that continue cached ones (prefill with context).

    Row b's ``start_B[b]`` cached keys (``k_ctx_BCKH[b, :start]``, positions ``0..start-1``;
    the rest of ``C`` is padding) come before its new tokens, at positions
    ``start + 0..T-1`` of which ``lengths_B[b]`` are real. Each new query sees the cached
    keys and the new keys up to itself, as if the whole sequence were prefilled at once.

    The exact XLA path, which materialises the ``[T, C + T]`` scores of every head: the
    model takes it where no kernel for a continuation applies (f32, sinks, a traced
    window; :mod:`jaxpar.models._context_attention` chooses: JAX's ragged paged-attention
    kernel on TPU, cuDNN on GPU).

    Returns:
        out_BTNH in q's dtype.
    """
    b, t = q_BTNH.shape[:2]
    c = k_ctx_BCKH.shape[1]
    new_T = jnp.arange(t, dtype=jnp.int32)
    ctx_C = jnp.arange(c, dtype=jnp.int32)
    q_pos_BT = start_B[:, None] + new_T[None, :]
    k_pos_BS = jnp.concatenate([jnp.broadcast_to(ctx_C, (b, c)), q_pos_BT], axis=1)
    valid_BS = jnp.concatenate(
        [ctx_C[None, :] < start_B[:, None], new_T[None, :] < lengths_B[:, None]], axis=1
    )
    k_BSKH = jnp.concatenate([k_ctx_BCKH.astype(k_BTKH.dtype), k_BTKH], axis=1)
    v_BSKH = jnp.concatenate([v_ctx_BCKH.astype(v_BTKH.dtype), v_BTKH], axis=1)
    return attend_xla(
        q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, valid_BS, window, scale, softcap, sinks_N
    )


def decode_attention(
    q_BNH: jax.Array,
    k_BKSH: jax.Array,
    v_BKSH: jax.Array,
    *,
    lengths_B: jax.Array,
    window: int | jax.Array | None,
    impl: str = "auto",
    interpret: bool | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks_N: jax.Array | None = None,
) -> jax.Array:
    """One new query per row over its layer's [B, K, S, H] cache, which already holds it.

    Keys ``0..lengths_B[b]-1`` are valid; the query sits at ``lengths_B[b] - 1``; with a
    window it sees keys ``> lengths_B[b] - 1 - window``. The cache is read where it lies
    (no transpose); the Pallas GPU kernel reads only each row's valid keys.

    Args:
        q_BNH: The new token's queries.
        k_BKSH: This layer's key cache; v_BKSH likewise. Same dtype as q (else a cast copies
            the cache before a kernel can read it).
        lengths_B: Valid keys per row, the new token included.
        window: Sliding-window size, or None; a traced int32 runs XLA.
        impl: One of :data:`DECODE_IMPLS` (see the module docstring).
        interpret: Run the Pallas kernel in interpret mode (tests on CPU); default: whether
            an :func:`interpret_kernels` context is active.
        scale: Score scale; None: ``1/sqrt(H)``.
        softcap: Gemma 2's score soft cap, or None (XLA then).
        sinks_N: GPT-OSS's per-head sink logits (f32), or None (XLA then).

    Returns:
        out_BNH in q's dtype.

    Raises:
        ConfigError: an unknown ``impl``.
    """
    impl = _resolve(impl, DECODE_IMPLS, 1, q_BNH.dtype, softcap, sinks_N)
    if not static_window(window) or isinstance(k_BKSH, QuantKV):
        impl = "xla"  # the contiguous kernels take no window as a value, and no scales
    if impl == "pallas_tpu":
        impl = "xla"  # no Pallas TPU decode kernel reads the contiguous [B, K, S, H] cache
    if impl == "pallas_gpu" and kern.decode_blocks(k_BKSH.shape[2]) is None:
        impl = "xla"  # the kernel needs S in splits of >= 16 keys (see decode_blocks)
    if impl == "xla":
        return decode_xla(q_BNH, k_BKSH, v_BKSH, lengths_B, window, scale, softcap, sinks_N)
    q_BNH = kernel_scaled_q(q_BNH, scale)
    n, s = q_BNH.shape[1], k_BKSH.shape[2]
    k_BKSH, v_BKSH = k_BKSH.astype(q_BNH.dtype), v_BKSH.astype(q_BNH.dtype)
    if impl == "cudnn":
        kernel = kern.decode_cudnn
    else:
        kernel = functools.partial(kern.decode_pallas_gpu, interpret=_interpret(interpret))
    body = functools.partial(
        _decode_checked, kernel=kernel, s_global=s, group=n // k_BKSH.shape[1], window=window
    )
    sharded = logical_shard_map(
        body,
        in_axes=(DECODE_Q_AXES, CACHE_AXES, CACHE_AXES, ("batch",), ("heads",)),
        out_axes=DECODE_Q_AXES,
        module=Module.ATTENTION,
    )
    return sharded(q_BNH, k_BKSH, v_BKSH, lengths_B, jnp.arange(n, dtype=jnp.int32))


def _decode_checked(q_BNH, k_BKSH, *args, kernel, s_global: int, **kwargs):
    # Decode never splits the cache's sequence (sp carries batch in decode); if a strategy
    # did, each shard would see a slice of keys and the softmax would be wrong.
    if k_BKSH.shape[2] != s_global:
        raise ConfigError(
            f"decode attention: cache_seq split ({k_BKSH.shape[2]} of {s_global} per shard)"
        )
    return kernel(q_BNH, k_BKSH, *args, **kwargs)
