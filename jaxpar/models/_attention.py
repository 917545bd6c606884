"""Multi-head attention with grouped-query heads, RoPE, causal/padding/sliding-window masks."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.models._attention_ops import (
    KV_SCORE_AXES,
    NO_WINDOW,
    Q_AXES,
    decode_attention,
    prefill_attention,
)
from jaxpar.models._cache import LAYER_KV_AXES, PREFILL_KV_AXES, constrain_kv
from jaxpar.models._config import DynamicRopeScaling, ModelConfig
from jaxpar.models._context_attention import prefill_over_context
from jaxpar.models._kv_quant import QuantKV
from jaxpar.models._layers import (
    BTD,
    Init,
    RMSNorm,
    bias_init,
    fan_in_normal,
    kernel,
    param,
    project,
)
from jaxpar.models._paged import PagedLayer
from jaxpar.models._paged_attention import paged_decode_attention
from jaxpar.models._ring_attention import RING_KV_AXES, from_zigzag, ring_prefill_attention
from jaxpar.models._rope import (
    apply_rope,
    dynamic_inv_freq,
    rope_attention_factor,
    rope_inv_freq,
)
from jaxpar.models._run import ModelRun
from jaxpar.spec import Module, constrain


@flax.struct.dataclass
class Context:
    """One layer's cached keys and values ``[B, C, K, H]`` that new tokens continue;
    row b holds ``start_B[b]`` of them (positions ``0..start-1``)."""

    k_BCKH: jax.Array
    v_BCKH: jax.Array
    start_B: jax.Array


class Attention(nnx.Module):
    """Self-attention; Q kernel [D,N,H], fused K/V kernel [D,2,K,H], output kernel [N,H,D].

    ``N x H`` need not equal D (Qwen3, Gemma). With ``config.norms.qk`` the projected q and
    k are RMS-normalised per head (scales ``q_norm``/``k_norm`` ``[H]``) before RoPE.
    With ``config.attention.sinks`` (GPT-OSS) each query head has a learned sink logit
    (``sinks [N]``, split with the heads) in its softmax denominator, on every path.

    Layers may differ (Gemma: sliding layers interleaved with global ones, each kind with
    its RoPE base): every layer holds the same static per-layer table and is told its
    index, so stacked layers under ``scan`` (one program for all) still select their own
    window and frequencies, as traced values.

    The attention core is :mod:`jaxpar.models._attention_ops`: exact grouped einsums
    (K/V never repeated; head n uses kv head n // G, as Hugging Face's ``repeat_kv``) or the
    backend's fused kernel, as the run's ``prefill_attention`` / ``decode_attention`` /
    ``paged_attention`` options choose (:class:`~jaxpar.models.ExecutionOptions`).
    """

    def __init__(self, config: ModelConfig | ModelRun, *, rngs: nnx.Rngs):
        c = ModelRun.of(config)
        d, n, k, h, pd = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.param_dtype
        self.dtype = c.dtype
        self.matmul = c.matmul
        self.n_kv_heads, self.q_per_kv, self.head_dim = k, c.q_per_kv, h
        self.window = c.window.size
        # Which layers slide (static, hashable): the layer index passed to prefill/decode
        # picks the window and the RoPE base of its layer (see :meth:`_slides`).
        self.sliding_layers = tuple(c.layer_slides(i) for i in range(c.n_layers))
        self.scale = c.attention.scale if c.attention.scale is not None else h**-0.5
        self.softcap = c.attention.softcap
        self.prefill_impl, self.decode_impl = c.prefill_attention, c.decode_attention
        # Paged "auto" follows a named decode_attention (as ExecutionOptions.resolve does);
        # unresolved (a model built outside an engine) it is chosen at trace time.
        paged = c.paged_attention
        self.paged_impl = c.decode_attention if paged == "auto" else paged
        self.rope_theta = c.rope.theta if c.positional == "rope" else None
        self.rope_local_theta = c.rope.local_theta
        self.rope_scaling = c.rope.scaling
        self.rope_linear_factor = c.rope.linear_factor
        # Quantized (config.quantize): each kernel has a <name>_scale, else None.
        self.q_kernel, self.q_kernel_scale = kernel(
            rngs, fan_in_normal(d), (d, n, h), ("embed", "heads", "head_dim"), c
        )
        # K and V in one weight [D, 2, K, H]: one matmul reads both. Q stays its own weight
        # because it splits over tp by query heads while K/V may be replicated
        # (n_kv_heads < tp), which one fused [D, N + 2K, H] weight could not express.
        kv_axes = ("embed", None, "kv_heads", "head_dim")
        self.kv_kernel, self.kv_kernel_scale = kernel(
            rngs, fan_in_normal(d), (d, 2, k, h), kv_axes, c
        )
        self.o_kernel, self.o_kernel_scale = kernel(
            rngs, fan_in_normal(n, h), (n, h, d), ("heads", "head_dim", "embed"), c, contract=2
        )
        # Optional biases are None (static) when absent: assign each attribute once.
        qkv = c.attention.qkv_bias
        self.q_bias = bias_init(rngs, (n, h), ("heads", "head_dim"), pd) if qkv else None
        self.kv_bias = bias_init(rngs, (2, k, h), kv_axes[1:], pd) if qkv else None
        self.o_bias = bias_init(rngs, (d,), ("embed",), pd) if c.attention.out_bias else None
        # Qwen3: each query and key head RMS-normalised over head_dim before RoPE, with one
        # [H] scale shared by the heads (axis head_dim, never split: no collective under tp).
        self.q_norm = RMSNorm(c, rngs=rngs, axis="head_dim") if c.norms.qk else None
        self.k_norm = RMSNorm(c, rngs=rngs, axis="head_dim") if c.norms.qk else None
        # GPT-OSS: one sink logit per query head, split over tp with its head. Random init
        # of unit scale (real values come from checkpoints) so that tests see it bind.
        self.sinks = (
            param(rngs, Init("normal", 1.0), (n,), ("heads",), pd) if c.attention.sinks else None
        )

    def _sinks(self) -> jax.Array | None:
        """The per-head sink logits in float32 (the softmax's dtype), or None."""
        return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

    def _project(
        self, x_BTD: jax.Array, kernel: nnx.Param, scale: nnx.Param | None, bias: nnx.Param | None
    ) -> jax.Array:
        s = None if scale is None else scale[...]
        y = project(x_BTD, kernel[...], s, self.dtype, self.matmul)
        return y if bias is None else y + bias[...].astype(self.dtype)

    def _slides(self, layer: int | jax.Array | None) -> bool | jax.Array:
        """Whether layer ``layer`` slides: a Python bool where every layer agrees or the
        index is static (unrolled layers), else a traced bool (a scan or pipeline stage
        runs one program for layers of both kinds)."""
        kinds = set(self.sliding_layers)
        if len(kinds) == 1:
            return kinds.pop()
        if layer is None:
            raise ValueError("a model with sliding and global layers needs the layer index")
        if isinstance(layer, int):
            return self.sliding_layers[layer]
        return jnp.asarray(self.sliding_layers)[layer]

    def _window(self, slides: bool | jax.Array) -> int | jax.Array | None:
        """The layer's window: static (None or an int) when ``slides`` is, else a traced
        int32 with :data:`NO_WINDOW` for global layers."""
        if isinstance(slides, bool):
            return self.window if slides else None
        return jnp.where(slides, jnp.int32(self.window), jnp.int32(NO_WINDOW))

    def _inv_freq(
        self, slides: bool | jax.Array, seq_len_B: jax.Array | None = None
    ) -> np.ndarray | jax.Array:
        """RoPE inverse frequencies of the layer: the local base on sliding layers when the
        config has one (Gemma 3), else the global base with its scaling; under dynamic NTK
        per row ``[B, H/2]``, for rows ``seq_len_B`` positions long."""
        if isinstance(self.rope_scaling, DynamicRopeScaling):
            global_ = dynamic_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling, seq_len_B)
        else:
            global_ = rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)
        if self.rope_linear_factor is not None:
            global_ = (global_ / np.float32(self.rope_linear_factor)).astype(np.float32)
        if self.rope_local_theta is None:
            return global_
        local = rope_inv_freq(self.head_dim, self.rope_local_theta)
        if isinstance(slides, bool):
            return local if slides else global_
        return jnp.where(slides, jnp.asarray(local), jnp.asarray(global_))

    def _qkv(
        self,
        x_BTD: jax.Array,
        pos_BT: jax.Array,
        slides: bool | jax.Array = False,
        seq_len_B: jax.Array | None = None,
    ) -> tuple[jax.Array, ...]:
        """Projected (q/k-normalised), rotated q [B,T,N,H], k and v [B,T,K,H];
        ``seq_len_B``: each row's sequence length after this step (dynamic NTK RoPE)."""
        q_BTNH = self._project(x_BTD, self.q_kernel, self.q_kernel_scale, self.q_bias)
        kv_BTCKH = self._project(x_BTD, self.kv_kernel, self.kv_kernel_scale, self.kv_bias)
        k_BTKH, v_BTKH = kv_BTCKH[:, :, 0], kv_BTCKH[:, :, 1]
        if self.q_norm is not None:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        if self.rope_theta is not None:
            inv_freq = self._inv_freq(slides, seq_len_B)
            scale = rope_attention_factor(self.rope_scaling)
            q_BTNH = apply_rope(q_BTNH, pos_BT, inv_freq, scale)
            k_BTKH = apply_rope(k_BTKH, pos_BT, inv_freq, scale)
        q_BTNH = constrain(q_BTNH, Q_AXES, Module.ATTENTION)
        return q_BTNH, k_BTKH, v_BTKH

    def _output(self, out_BTNH: jax.Array) -> jax.Array:
        """Projects the attention output [B, T, N, H] back to the residual stream."""
        out_BTNH = constrain(out_BTNH, Q_AXES, Module.ATTENTION)
        b, t, n, h = out_BTNH.shape
        # Heads and head_dim merged into one contracting dim on both sides (free reshapes of
        # row-major arrays): with two contracting dims XLA:CPU re-lays the [N, H, D] kernel
        # out into a copy on every step. Quantized, the kernel is stored [D, N, H].
        out_BTX = out_BTNH.reshape(b, t, n * h)
        if self.o_kernel_scale is None:
            o_XD = self.o_kernel[...].reshape(n * h, -1)
            y_BTD = project(out_BTX, o_XD, None, self.dtype, self.matmul)
        else:
            o_DX = self.o_kernel[...].reshape(-1, n * h)
            y_BTD = project(out_BTX, o_DX, self.o_kernel_scale[...], self.dtype, self.matmul)
        if self.o_bias is not None:
            y_BTD = y_BTD + self.o_bias[...].astype(self.dtype)
        return constrain(y_BTD, BTD, Module.ATTENTION)

    def prefill(
        self,
        x_BTD: jax.Array,
        pos_BT: jax.Array,
        lengths_B: jax.Array,
        context: Context | None = None,
        layer: int | jax.Array | None = None,
        *,
        ring: bool = False,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention over a right-padded prompt, or over new tokens continuing cached ones.

        Args:
            x_BTD: Normalised hidden states.
            pos_BT: Absolute positions of every row's tokens (0..T-1 without context).
            lengths_B: Real new tokens per row; keys past them are padding.
            context: This layer's cached keys and values and how many each row has
                (``start_B``): the new tokens sit at positions ``start_B + 0..T-1``.
            layer: The model-wide layer index (int, or traced under scan and pipeline
                stages): picks the layer's window and RoPE base where layers differ.
            ring: The tokens are in the zigzag order of ring attention under sp
                (:mod:`jaxpar.models._ring_attention`; the decoder decides, without
                context): attend by ring, and return k/v in the natural order.

        Returns:
            (y [B, T, D], k [B, T, K, H], v [B, T, K, H]); k/v are what the cache keeps
            (the new tokens' only).
        """
        with jax.named_scope(Module.ATTENTION.value):
            x_BTD = constrain(x_BTD, BTD, Module.ATTENTION)
            slides = self._slides(layer)
            window = self._window(slides)
            seq_len_B = lengths_B if context is None else context.start_B + lengths_B
            q_BTNH, k_BTKH, v_BTKH = self._qkv(x_BTD, pos_BT, slides, seq_len_B)
            if ring:
                return self._ring_prefill(q_BTNH, k_BTKH, v_BTKH, lengths_B, window)
            k_cache = constrain(k_BTKH, PREFILL_KV_AXES, Module.ATTENTION)
            v_cache = constrain(v_BTKH, PREFILL_KV_AXES, Module.ATTENTION)
            k_BSKH = constrain(k_BTKH, KV_SCORE_AXES, Module.ATTENTION)
            v_BSKH = constrain(v_BTKH, KV_SCORE_AXES, Module.ATTENTION)
            if context is not None:
                # Under sp each shard's queries need every earlier key: cached keys too.
                out_BTNH = prefill_over_context(
                    q_BTNH,
                    k_BSKH,
                    v_BSKH,
                    constrain(context.k_BCKH, KV_SCORE_AXES, Module.ATTENTION),
                    constrain(context.v_BCKH, KV_SCORE_AXES, Module.ATTENTION),
                    start_B=context.start_B,
                    lengths_B=lengths_B,
                    window=window,
                    impl=self.prefill_impl,
                    scale=self.scale,
                    softcap=self.softcap,
                    sinks_N=self._sinks(),
                )
                return self._output(out_BTNH), k_cache, v_cache
            out_BTNH = prefill_attention(
                q_BTNH,
                k_BSKH,
                v_BSKH,
                q_pos_BT=pos_BT,
                lengths_B=lengths_B,
                window=window,
                impl=self.prefill_impl,
                scale=self.scale,
                softcap=self.softcap,
                sinks_N=self._sinks(),
            )
            return self._output(out_BTNH), k_cache, v_cache

    def _ring_prefill(self, q_BTNH, k_BTKH, v_BTKH, lengths_B, window):
        """The ring path of :meth:`prefill`: K/V stay split over the sequence (no gather)
        and rotate; the cache's copies go back to the natural order."""
        k_BTKH = constrain(k_BTKH, RING_KV_AXES, Module.ATTENTION)
        v_BTKH = constrain(v_BTKH, RING_KV_AXES, Module.ATTENTION)
        out_BTNH = ring_prefill_attention(
            q_BTNH,
            k_BTKH,
            v_BTKH,
            lengths_B=lengths_B,
            window=window,
            scale=self.scale,
            softcap=self.softcap,
            sinks_N=self._sinks(),
        )
        k_cache = from_zigzag(constrain(k_BTKH, PREFILL_KV_AXES, Module.ATTENTION), PREFILL_KV_AXES)
        v_cache = from_zigzag(constrain(v_BTKH, PREFILL_KV_AXES, Module.ATTENTION), PREFILL_KV_AXES)
        return self._output(out_BTNH), k_cache, v_cache

    def decode_project(
        self, x_B1D: jax.Array, pos_B: jax.Array, layer: int | jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Projected, rotated q [B,1,N,H] and the new token's k, v [B,K,H] (for the cache);
        ``layer`` as in :meth:`prefill`."""
        with jax.named_scope(Module.ATTENTION.value):
            x_B1D = constrain(x_B1D, BTD, Module.ATTENTION)
            slides = self._slides(layer)
            q_B1NH, k_B1KH, v_B1KH = self._qkv(x_B1D, pos_B[:, None], slides, pos_B + 1)
            return q_B1NH, k_B1KH[:, 0], v_B1KH[:, 0]

    def decode_attend(
        self,
        q_B1NH: jax.Array,
        pos_B: jax.Array,
        kv: tuple[jax.Array, jax.Array] | PagedLayer,
        layer: int | jax.Array | None = None,
    ) -> jax.Array:
        """Attention of the new token over its layer's cache, which already holds it.

        The cache is written before it is read (see ``Decoder.decode``): that order lets
        XLA update it in place, with no copy per step.

        Args:
            q_B1NH: The new token's query (from :meth:`decode_project`).
            pos_B: Its position; keys j <= pos_B are valid.
            kv: This layer's cached keys and values including the new token's: contiguous
                ``(k [B, K, S, H], v)`` (the order the contraction over S per (B, K)
                reads), or the paged pool with the rows' block tables.
            layer: As in :meth:`prefill`.

        Returns:
            y [B, 1, D].
        """
        with jax.named_scope(Module.ATTENTION.value):
            window = self._window(self._slides(layer))
            if isinstance(kv, PagedLayer):
                out_BNH = paged_decode_attention(
                    q_B1NH[:, 0],
                    kv,
                    lengths_B=pos_B + 1,
                    window=window,
                    impl=self.paged_impl,
                    scale=self.scale,
                    softcap=self.softcap,
                    sinks_N=self._sinks(),
                )
                return self._output(out_BNH[:, None])
            k_BKSH, v_BKSH = kv
            if not isinstance(k_BKSH, QuantKV):  # quantized: read as stored, scales after
                k_BKSH, v_BKSH = k_BKSH.astype(self.dtype), v_BKSH.astype(self.dtype)
            k_BKSH = constrain_kv(k_BKSH, LAYER_KV_AXES, Module.ATTENTION)
            v_BKSH = constrain_kv(v_BKSH, LAYER_KV_AXES, Module.ATTENTION)
            out_BNH = decode_attention(
                q_B1NH[:, 0],
                k_BKSH,
                v_BKSH,
                lengths_B=pos_B + 1,
                window=window,
                impl=self.decode_impl,
                scale=self.scale,
                softcap=self.softcap,
                sinks_N=self._sinks(),
            )
            return self._output(out_BNH[:, None])
