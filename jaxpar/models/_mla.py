"""Multi-head latent attention (DeepSeek-V3), absorbed form over a cache of the latent.

Each token's keys and values are expanded per head from one compressed latent ``c [R]``
(``kv_lora_rank``, after its RMS norm) by ``kv_b_proj``; one RoPE key ``k_pe [P]``
(``qk_rope_head_dim``) is shared by every head. The cache keeps only ``c`` and ``k_pe`` per
token: no head axis (``ModelConfig.cache_kv_dims``: one "kv head" whose key is ``k_pe`` and
whose value is ``c``).

Scores and outputs never expand the cache. With ``W_UK [R, N, Dn]`` and ``W_UV [R, N, Dv]``
the two halves of ``kv_b_proj``::

    score(n, s) = (q_nope[n] . (W_UK[:, n] c_s) + q_pe[n] . k_pe_s) * scale
                = ((W_UK[:, n] q_nope[n]) . c_s + q_pe[n] . k_pe_s) * scale
    out[n]      = W_UV[:, n]^T (sum_s p(n, s) c_s)

so each query head is absorbed into the latent space (``q_lat [N, R]``) before the cache
and each head's value expanded after it. Under tp the query heads (and ``W_UK``, ``W_UV``
column blocks, the output projection's rows) split as in multi-head attention, while the
latent cache is replicated: every device attends its heads over the whole latent. That is
the "absorbed projections split heads after the cache" form of the spec tables; the cache
is never split by head (it has none).

The attention core here is XLA's (exact; f32 scores and softmax): no fused kernel reads a
latent cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models._attention import Context
from jaxpar.models._attention_kernels import MASKED, key_mask
from jaxpar.models._attention_ops import KV_SCORE_AXES, Q_AXES
from jaxpar.models._cache import LAYER_KV_AXES, PREFILL_KV_AXES
from jaxpar.models._config import ModelConfig
from jaxpar.models._layers import BTD, RMSNorm, fan_in_normal, param
from jaxpar.models._paged import PAGE_AXES, TABLE_AXES, PagedLayer
from jaxpar.models._rope import apply_rope, rope_attention_factor, rope_inv_freq
from jaxpar.spec import Module, active_platform, constrain, logical_shard_map

#: The latents' RMS norms (``q_a_layernorm``, ``kv_a_layernorm``) use 1e-6 whatever
#: ``rms_norm_eps`` says: DeepSeek's reference code and transformers build them with the
#: norm's default epsilon (``rms_norm_eps`` applies to the residual-stream norms only).
LATENT_NORM_EPS = 1e-6
#: Absorbed queries and latent outputs [B, T, N, R or P]: heads split like any query.
DECODE_Q_AXES = ("batch", "heads", "head_dim")


def _deinterleave(x: jax.Array) -> jax.Array:
    """``(x0, x1), (x2, x3), ...`` pairs -> ``x0, x2, ..., x1, x3, ...``: DeepSeek's
    interleaved RoPE layout into the rotate-half one :func:`apply_rope` rotates (the same
    pairs rotate by the same frequencies; q and k permuted alike keep every score)."""
    *lead, p = x.shape
    return x.reshape(*lead, p // 2, 2).swapaxes(-1, -2).reshape(*lead, p)


def latent_attend(q_lat_BTNR, q_pe_BTNP, c_BSR, kpe_BSP, mask_BTS, scale):
    """Softmax attention of absorbed queries over latent keys; returns ``[B, T, N, R]``.

    Scores in float32 from the two parts of each key (latent, RoPE); values are the latent.
    XLA:CPU runs no batched half-precision dot into float32 ("Unsupported element type for
    DotThunk"), so there half-precision operands are widened to float32 first.
    """
    dtype = q_lat_BTNR.dtype
    if active_platform() == "cpu" and jnp.dtype(dtype).itemsize < 4:
        q_lat_BTNR, q_pe_BTNP, c_BSR, kpe_BSP = (
            x.astype(jnp.float32) for x in (q_lat_BTNR, q_pe_BTNP, c_BSR, kpe_BSP)
        )
    s_BNTS = jnp.einsum("BTNR,BSR->BNTS", q_lat_BTNR, c_BSR, preferred_element_type=jnp.float32)
    s_BNTS += jnp.einsum("BTNP,BSP->BNTS", q_pe_BTNP, kpe_BSP, preferred_element_type=jnp.float32)
    s_BNTS = jnp.where(mask_BTS[:, None], s_BNTS * scale, MASKED)
    p_BNTS = jax.nn.softmax(s_BNTS, axis=-1).astype(c_BSR.dtype)
    out = jnp.einsum("BNTS,BSR->BTNR", p_BNTS, c_BSR, preferred_element_type=jnp.float32)
    return out.astype(dtype)


def _paged_latent(q_lat_BNR, q_pe_BNP, kpe_KAZP, c_KAZR, tables_BN, lengths_B, *, scale):
    """One batch shard: the rows' pages of the latent pool gathered, then attended."""
    b = tables_BN.shape[0]
    c_BSR = c_KAZR[0, tables_BN].reshape(b, -1, c_KAZR.shape[-1]).astype(q_lat_BNR.dtype)
    kpe_BSP = kpe_KAZP[0, tables_BN].reshape(b, -1, kpe_KAZP.shape[-1]).astype(q_pe_BNP.dtype)
    k_pos_S = jnp.arange(c_BSR.shape[1], dtype=jnp.int32)
    valid_BS = k_pos_S[None, :] < lengths_B[:, None]
    mask_BTS = key_mask((lengths_B - 1)[:, None], k_pos_S, valid_BS, None)
    out = latent_attend(q_lat_BNR[:, None], q_pe_BNP[:, None], c_BSR, kpe_BSP, mask_BTS, scale)
    return out[:, 0]


class LatentAttention(nnx.Module):
    """DeepSeek-V3's attention; the interface of :class:`~._attention.Attention`.

    Parameters (torch ``Linear`` weights transposed): ``q_a_kernel [D, Rq]``, ``q_a_norm``,
    ``q_b_kernel [Rq, N, Dn + P]`` (or ``q_kernel [D, N, Dn + P]`` without ``q_lora_rank``),
    ``kv_a_kernel [D, R + P]``, ``kv_a_norm [R]``, ``kv_b_kernel [R, N, Dn + Dv]``,
    ``o_kernel [N, Dv, D]``. The latent's dims (R, Rq, P) are on no logical axis: they are
    never split.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        d, n, pd = c.d_model, c.n_heads, c.param_dtype
        self.dtype = c.dtype
        self.rank, self.rope_dim, self.nope_dim = (
            c.mla.kv_lora_rank,
            c.mla.qk_rope_head_dim,
            c.mla.qk_nope_head_dim,
        )
        self.interleave = c.mla.rope_interleave
        qk = c.mla.qk_nope_head_dim + c.mla.qk_rope_head_dim
        self.scale = c.attention.scale if c.attention.scale is not None else qk**-0.5
        # Static RoPE settings (an array attribute would become module state).
        self.rope = (c.mla.qk_rope_head_dim, c.rope.theta, c.rope.scaling)
        q_axes = (None, "heads", None)
        if c.mla.q_lora_rank is None:
            self.q_a_kernel, self.q_a_norm = None, None
            self.q_kernel = param(rngs, fan_in_normal(d), (d, n, qk), ("embed", "heads", None), pd)
        else:
            rq = c.mla.q_lora_rank
            self.q_a_kernel = param(rngs, fan_in_normal(d), (d, rq), ("embed", None), pd)
            self.q_a_norm = RMSNorm(c, rngs=rngs, axis=None, size=rq, eps=LATENT_NORM_EPS)
            self.q_kernel = param(rngs, fan_in_normal(rq), (rq, n, qk), q_axes, pd)
        r, p = c.mla.kv_lora_rank, c.mla.qk_rope_head_dim
        self.kv_a_kernel = param(rngs, fan_in_normal(d), (d, r + p), ("embed", None), pd)
        self.kv_a_norm = RMSNorm(c, rngs=rngs, axis=None, size=r, eps=LATENT_NORM_EPS)
        kv_b = (r, n, c.mla.qk_nope_head_dim + c.mla.v_head_dim)
        self.kv_b_kernel = param(rngs, fan_in_normal(r), kv_b, q_axes, pd)
        self.o_kernel = param(
            rngs,
            fan_in_normal(n, c.mla.v_head_dim),
            (n, c.mla.v_head_dim, d),
            ("heads", None, "embed"),
            pd,
        )

    def _w(self, p: nnx.Param) -> jax.Array:
        return p[...].astype(self.dtype)

    def _rope(self, x_BTXP: jax.Array, pos_BT: jax.Array) -> jax.Array:
        if self.interleave:
            x_BTXP = _deinterleave(x_BTXP)
        scale = rope_attention_factor(self.rope[2])
        return apply_rope(x_BTXP, pos_BT, rope_inv_freq(*self.rope), scale)

    def _project(self, x_BTD: jax.Array, pos_BT: jax.Array):
        """Absorbed queries ``q_lat [B,T,N,R]``, rotated ``q_pe [B,T,N,P]``, the new tokens'
        latent ``c [B,T,1,R]`` (normalised) and rotated RoPE key ``k_pe [B,T,1,P]``."""
        x_BTD = constrain(x_BTD, BTD, Module.ATTENTION)
        if self.q_a_kernel is None:
            q_in = x_BTD
        else:
            q_in = self.q_a_norm(jnp.einsum("BTD,DQ->BTQ", x_BTD, self._w(self.q_a_kernel)))
        q_BTNK = jnp.einsum("BTQ,QNK->BTNK", q_in, self._w(self.q_kernel))
        q_nope, q_pe = q_BTNK[..., : self.nope_dim], q_BTNK[..., self.nope_dim :]
        q_pe = self._rope(q_pe, pos_BT)
        w_uk_RNd = self._w(self.kv_b_kernel)[..., : self.nope_dim]
        q_lat_BTNR = jnp.einsum("BTNd,RNd->BTNR", q_nope, w_uk_RNd)
        kv_BTL = jnp.einsum("BTD,DL->BTL", x_BTD, self._w(self.kv_a_kernel))
        c_BT1R = self.kv_a_norm(kv_BTL[..., : self.rank])[:, :, None]
        kpe_BT1P = self._rope(kv_BTL[:, :, None, self.rank :], pos_BT)
        q_lat_BTNR = constrain(q_lat_BTNR, Q_AXES, Module.ATTENTION)
        q_pe = constrain(q_pe, Q_AXES, Module.ATTENTION)
        return q_lat_BTNR, q_pe, c_BT1R, kpe_BT1P

    def _output(self, out_lat_BTNR: jax.Array) -> jax.Array:
        """Each head's values expanded from its latent output, then the output projection."""
        out_lat_BTNR = constrain(out_lat_BTNR, Q_AXES, Module.ATTENTION)
        w_uv_RNv = self._w(self.kv_b_kernel)[..., self.nope_dim :]
        out_BTNv = jnp.einsum("BTNR,RNv->BTNv", out_lat_BTNR, w_uv_RNv)
        y_BTD = jnp.einsum("BTNv,NvD->BTD", out_BTNv, self._w(self.o_kernel))
        return constrain(y_BTD, BTD, Module.ATTENTION)

    def prefill(
        self,
        x_BTD: jax.Array,
        pos_BT: jax.Array,
        lengths_B: jax.Array,
        context: Context | None = None,
        layer: int | jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """As :meth:`Attention.prefill`; the returned "k" is the RoPE key ``[B, T, 1, P]``
        and "v" the latent ``[B, T, 1, R]`` (what the cache keeps); ``context`` holds them
        for the cached positions."""
        del layer  # every layer alike (no window, one RoPE)
        with jax.named_scope(Module.ATTENTION.value):
            q_lat, q_pe, c_BT1R, kpe_BT1P = self._project(x_BTD, pos_BT)
            kpe_cache = constrain(kpe_BT1P, PREFILL_KV_AXES, Module.ATTENTION)
            c_cache = constrain(c_BT1R, PREFILL_KV_AXES, Module.ATTENTION)
            # Under sp every query shard needs every earlier key: the latent is gathered
            # like K/V (replicated over tp: it has no head to split).
            c_BS1R = constrain(c_BT1R, KV_SCORE_AXES, Module.ATTENTION)
            kpe_BS1P = constrain(kpe_BT1P, KV_SCORE_AXES, Module.ATTENTION)
            b, t = pos_BT.shape
            new_T = jnp.arange(t, dtype=jnp.int32)
            valid_BS = new_T[None, :] < lengths_B[:, None]
            k_pos = pos_BT
            if context is not None:
                ctx_C = jnp.arange(context.k_BCKH.shape[1], dtype=jnp.int32)
                ctx_c = constrain(context.v_BCKH, KV_SCORE_AXES, Module.ATTENTION)
                ctx_kpe = constrain(context.k_BCKH, KV_SCORE_AXES, Module.ATTENTION)
                c_BS1R = jnp.concatenate([ctx_c.astype(c_BS1R.dtype), c_BS1R], axis=1)
                kpe_BS1P = jnp.concatenate([ctx_kpe.astype(kpe_BS1P.dtype), kpe_BS1P], axis=1)
                k_pos = jnp.concatenate([jnp.broadcast_to(ctx_C, (b, ctx_C.shape[0])), pos_BT], 1)
                valid_BS = jnp.concatenate(
                    [ctx_C[None, :] < context.start_B[:, None], valid_BS], axis=1
                )
            mask_BTS = key_mask(pos_BT, k_pos, valid_BS, None)
            out = latent_attend(
                q_lat, q_pe, c_BS1R[:, :, 0], kpe_BS1P[:, :, 0], mask_BTS, self.scale
            )
            return self._output(out), kpe_cache, c_cache

    def decode_project(
        self, x_B1D: jax.Array, pos_B: jax.Array, layer: int | jax.Array | None = None
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array, jax.Array]:
        """``((q_lat, q_pe), k_pe [B, 1, P], c [B, 1, R])``: the query as decode_attend
        takes it and what the cache keeps of the new token."""
        del layer
        with jax.named_scope(Module.ATTENTION.value):
            q_lat, q_pe, c_B11R, kpe_B11P = self._project(x_B1D, pos_B[:, None])
            return (q_lat, q_pe), kpe_B11P[:, 0], c_B11R[:, 0]

    def decode_attend(
        self,
        q: tuple[jax.Array, jax.Array],
        pos_B: jax.Array,
        kv: tuple[jax.Array, jax.Array] | PagedLayer,
        layer: int | jax.Array | None = None,
    ) -> jax.Array:
        """The new token over its layer's latent cache (which already holds it): contiguous
        ``(k_pe [B, 1, S, P], c [B, 1, S, R])`` or the paged pool."""
        del layer
        q_lat_B1NR, q_pe_B1NP = q
        with jax.named_scope(Module.ATTENTION.value):
            lengths_B = pos_B + 1
            if isinstance(kv, PagedLayer):
                body = functools.partial(_paged_latent, scale=self.scale)
                sharded = logical_shard_map(
                    body,
                    in_axes=(
                        DECODE_Q_AXES,
                        DECODE_Q_AXES,
                        PAGE_AXES,
                        PAGE_AXES,
                        TABLE_AXES,
                        ("batch",),
                    ),
                    out_axes=DECODE_Q_AXES,
                    module=Module.ATTENTION,
                )
                out_BNR = sharded(
                    q_lat_B1NR[:, 0],
                    q_pe_B1NP[:, 0],
                    kv.k_KAZH,
                    kv.v_KAZH,
                    kv.block_tables_BN,
                    lengths_B,
                )
                return self._output(out_BNR[:, None])
            kpe_B1SP, c_B1SR = kv
            kpe_B1SP = constrain(kpe_B1SP.astype(self.dtype), LAYER_KV_AXES, Module.ATTENTION)
            c_B1SR = constrain(c_B1SR.astype(self.dtype), LAYER_KV_AXES, Module.ATTENTION)
            k_pos_S = jnp.arange(c_B1SR.shape[2], dtype=jnp.int32)
            valid_BS = k_pos_S[None, :] < lengths_B[:, None]
            mask_BTS = key_mask(pos_B[:, None], k_pos_S, valid_BS, None)
            out = latent_attend(
                q_lat_B1NR, q_pe_B1NP, c_B1SR[:, 0], kpe_B1SP[:, 0], mask_BTS, self.scale
            )
            return self._output(out)
