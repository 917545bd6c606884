"""Small building blocks: parameters with logical axes, norms, embedding, dense FFN, LM head."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.models._config import ModelConfig
from jaxpar.models._quant import (
    QUANT_DTYPES,
    qmatmul,
    rows_product,
    scale_layout,
    stored_order,
)
from jaxpar.models._run import ModelRun
from jaxpar.spec import Module, constrain

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}
BTD = ("batch", "seq", "embed")


@dataclasses.dataclass(frozen=True)
class Init:
    """A parameter initialiser that can also run on the host.

    Kept as parameter metadata, so :func:`jaxpar.models.init_params` can fill an abstract
    model with numpy (no random kernels to compile) while ``Decoder(config, rngs=...)``
    stays an ordinary NNX constructor (for ``nnx.eval_shape`` or a sharded ``jit``).
    """

    kind: str  # "normal", "ones" or "zeros"
    std: float = 0.0

    def __call__(self, key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        """JAX initialisation (traceable)."""
        if self.kind == "normal":
            return (self.std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        return (jnp.ones if self.kind == "ones" else jnp.zeros)(shape, dtype)

    def host(self, rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """Numpy initialisation with the same distribution."""
        if self.kind == "normal":
            return (self.std * rng.standard_normal(shape, np.float32)).astype(dtype)
        return (np.ones if self.kind == "ones" else np.zeros)(shape, dtype)


ONES, ZEROS = Init("ones"), Init("zeros")


def param(
    rngs: nnx.Rngs,
    init: Init,
    shape: Sequence[int],
    axes: tuple[str | None, ...],
    dtype: Any,
    **metadata: Any,
) -> nnx.Param:
    """A parameter tagged with its logical axis names (``out_sharding`` metadata).

    Eager sharding is off: the names are logical, only the engine maps them to a mesh.
    """
    assert len(axes) == len(shape), (shape, axes)
    value = init(rngs.params(), tuple(shape), dtype)
    return nnx.Param(value, out_sharding=axes, init=init, eager_sharding=False, **metadata)


def kernel(
    rngs: nnx.Rngs,
    init: Init,
    shape: Sequence[int],
    axes: tuple[str | None, ...],
    config: ModelRun,
    *,
    contract: int = 1,
    batch: int = 0,
) -> tuple[nnx.Param, nnx.Param | None]:
    """A matmul kernel ``[*batch, *C, *O]`` whose ``contract`` dims C after ``batch``
    leading ones (a MoE's stacked experts) are contracted, and its scales (None unless
    ``config.quantize``; see :mod:`jaxpar.models._quant`). Quantized values are stored in
    :func:`~jaxpar.models._quant.stored_order` (a dense kernel out-major ``[*O, *C]``) with
    the kernel's logical axes permuted alike; both carry that ``stored_order`` as metadata
    (the loaders move a float kernel into it); the scales get axes derived from the
    kernel's."""
    if config.quantize is None:
        return param(rngs, init, shape, axes, config.param_dtype), None
    order = stored_order(len(shape), contract, batch)
    scale_shape, scale_axes = scale_layout(tuple(shape), axes, contract, config.quantize, batch)
    if order is not None:
        shape, axes = [shape[i] for i in order], tuple(axes[i] for i in order)
    dtype = QUANT_DTYPES[config.quantize]
    values = param(rngs, init, shape, axes, dtype, stored_order=order)
    return values, param(rngs, ONES, scale_shape, scale_axes, jnp.float32, stored_order=order)


def matmul(
    x_xC: jax.Array, w: jax.Array, form: str = "dot", w_contract: int = 0, **dot_kw: Any
) -> jax.Array:
    """``x [..., C]`` times ``w`` contracted on its dim ``w_contract`` (``[C, *O]``, or a
    tied table ``[V, D]`` with ``w_contract=1``), both in the compute dtype.
    ``form="rows"`` (XLA:CPU): a one-row product of half-precision operands runs as a
    two-row one (a zero row added, then dropped), because XLA:CPU's one-row dot of a
    non-float32 type is a naive loop and its two-row dot the library's matmul (measured
    ``[1, 2048] x bf16 [2048, 8192]``: about 20 against 3 ms)."""
    lead, out = x_xC.shape[:-1], tuple(n for i, n in enumerate(w.shape) if i != w_contract)
    if form == "rows" and math.prod(lead) == 1 and x_xC.dtype != jnp.float32:
        x_2C = jnp.pad(x_xC.reshape(1, -1), ((0, 1), (0, 0)))
        y = jax.lax.dot_general(x_2C, w, (((1,), (w_contract,)), ((), ())), **dot_kw)
        return y[0].reshape(*lead, *out)
    return jax.lax.dot_general(x_xC, w, (((len(lead),), (w_contract,)), ((), ())), **dot_kw)


def project(
    x_xC: jax.Array,
    kernel: jax.Array,
    scale: jax.Array | None,
    dtype: Any,
    form: str = "dot",
) -> jax.Array:
    """``x [..., C]`` times a kernel in ``dtype``: a float kernel ``[C, *O]`` through
    :func:`matmul`; a quantized one (``scale`` given) stored ``[*O, C]``, its scales
    reshaped to ``[*O, g]``, through :func:`~jaxpar.models._quant.qmatmul`. ``form``: the
    run's ``matmul`` option ("dot", or "rows" on XLA:CPU)."""
    if scale is None:
        return matmul(x_xC, kernel.astype(dtype), form)
    return qmatmul(x_xC, kernel, scale.reshape(*kernel.shape[:-1], -1), dtype, form)


def fan_in_normal(*in_dims: int) -> Init:
    """Normal init with std 1/sqrt(fan_in): activations stay O(1) at any depth or width."""
    return Init("normal", math.prod(in_dims) ** -0.5)


def bias_init(rngs: nnx.Rngs, shape: Sequence[int], axes: tuple[str | None, ...], dtype: Any):
    """A small random bias (random so tests exercise it; real values come from checkpoints)."""
    return param(rngs, Init("normal", 0.02), shape, axes, dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm with a learned scale, statistics in float32.

    By default over the residual stream (scale ``[D]``, axis ``embed``); ``axis="head_dim"``
    gives Qwen3's and Gemma 3's per-head q/k norm (scale ``[H]``, shared by every head).
    Each vector is normalised alone, so a split of the other dimensions (heads over tp,
    tokens over dp/sp) needs no collective. With ``config.norms.offset`` (Gemma) the scale
    is ``1 + w`` and is applied in float32 before the cast back, as Gemma's
    ``RMSNorm`` does; with ``config.norms.scale_f32`` (GPT-OSS) ``w`` is applied in float32
    before the cast back; otherwise the normalised vector is cast first and scaled by ``w``
    in its dtype, as Llama's does.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
        axis: str | None = "embed",
        size: int | None = None,
        eps: float | None = None,
    ):
        self.eps = config.norms.eps if eps is None else eps
        self.offset = config.norms.offset
        self.f32_scale = config.norms.offset or config.norms.scale_f32
        if size is None:  # ``size`` (with axis None): a vector no primitive splits (MLA's latents)
            size = {"embed": config.d_model, "head_dim": config.head_dim}[axis]
        init = ZEROS if self.offset else ONES  # an identity scale either way
        self.scale = param(rngs, init, (size,), (axis,), config.param_dtype)

    def __call__(self, x_xD: jax.Array) -> jax.Array:
        """Normalises the last dimension of ``x [..., D]`` (or ``[..., H]``); returns its dtype."""
        x = x_xD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        if self.f32_scale:
            scale = self.scale[...].astype(jnp.float32) + (1.0 if self.offset else 0.0)
            return (x * scale).astype(x_xD.dtype)
        # Cast before scaling, as Hugging Face's Llama does.
        return x.astype(x_xD.dtype) * self.scale[...].astype(x_xD.dtype)


class LayerNorm(nnx.Module):
    """Layer norm with learned scale and bias (GPT-2), statistics in float32."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.eps = config.norms.eps
        d, pd = config.d_model, config.param_dtype
        self.scale = param(rngs, ONES, (d,), ("embed",), pd)
        self.bias = param(rngs, ZEROS, (d,), ("embed",), pd)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        """Normalises the last dimension; returns the input dtype."""
        x = x_BTD.astype(jnp.float32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x_BTD.dtype)


def make_norm(config: ModelConfig, *, rngs: nnx.Rngs) -> RMSNorm | LayerNorm:
    """The norm the config asks for."""
    return (
        RMSNorm(config, rngs=rngs) if config.norms.kind == "rms" else LayerNorm(config, rngs=rngs)
    )


def _table_run(config: ModelRun) -> ModelRun:
    """The run the embedding and LM head are built under: quantized only with
    ``quantize_embeddings``."""
    if config.quantize is None or config.quantize_embeddings:
        return config
    return config.with_options(quantize=None)


class Embedding(nnx.Module):
    """Token embedding (scaled by sqrt(D) with ``config.embed.scale``), plus learned
    absolute positions when ``positional='learned'``. With ``quantize_embeddings`` the
    token table is quantized per row (``token_table_scale [V, 1]``; int4 ``[V, D // g]``):
    the lookup scales the rows it gathers."""

    def __init__(self, config: ModelConfig | ModelRun, *, rngs: nnx.Rngs):
        config = _table_run(ModelRun.of(config))
        self.dtype = config.dtype
        v, d, pd = config.vocab_size, config.d_model, config.param_dtype
        # Gemma: vectors times sqrt(D), rounded to the compute dtype first as Hugging Face
        # does (its normaliser is a tensor of the hidden states' dtype).
        self.scale = math.sqrt(d) if config.embed.scale else None
        # std 1/sqrt(D): a tied LM head then gives O(1) logits. Rows are per token: a batch
        # dim of the quantization (per-row scales), contracted over D by a tied head.
        init = Init("normal", d**-0.5)
        self.token_table, self.token_table_scale = kernel(
            rngs, init, (v, d), ("vocab", "embed"), config, batch=1
        )
        q = config.max_position_embeddings
        self.position_table = (
            param(rngs, init, (q, d), ("positions", "embed"), pd)
            if config.positional == "learned"
            else None
        )

    def table(self) -> tuple[jax.Array, jax.Array | None]:
        """The token table ``[V, D]`` and its per-row scales (None when float), for a tied
        LM head."""
        scale = self.token_table_scale
        return self.token_table[...], None if scale is None else scale[...]

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
        """Looks up token (and position) vectors: [B, T] ints -> x [B, T, D]."""
        with jax.named_scope(Module.EMBEDDING.value):
            table_VD, scale_Vg = self.table()
            if scale_Vg is None:
                x_BTD = jnp.take(table_VD, tokens_BT, axis=0).astype(self.dtype)
            else:  # the gathered rows times their own scales (per row, or per group)
                rows_BTD = jnp.take(table_VD, tokens_BT, axis=0).astype(jnp.float32)
                s_BTg = jnp.take(scale_Vg, tokens_BT, axis=0)
                rows_BTgG = rows_BTD.reshape(*rows_BTD.shape[:-1], s_BTg.shape[-1], -1)
                x_BTD = (rows_BTgG * s_BTg[..., None]).reshape(rows_BTD.shape).astype(self.dtype)
            if self.scale is not None:
                x_BTD = x_BTD * jnp.asarray(self.scale, self.dtype)
            if self.position_table is not None:
                # Padding may sit past the table (a chunk near the end): clamp, never NaN.
                last = self.position_table.shape[0] - 1
                pos_BTD = jnp.take(
                    self.position_table[...], jnp.minimum(positions_BT, last), axis=0
                )
                x_BTD = x_BTD + pos_BTD.astype(self.dtype)
            return constrain(x_BTD, BTD, Module.EMBEDDING)


class LMHead(nnx.Module):
    """Projection to vocabulary logits; tied heads reuse the token embedding table. With
    ``quantize_embeddings`` an untied kernel is quantized per vocabulary row (stored
    out-major ``[V, D]``, as a tied table is) and both run :func:`project`'s quantized
    matmul, scales after the contraction."""

    def __init__(self, config: ModelConfig | ModelRun, *, rngs: nnx.Rngs):
        config = _table_run(ModelRun.of(config))
        self.dtype = config.dtype
        self.matmul = config.matmul
        d, v = config.d_model, config.vocab_size
        self.kernel, self.kernel_scale = (
            (None, None)
            if config.embed.tied
            else kernel(rngs, fan_in_normal(d), (d, v), ("embed", "vocab"), config)
        )

    def __call__(
        self, x_BxD: jax.Array, tied: tuple[jax.Array, jax.Array | None] | None
    ) -> jax.Array:
        """Logits in float32: x [B, D] -> [B, V], or x [B, T, D] -> [B, T, V].

        Args:
            x_BxD: Final-norm hidden states, with or without a seq dimension.
            tied: The token embedding table and its scales (:meth:`Embedding.table`) when
                embeddings are tied, else unused.
        """
        with jax.named_scope(Module.LM_HEAD.value):
            lead = ("batch", "seq") if x_BxD.ndim == 3 else ("batch",)
            x_BxD = constrain(x_BxD, (*lead, "embed"), Module.LM_HEAD)
            if self.kernel is None:
                w, scale = tied
            else:
                w, scale = self.kernel[...], self.kernel_scale
                scale = None if scale is None else scale[...]
            one_row = math.prod(x_BxD.shape[:-1]) == 1
            if scale is None and self.kernel is None and self.matmul == "rows" and one_row:
                # A float tied table is out-major [V, D]: XLA:CPU's one-row dot over it is
                # a naive loop (bf16 [32000, 2048]: 83 ms, the row reductions 7 ms).
                logits = rows_product(x_BxD, w.astype(self.dtype))
            elif scale is None:  # a float table [V, D] (tied) or kernel [D, V]
                w_contract = int(self.kernel is None)
                logits = matmul(
                    x_BxD,
                    w.astype(self.dtype),
                    self.matmul,
                    w_contract=w_contract,
                    preferred_element_type=jnp.float32,
                )
            else:  # quantized, [V, D] either way
                s_Vg = scale.reshape(w.shape[0], -1)
                logits = qmatmul(x_BxD, w, s_Vg, self.dtype, self.matmul, out_dtype=jnp.float32)
            return constrain(logits, (*lead, "vocab"), Module.LM_HEAD)


class FFN(nnx.Module):
    """Dense feed-forward block: SwiGLU (gate and up in one weight, then down) or a plain MLP.

    The gated form keeps gate and up in one kernel ``[D, 2, F]``: one matmul reads both,
    and splitting F over tp gives every device matching gate and up columns.
    """

    def __init__(self, config: ModelConfig | ModelRun, *, rngs: nnx.Rngs, d_ff: int | None = None):
        # ``d_ff``: another width than ``config.d_ff`` (DeepSeek's dense layers, shared experts).
        config = ModelRun.of(config)
        d, f, pd = config.d_model, d_ff or config.d_ff, config.param_dtype
        self.dtype = config.dtype
        self.matmul = config.matmul
        self.act = config.ffn.activation
        gated, biased = config.ffn.gated, config.ffn.bias
        # Optional parameters are None (static) when absent: assign each attribute once.
        # Quantized (config.quantize): each kernel has a <name>_scale, else None.
        self.gate_up_kernel, self.gate_up_kernel_scale = (
            kernel(rngs, fan_in_normal(d), (d, 2, f), ("embed", None, "mlp"), config)
            if gated
            else (None, None)
        )
        self.up_kernel, self.up_kernel_scale = (
            (None, None)
            if gated
            else kernel(rngs, fan_in_normal(d), (d, f), ("embed", "mlp"), config)
        )
        self.down_kernel, self.down_kernel_scale = kernel(
            rngs, fan_in_normal(f), (f, d), ("mlp", "embed"), config
        )
        self.gate_up_bias = bias_init(rngs, (2, f), (None, "mlp"), pd) if gated and biased else None
        self.up_bias = bias_init(rngs, (f,), ("mlp",), pd) if biased and not gated else None
        self.down_bias = bias_init(rngs, (d,), ("embed",), pd) if biased else None

    def _proj(
        self, x: jax.Array, kernel: nnx.Param, scale: nnx.Param | None, bias: nnx.Param | None
    ) -> jax.Array:
        s = None if scale is None else scale[...]
        y = project(x, kernel[...], s, self.dtype, self.matmul)
        return y if bias is None else y + bias[...].astype(self.dtype)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, D]."""
        with jax.named_scope(Module.FFN.value):
            x_BTD = constrain(x_BTD, BTD, Module.FFN)
            if self.gate_up_kernel is None:
                up_BTF = self._proj(x_BTD, self.up_kernel, self.up_kernel_scale, self.up_bias)
                h_BTF = ACTIVATIONS[self.act](up_BTF)
            else:
                gu_BTCF = self._proj(
                    x_BTD, self.gate_up_kernel, self.gate_up_kernel_scale, self.gate_up_bias
                )
                h_BTF = ACTIVATIONS[self.act](gu_BTCF[:, :, 0]) * gu_BTCF[:, :, 1]
            h_BTF = constrain(h_BTF, ("batch", "seq", "mlp"), Module.FFN)
            y_BTD = self._proj(h_BTF, self.down_kernel, self.down_kernel_scale, self.down_bias)
            return constrain(y_BTD, BTD, Module.FFN)
