"""The experts' matmuls over stacked kernels ``[E, C, O]``, float or weight-only quantized.

Two forms of one product, rows grouped by expert: the grouped matmul (``ragged_dot``, each
row against its own expert's kernel: GPU, TPU) and batched matmuls over every local expert
with rows masked per group (XLA:CPU, whose ``ragged_dot`` lowering copies the kernels).

A quantized kernel (:mod:`jaxpar.models._quant`) has scales ``[E, g, O]``: per output
channel of each expert (g = 1), or per group of ``C // g`` contracted rows (int4). The
kernel enters the dot only through ``astype`` (the dot's operand) and the scales multiply
the dot's output, never the kernel, so no dequantized expert weight is formed: per output
channel that is exact (``x @ (w * s) = (x @ w) * s`` column by column); the grouped
matmul gathers each row's expert's scales (``[R, O]``, an activation's size) after the
dot. int4 groups contract one group at a time (a batch dimension of the dot, over a
reshaped, not copied, kernel) and sum the scaled partial products in float32. The MoE
runs int4 kernels of several groups on the masked form on every backend: the grouped
form's ``ragged_dot_general`` made libtpu's compiler abort under ep (v5e, compile-only),
so it is checked on CPU here but not used by the engine.

Written here rather than taken from ``qwix`` (read as of its ``ragged_dot`` /
``ragged_dot_general`` in ``qwix/_src/core``, late 2025): its ``ragged_dot`` scales the
output only when the kernel's scales are one per output column shared by every group;
scales per group (per expert, as here) or tiled along the contraction (int4 groups) take
its slow path, ``qarray.dequantize(rhs)`` -- ``q * scale`` of every expert kernel --
before the call, and its ``ragged_dot_general`` does so whenever the activations are
float (weight-only). It also calls ``lax.ragged_dot`` on every backend, which XLA:CPU
lowers by copying the kernels. The README's *Quantized weights* says more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expert_of_rows(group_sizes_E: jax.Array, rows: int) -> jax.Array:
    """The local expert of each of ``rows`` expert-sorted rows; ``E`` past the groups."""
    ends_E = jnp.cumsum(group_sizes_E)
    r_R = jnp.arange(rows, dtype=ends_E.dtype)
    return jnp.sum(r_R[:, None] >= ends_E[None, :], axis=1).astype(jnp.int32)


def grouped_matmul(
    x_RC: jax.Array,
    w_ECO: jax.Array,
    group_sizes_E: jax.Array,
    scale_EgO: jax.Array | None = None,
) -> jax.Array:
    """Row r of ``x`` times its expert's kernel (rows sorted by expert, ``group_sizes_E``
    rows each; rows past the groups give zeros). Returns ``[R, O]`` in ``x``'s dtype."""
    dtype = x_RC.dtype
    w_ECO = w_ECO.astype(dtype)
    if scale_EgO is None:
        return jax.lax.ragged_dot(x_RC, w_ECO, group_sizes_E)
    (r, c), (e, g, o) = x_RC.shape, scale_EgO.shape
    expert_R = expert_of_rows(group_sizes_E, r)
    scale_RgO = scale_EgO.astype(jnp.float32).at[expert_R].get(mode="fill", fill_value=0)
    if g == 1:
        y_RO = jax.lax.ragged_dot(x_RC, w_ECO, group_sizes_E)
        return y_RO * scale_RgO[:, 0].astype(dtype)
    # One dot over the groups as a batch dimension: [R, g, G] x [E, g, G, O] -> [g, R, O].
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((2,), (2,)), ((1,), (1,))),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    y_gRO = jax.lax.ragged_dot_general(
        x_RC.reshape(r, g, c // g),
        w_ECO.reshape(e, g, c // g, o),
        group_sizes_E,
        dims,
        preferred_element_type=jnp.float32,
    )
    return jnp.einsum("gRO,RgO->RO", y_gRO, scale_RgO).astype(dtype)


def masked_matmul(
    x_ERC: jax.Array, w_ECO: jax.Array, scale_EgO: jax.Array | None = None
) -> jax.Array:
    """Every local expert's rows (masked per group by the caller) times its kernel:
    ``[E, R, C] x [E, C, O] -> [E, R, O]`` in ``x``'s dtype."""
    dtype = x_ERC.dtype
    (e, r, c), g = x_ERC.shape, 1 if scale_EgO is None else scale_EgO.shape[1]
    if g == 1:
        y_ERO = jnp.einsum("ERC,ECO->ERO", x_ERC, w_ECO.astype(dtype))
        return y_ERO if scale_EgO is None else y_ERO * scale_EgO.astype(dtype)
    # One batch dim of E x g (expert, group) pairs over the kernel reshaped in place: as
    # two batch dims XLA:CPU ran it 5x slower (measured, E 8, D 512, 2 rows). Operands
    # widened to f32, not preferred_element_type: XLA:CPU's dot thunk refused bf16 x bf16
    # -> f32 for the batched form at D 512 (and it widens a narrow operand in any case).
    f32, grp = jnp.float32, c // g
    x_BRG = x_ERC.reshape(e, r, g, grp).transpose(0, 2, 1, 3).reshape(e * g, r, grp)
    y_BRO = jnp.einsum("BRG,BGO->BRO", x_BRG.astype(f32), w_ECO.astype(f32).reshape(e * g, grp, -1))
    y_EgRO = y_BRO.reshape(e, g, r, -1)
    return jnp.einsum("EgRO,EgO->ERO", y_EgRO, scale_EgO.astype(f32)).astype(dtype)
