"""Weight-only post-training quantization: int8 and fp8 per output channel, int4 per group.

A quantized kernel is two parameters: the low-precision values and ``<name>_scale``
(float32). A dense kernel's values are stored out-major, ``[*O, *C]`` (the float kernel
is ``[*C, *O]``), as ``torch.nn.Linear`` and the Hub's checkpoints store them, with the
float kernel's logical axes permuted alike (:func:`stored_order`, kept as the parameters'
``stored_order`` metadata so the loaders can move a float kernel into it); a MoE's
stacked experts keep ``[E, C, O]``, the grouped matmul's operand. The scales' logical
axes are derived from the kernel's (:func:`scale_layout`): a dim the scales reduce (a
contraction dim, per output channel) becomes size 1 with no name; every other dim keeps
its name, so the spec layer splits a scale exactly as its kernel (a tp-split column's
scales split with it) and no mesh axis is named here. int4 groups the last contraction
dim into groups of :data:`INT4_GROUP` (or the whole dim when shorter): its scale dim is
``dim // group`` and keeps the dim's name, so groups split with their rows (a strategy
must then split the groups evenly: ``dim // group`` divisible by the dim's degree).

The matmul reads the quantized bytes (:func:`qmatmul`) in one of two forms (the run's
``matmul`` option): on GPU and TPU ``dot(x, w_q.astype(dtype))`` with the scales after
the contraction, the convert being the dot's operand (fused into the matmul there; not
yet checked on GPU hardware); on XLA:CPU, for decode's few rows, fused multiplies and
row reductions over the out-major rows (XLA:CPU runs a dot with a cast operand as a
naive loop). Neither forms a dequantized weight (``w_q * scale``;
``tests/test_data_movement.py`` counts one). Grouped scales apply per group after a
contraction over each group, then the groups are summed.

Quantized: every attention and dense-FFN projection kernel, and the MoE experts' stacked
kernels (per expert: the experts dim is a ``batch`` dim of :func:`scale_layout`, kept and
split over ep; their grouped and masked matmuls are :mod:`jaxpar.models._moe_matmul`).
The token embedding and the LM head only when asked (``quantize_embeddings``: per
vocabulary row, the table a batch dim of :func:`scale_layout`; off by default, since the
head's error goes straight into the logits). Never: norms, biases and the MoE router
(``[D, E]``, a sliver of the bytes, and its error would change which experts run).

Why not ``qwix`` (Google's JAX quantization library, evaluated as 0.1.8): its scales
do inherit the kernel's ``out_sharding`` logical names with reduced dims unnamed, the
same rule as here, so sharding would compose; but (1) its NNX integration
(``qwix.quantize_model``) intercepts one method per model, while a jaxpar decoder runs
``prefill`` (with or without a cached context) and ``decode`` as separate compiled
programs; (2) with float activations its weight-only dot dequantizes the whole weight
first (``qarray.dequantize(rhs)``: ``q * scale`` of the weight's size) and relies on the
backend fusing that into the dot, which XLA:CPU does not and which puts the scale
multiply before the contraction rather than after it; (3) its quantized state is nested
``qvalue``/``scale`` trees under each parameter, which the engine's placement, the
checkpoint loader and ``explain`` would all have to learn. What it would have given is
~60 lines of scale arithmetic, written here instead; qwix is not a dependency.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import ConfigError

#: ``ExecutionOptions.quantize`` values and their stored dtypes.
QUANT_DTYPES: dict[str, Any] = {
    "int8": jnp.int8,
    "fp8": jnp.float8_e4m3fn,
    "int4": jnp.int4,
}
#: The largest magnitude each format stores (symmetric, no zero point).
QUANT_MAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
#: int4 group size along the last contraction dim.
INT4_GROUP = 128
SCALE_SUFFIX = "_scale"


def check_quantize(mode: str | None) -> None:
    """Raises ConfigError for a quantization jaxpar does not implement."""
    if mode is not None and mode not in QUANT_DTYPES:
        raise ConfigError(f"quantize={mode!r}; legal: None, {', '.join(QUANT_DTYPES)}")


def stored_order(ndim: int, contract: int, batch: int = 0) -> tuple[int, ...] | None:
    """The permutation from a float kernel ``[*batch, *C, *O]`` (``contract`` dims C) to
    its quantized values: a dense kernel (``batch`` 0) is stored out-major ``[*O, *C]``,
    as ``torch.nn.Linear`` and the Hub's checkpoints store it, so a few-row matmul reads
    each output's weights contiguously (:func:`qmatmul`'s ``"rows"`` form); a MoE's
    stacked experts stay ``[E, C, O]``, the grouped matmul's operand (None: as it is)."""
    if batch:
        return None
    return (*range(contract, ndim), *range(contract))


def _full_order(ndim: int, order: tuple[int, ...]) -> list[int]:
    """``order`` over a kernel's own dims extended to ``ndim`` dims (stacked layers lead)."""
    lead = ndim - len(order)
    return [*range(lead), *(lead + i for i in order)]


def to_stored(w: Any, order: tuple[int, ...] | None) -> Any:
    """A float kernel (or its scales' float-order layout) in its quantized storage order
    (``order`` from :func:`stored_order`, over the kernel's own dims; leading dims past
    those, stacked layers, stay first). ``order`` None: ``w`` unchanged."""
    return w if order is None else jnp.transpose(w, _full_order(w.ndim, order))


def from_stored(w: Any, order: tuple[int, ...] | None) -> Any:
    """The inverse of :func:`to_stored`: stored values (or scales) back in the float
    kernel's order."""
    return w if order is None else jnp.transpose(w, np.argsort(_full_order(w.ndim, order)))


def float_layout(
    shape: tuple[int, ...], axes: tuple[str | None, ...], order: tuple[int, ...] | None
) -> tuple[tuple[int, ...], tuple[str | None, ...]]:
    """The float-order shape and axes of a tensor stored in ``order``: what a
    checkpoint's kernel or scale is read as before :func:`to_stored`."""
    if order is None:
        return tuple(shape), tuple(axes)
    inverse = np.argsort(_full_order(len(shape), order))
    return tuple(shape[i] for i in inverse), tuple(axes[i] for i in inverse)


def scale_layout(
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    contract: int,
    mode: str,
    batch: int = 0,
) -> tuple[tuple[int, ...], tuple[str | None, ...]]:
    """The scale's shape and logical axes for a float kernel ``shape`` whose ``contract``
    dims after its ``batch`` leading ones are contracted, in the kernel's storage order
    (:func:`stored_order`: a dense kernel's scales ``[*O, 1]``, a MoE's ``[E, 1, O]``).
    Per output channel; int4: per group of the last contracted dim. Batch dims (a MoE's
    stacked experts) keep their size and name: each expert has its own scales, split over
    ep as the experts are.

    Raises:
        ConfigError: an int4 group that does not divide its dim.
    """
    end = batch + contract
    last = end - 1
    if mode != "int4":
        reduced = list(shape[:batch]) + [1] * contract + list(shape[end:])
        names = [*axes[:batch], *(None,) * contract, *axes[end:]]
    else:
        group = min(INT4_GROUP, shape[last])
        if shape[last] % group:
            raise ConfigError(f"int4: group {group} does not divide contraction dim {shape[last]}")
        # The other contracted dims stay whole (an o-projection's groups are per head).
        reduced, names = list(shape), list(axes)
        reduced[last] = shape[last] // group
        if reduced[last] == 1:  # one group: per channel along this dim, nothing to split
            names[last] = None
    order = stored_order(len(shape), contract, batch)
    if order is not None:
        reduced, names = [reduced[i] for i in order], [names[i] for i in order]
    return tuple(reduced), tuple(names)


def _quantize_array(w: jax.Array, scale_shape: tuple[int, ...], mode: str):
    """(values, float32 scales) of a float kernel; scales of shape ``scale_shape``.

    A dim the scale keeps whole is left, a size-1 scale dim is reduced over (max |w|),
    any other is split into (groups, group) and reduced over the group.
    """
    expanded, reduce, scale_expanded = [], [], []
    for n, s in zip(w.shape, scale_shape, strict=True):
        if s == n:
            expanded.append(n)
            scale_expanded.append(n)
        elif s == 1:
            reduce.append(len(expanded))
            expanded.append(n)
            scale_expanded.append(1)
        else:
            expanded += [s, n // s]
            scale_expanded += [s, 1]
            reduce.append(len(expanded) - 1)
    w_x = w.astype(jnp.float32).reshape(expanded)
    amax = jnp.max(jnp.abs(w_x), axis=tuple(reduce), keepdims=True)
    scale_x = jnp.where(amax > 0, amax / QUANT_MAX[mode], 1.0)
    v = w_x / scale_x
    if mode == "fp8":
        v = jnp.clip(v, -QUANT_MAX[mode], QUANT_MAX[mode])
    else:
        v = jnp.clip(jnp.round(v), -QUANT_MAX[mode], QUANT_MAX[mode])
    q = v.astype(QUANT_DTYPES[mode]).reshape(w.shape)
    return q, scale_x.reshape(scale_shape)


_quantize_jit = jax.jit(_quantize_array, static_argnums=(1, 2))


def quantize_array(w: Any, scale_shape: tuple[int, ...], mode: str) -> tuple[jax.Array, jax.Array]:
    """:func:`_quantize_array` compiled; runs where ``w`` lies (a sharded kernel stays
    sharded: the max over a split dim is a collective, and the result is the same integer
    weights and scales on every mesh)."""
    return _quantize_jit(jnp.asarray(w), tuple(scale_shape), mode)


def rows_product(x_xC: jax.Array, w_OC: jax.Array) -> jax.Array:
    """``x [..., C]`` times an out-major ``w [*O, C]`` as fused multiplies and reductions
    over ``w``'s contiguous rows, in float32: ``[..., *O]``. XLA:CPU's fast form for a few
    rows (:func:`qmatmul`'s ``"rows"``; a tied LM head's table at one row)."""
    lead, out, c = x_xC.shape[:-1], w_OC.shape[:-1], w_OC.shape[-1]
    m = math.prod(lead)
    w_OC = w_OC.astype(jnp.float32)
    if m == 1:  # output-major: one pass over the weights
        y = jnp.sum(w_OC * x_xC.reshape(c).astype(jnp.float32), axis=-1)
    else:  # row-major: the kernel streams once per row
        x_MC = x_xC.reshape(m, *((1,) * len(out)), c).astype(jnp.float32)
        y = jnp.sum(w_OC[None] * x_MC, axis=-1)
    return y.reshape(*lead, *out)


#: The most rows (the product of ``x``'s leading dims: decode's batch) :func:`qmatmul`
#: runs as row reductions under ``form="rows"``; more (prefill) run the dot.
ROWS_MAX = 64


def qmatmul(
    x_xC: jax.Array,
    w_OC: jax.Array,
    scale_Og: jax.Array,
    dtype: Any,
    form: str = "dot",
    out_dtype: Any = None,
) -> jax.Array:
    """``x [..., C]`` times the quantized kernel ``w [*O, C]`` (stored out-major) with
    ``scale [*O, g]`` (g = 1: per output channel; else ``C // g`` contracted values per
    group). Returns ``[..., *O]`` in ``out_dtype`` (default ``dtype``, the weight's cast;
    the LM head asks float32 logits).

    The weight is read only through ``astype`` and the scales multiply partial products,
    never the weight, so no dequantized weight is formed. ``form``:

    - ``"dot"``: one dot with the cast weight as its operand (fused into the matmul where
      the backend fuses it: GPU and TPU); int4 groups contract as a batch dimension of the
      dot and the scaled partial products are summed in float32.
    - ``"rows"`` (XLA:CPU) up to :data:`ROWS_MAX` rows (decode): each output as one fused
      multiply and reduction over its contiguous row of weights, in float32. XLA:CPU runs
      a dot whose operand is cast as a naive loop, and a dot over the out-major kernel
      re-lays it into a copy every step; the row reductions read the narrow bytes where
      they lie (measured one row against int8 ``[16384, 2048]``: 2.2 ms, against 46 ms
      as a dot). Past one row they stream the kernel once per row: 16 rows over a 32 MB
      kernel take 44 ms, about the dot's 34 ms plus copy.
    """
    lead, out = x_xC.shape[:-1], w_OC.shape[:-1]
    m, c, g = math.prod(lead), w_OC.shape[-1], scale_Og.shape[-1]
    if form == "rows" and m <= ROWS_MAX:
        # Only C is reshaped: merging output dims could merge a tp-split dim into a minor
        # position, which SPMD can only do by re-laying the kernel.
        ones = (1,) * len(out)
        if g == 1:  # one reduction per output (a two-level one runs slower on XLA:CPU)
            y = rows_product(x_xC, w_OC) * scale_Og[..., 0].astype(jnp.float32)
            return y.astype(out_dtype or dtype)
        w_OgG = w_OC.reshape(*out, g, c // g).astype(jnp.float32)
        s_Og = scale_Og.astype(jnp.float32)
        x_MgG = x_xC.reshape(m, *ones, g, c // g).astype(jnp.float32)
        x_MgG = x_MgG[0] if m == 1 else x_MgG
        w_OgG = w_OgG if m == 1 else w_OgG[None]
        y = jnp.sum(jnp.sum(w_OgG * x_MgG, axis=-1) * s_Og, axis=-1)
        return y.astype(out_dtype or dtype).reshape(*lead, *out)
    nl, no = len(lead), len(out)
    w = w_OC.astype(dtype)
    if g == 1:
        dims = (((nl,), (no,)), ((), ()))
        y = jax.lax.dot_general(x_xC, w, dims, preferred_element_type=out_dtype)
        return y * scale_Og[..., 0].astype(out_dtype or dtype)
    x_xgG = x_xC.reshape(*lead, g, c // g)
    w_OgG = w.reshape(*out, g, c // g)
    # Batched over groups: y [g, ..., *O], each group's partial product in float32.
    y = jax.lax.dot_general(
        x_xgG,
        w_OgG,
        (((nl + 1,), (no + 1,)), ((nl,), (no,))),
        preferred_element_type=jnp.float32,
    )
    s_gO = jnp.moveaxis(scale_Og.astype(jnp.float32), -1, 0)
    s_gxO = s_gO.reshape(g, *([1] * nl), *out)
    return jnp.sum(y * s_gxO, axis=0).astype(out_dtype or dtype)


def params_quantization(params: nnx.State) -> str | None:
    """The weight-only quantization parameters hold (None: float): read off the stored
    dtype of a kernel that has a ``_scale``, so quantized parameters say what they are."""
    flat = dict(nnx.to_flat_state(params))
    modes = {np.dtype(dt): mode for mode, dt in QUANT_DTYPES.items()}
    for path in flat:
        name = str(path[-1])
        if name.endswith(SCALE_SUFFIX):
            kernel = flat.get((*path[:-1], name[: -len(SCALE_SUFFIX)]))
            if kernel is not None:
                return modes.get(np.dtype(kernel.get_value().dtype))
    return None


def held_quantization(params: nnx.State) -> dict[str, Any]:
    """The quantization options parameters hold: ``quantize`` (:func:`params_quantization`)
    and ``quantize_embeddings`` (whether the token table has scales)."""
    flat = dict(nnx.to_flat_state(params))
    table_scale = ("embed", "token_table" + SCALE_SUFFIX)
    return {"quantize": params_quantization(params), "quantize_embeddings": table_scale in flat}


def element_bytes(dtype: Any) -> float:
    """Bytes per element as stored: int4 is half a byte (two to a byte when packed)."""
    dtype = np.dtype(dtype)
    return 0.5 if dtype == np.dtype(jnp.int4) else float(dtype.itemsize)


def param_bytes(params: Any) -> int:
    """Bytes of a parameter tree (whole arrays; int4 at half a byte per element)."""
    return int(sum(np.prod(x.shape) * element_bytes(x.dtype) for x in jax.tree.leaves(params)))
