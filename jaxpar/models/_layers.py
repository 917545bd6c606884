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
from jaxpar.models._quant import QUANT_DTYPES, qmatmul, scale_layout
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
) -> nnx.Param:
    """A parameter tagged with its logical axis names (``out_sharding`` metadata).

    Eager sharding is off: the names are logical, only the engine maps them to a mesh.
    """
    assert len(axes) == len(shape), (shape, axes)
    value = init(rngs.params(), tuple(shape), dtype)
    return nnx.Param(value, out_sharding=axes, init=init, eager_sharding=False)


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
    """A matmul kernel whose ``contract`` dims after ``batch`` leading ones (a MoE's stacked
    experts) are contracted, and its scales (None unless ``config.quantize``; see
    :mod:`jaxpar.models._quant`): the values keep the kernel's logical axes, the scales get
    axes derived from them."""
    if config.quantize is None:
        return param(rngs, init, shape, axes, config.param_dtype), None
    values = param(rngs, init, shape, axes, QUANT_DTYPES[config.quantize])
    scale_shape, scale_axes = scale_layout(tuple(shape), axes, contract, config.quantize, batch)
    return values, param(rngs, ONES, scale_shape, scale_axes, jnp.float32)


def project(
    x_xC: jax.Array, kernel_CO: jax.Array, scale: jax.Array | None, dtype: Any
) -> jax.Array:
    """``x [..., C] @ kernel [C, *O]`` in ``dtype``; a quantized kernel (``scale`` given,
    leading dims ``[g, *O]`` after reshaping with the kernel) through :func:`qmatmul`."""
    if scale is None:
        return jax.lax.dot_general(
            x_xC, kernel_CO.astype(dtype), (((x_xC.ndim - 1,), (0,)), ((), ()))
        )
    return qmatmul(x_xC, kernel_CO, scale.reshape(-1, *kernel_CO.shape[1:]), dtype)


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
    tokens over dp/sp) needs no collective. With ``config.norm_offset`` (Gemma) the scale
    is ``1 + w`` and is applied in float32 before the cast back, as Gemma's
    ``RMSNorm`` does; with ``config.norm_scale_f32`` (GPT-OSS) ``w`` is applied in float32
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
        self.eps = config.norm_eps if eps is None else eps
        self.offset = config.norm_offset
        self.f32_scale = config.norm_offset or config.norm_scale_f32
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
        self.eps = config.norm_eps
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
    return RMSNorm(config, rngs=rngs) if config.norm == "rms" else LayerNorm(config, rngs=rngs)


class Embedding(nnx.Module):
    """Token embedding (scaled by sqrt(D) with ``config.embed_scale``), plus learned
    absolute positions when ``positional='learned'``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.dtype = config.dtype
        v, d, pd = config.vocab_size, config.d_model, config.param_dtype
        # Gemma: vectors times sqrt(D), rounded to the compute dtype first as Hugging Face
        # does (its normaliser is a tensor of the hidden states' dtype).
        self.scale = math.sqrt(d) if config.embed_scale else None
        # std 1/sqrt(D): a tied LM head then gives O(1) logits.
        init = Init("normal", d**-0.5)
        self.token_table = param(rngs, init, (v, d), ("vocab", "embed"), pd)
        q = config.max_position_embeddings
        self.position_table = (
            param(rngs, init, (q, d), ("positions", "embed"), pd)
            if config.positional == "learned"
            else None
        )

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
        """Looks up token (and position) vectors: [B, T] ints -> x [B, T, D]."""
        with jax.named_scope(Module.EMBEDDING.value):
            x_BTD = jnp.take(self.token_table[...], tokens_BT, axis=0).astype(self.dtype)
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
    """Projection to vocabulary logits; tied heads reuse the token embedding table."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.dtype = config.dtype
        d, v = config.d_model, config.vocab_size
        self.kernel = (
            None
            if config.tie_embeddings
            else param(rngs, fan_in_normal(d), (d, v), ("embed", "vocab"), config.param_dtype)
        )

    def __call__(self, x_BxD: jax.Array, tied_table_VD: jax.Array | None) -> jax.Array:
        """Logits in float32: x [B, D] -> [B, V], or x [B, T, D] -> [B, T, V].

        Args:
            x_BxD: Final-norm hidden states, with or without a seq dimension.
            tied_table_VD: The token embedding table when embeddings are tied, else unused.
        """
        with jax.named_scope(Module.LM_HEAD.value):
            lead = ("batch", "seq") if x_BxD.ndim == 3 else ("batch",)
            x_BxD = constrain(x_BxD, (*lead, "embed"), Module.LM_HEAD)
            if self.kernel is None:
                logits = jnp.einsum(
                    "...D,VD->...V",
                    x_BxD,
                    tied_table_VD.astype(self.dtype),
                    preferred_element_type=jnp.float32,
                )
            else:
                logits = jnp.einsum(
                    "...D,DV->...V",
                    x_BxD,
                    self.kernel[...].astype(self.dtype),
                    preferred_element_type=jnp.float32,
                )
            return constrain(logits, (*lead, "vocab"), Module.LM_HEAD)


#: The scale attribute of each FFN projection (by its einsum).
_SCALES = {
    "BTD,DF->BTF": "up_kernel_scale",
    "BTD,DCF->BTCF": "gate_up_kernel_scale",
    "BTF,FD->BTD": "down_kernel_scale",
}


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
        self.act = config.activation
        gated, biased = config.gated_ffn, config.mlp_bias
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

    def _proj(self, x: jax.Array, kernel: nnx.Param, bias: nnx.Param | None, spec: str):
        scale = getattr(self, _SCALES[spec])
        if scale is None:
            y = jnp.einsum(spec, x, kernel[...].astype(self.dtype))
        else:
            y = project(x, kernel[...], scale[...], self.dtype)
        return y if bias is None else y + bias[...].astype(self.dtype)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, D]."""
        with jax.named_scope(Module.FFN.value):
            x_BTD = constrain(x_BTD, BTD, Module.FFN)
            if self.gate_up_kernel is None:
                up_BTF = self._proj(x_BTD, self.up_kernel, self.up_bias, "BTD,DF->BTF")
                h_BTF = ACTIVATIONS[self.act](up_BTF)
            else:
                spec = "BTD,DCF->BTCF"
                gu_BTCF = self._proj(x_BTD, self.gate_up_kernel, self.gate_up_bias, spec)
                h_BTF = ACTIVATIONS[self.act](gu_BTCF[:, :, 0]) * gu_BTCF[:, :, 1]
            h_BTF = constrain(h_BTF, ("batch", "seq", "mlp"), Module.FFN)
            y_BTD = self._proj(h_BTF, self.down_kernel, self.down_bias, "BTF,FD->BTD")
            return constrain(y_BTD, BTD, Module.FFN)
