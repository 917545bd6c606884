"""Per-device MoE routing plans: sort by expert, capacity slots, receiver groups, grouped matmul.

Everything here runs on one device's tokens (inside the MoE ``shard_map``, or on the whole
batch on one device); no function names a mesh axis or issues a collective. Letters: n
tokens on this device, k = top_k, A = n * k assignments (token, choice), E experts, P
expert-parallel peers (E_l = E / P experts each), C rows per peer, R = P * C rows received.

An assignment's destination is the peer holding its expert (experts are split over peers
in contiguous blocks, as the ``experts`` axis of the stacked kernels is). Within a
destination, assignments keep token order for capacity (earlier tokens win, as in
GShard); the kept ones are laid out sorted by expert, so each peer receives, per source,
its experts' rows contiguous and in expert order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.models._moe_matmul import expert_of_rows as expert_of_rows
from jaxpar.models._moe_matmul import grouped_matmul, masked_matmul


@dataclasses.dataclass(frozen=True)
class SendPlan:
    """Where each of a device's A assignments goes.

    Attributes:
        token_A: the token of each assignment (``a // top_k``).
        rank_A: position of each kept assignment in the expert-sorted order of the kept
            assignments (dropped ones follow the kept, in token order).
        slot_A: its row in the peer-padded send buffer ``[P * C]`` (``P * C`` if dropped).
        kept_A: whether it fits its destination's capacity.
        counts_PE: kept assignments per (destination peer, its local expert) ``[P, E_l]``.
        offsets_P: first row of each destination in the expert-sorted compact order.
    """

    token_A: jax.Array
    rank_A: jax.Array
    slot_A: jax.Array
    kept_A: jax.Array
    counts_PE: jax.Array
    offsets_P: jax.Array

    @property
    def sizes_P(self) -> jax.Array:
        """Kept rows per destination peer."""
        return jnp.sum(self.counts_PE, axis=1)

    @property
    def dropped(self) -> jax.Array:
        """Assignments dropped for capacity (int32 scalar)."""
        return jnp.sum(~self.kept_A, dtype=jnp.int32)


def _inverse(order: jax.Array) -> jax.Array:
    """The inverse permutation: ``rank[order[i]] = i``."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def send_plan(experts_nk: jax.Array, n_experts: int, peers: int, capacity: int) -> SendPlan:
    """Plans this device's dispatch: capacity ``capacity`` rows per destination peer.

    Args:
        experts_nk: each token's chosen experts, int32 (distinct per token).
        n_experts: E.
        peers: P, the expert-parallel degree (1: every expert is local).
        capacity: C; ``dropless_capacity`` keeps every assignment.
    """
    n, k = experts_nk.shape
    per_peer = n_experts // peers
    expert_A = experts_nk.reshape(n * k).astype(jnp.int32)
    token_A = jnp.arange(n * k, dtype=jnp.int32) // k
    dest_A = expert_A // per_peer
    # Rank within the destination in token order (argsort is stable): capacity priority.
    by_dest = _inverse(jnp.argsort(dest_A))
    dest_start_P = _exclusive_cumsum(jnp.bincount(dest_A, length=peers).astype(jnp.int32))
    kept_A = by_dest - dest_start_P[dest_A] < capacity
    # Kept assignments sorted by expert (token order within one), dropped ones last.
    rank_A = _inverse(jnp.argsort(jnp.where(kept_A, expert_A, n_experts)))
    counts_E = jnp.bincount(jnp.where(kept_A, expert_A, n_experts), length=n_experts + 1)
    counts_PE = counts_E[:n_experts].astype(jnp.int32).reshape(peers, per_peer)
    offsets_P = _exclusive_cumsum(jnp.sum(counts_PE, axis=1))
    slot_A = jnp.where(kept_A, dest_A * capacity + rank_A - offsets_P[dest_A], peers * capacity)
    return SendPlan(token_A, rank_A, slot_A, kept_A, counts_PE, offsets_P)


def dropless_capacity(tokens: int, top_k: int, n_experts: int, peers: int) -> int:
    """Rows per peer that can never overflow: each token sends at most ``min(k, E_l)``."""
    return tokens * min(top_k, n_experts // peers)


def capacity_rows(tokens: int, top_k: int, n_experts: int, peers: int, factor: float | None) -> int:
    """C, rows per destination peer: ``ceil(factor * n * k / P)`` capped at dropless.

    ``factor=None`` is dropless. The buffer a device sends is ``P * C`` rows, so with a
    factor the dispatch moves ``factor`` times the routed rows (plus rounding up).
    """
    cap = dropless_capacity(tokens, top_k, n_experts, peers)
    if factor is None:
        return cap
    return max(1, min(cap, math.ceil(factor * tokens * top_k / peers)))


def pack_rows(x_nD: jax.Array, plan: SendPlan, rows: int) -> jax.Array:
    """The peer-padded send buffer ``[rows, D]``: assignment a's token row at its slot."""
    buf = jnp.zeros((rows, x_nD.shape[-1]), x_nD.dtype)
    return buf.at[plan.slot_A].set(x_nD[plan.token_A], mode="drop")


def sorted_rows(x_nD: jax.Array, plan: SendPlan) -> jax.Array:
    """The compact send buffer ``[A, D]``: kept rows in expert order, then zeros."""
    rows = jnp.where(plan.kept_A[:, None], x_nD[plan.token_A], 0)
    return jnp.zeros_like(rows).at[plan.rank_A].set(rows)


def combine(y_rows: jax.Array, index_A: jax.Array, weights_nk: jax.Array, plan: SendPlan):
    """Each token's weighted sum of its kept assignments' expert outputs, ``[n, D]``.

    ``y_rows[index_A[a]]`` is assignment a's expert output (an index past the end reads
    zeros); dropped assignments add nothing (their weight is not renormalised).
    """
    n, _ = weights_nk.shape
    y_AD = y_rows.at[index_A].get(mode="fill", fill_value=0)
    w_A = jnp.where(plan.kept_A, weights_nk.reshape(-1), 0).astype(y_rows.dtype)
    out = jnp.zeros((n, y_rows.shape[-1]), y_rows.dtype)
    return out.at[plan.token_A].add(y_AD * w_A[:, None])


@dataclasses.dataclass(frozen=True)
class ReceivePlan:
    """How a device runs the rows it received, ``[R = P * C]`` from P sources.

    Attributes:
        order_R: received rows sorted by local expert, invalid (padding) rows last.
        group_sizes_E: rows per local expert (sums to the valid rows).
    """

    order_R: jax.Array
    group_sizes_E: jax.Array


def receive_plan(counts_PE: jax.Array, capacity: int) -> ReceivePlan:
    """The grouping of received rows, from the per-(source, local expert) counts.

    Source s's block holds its rows for local expert 0, then 1, ... from row ``s * C``.
    """
    ends_PE = jnp.cumsum(counts_PE, axis=1)
    c = jnp.arange(capacity, dtype=jnp.int32)
    expert_PC = jnp.sum(c[None, :, None] >= ends_PE[:, None, :], axis=-1)  # E_l = padding
    order = jnp.argsort(expert_PC.reshape(-1))
    return ReceivePlan(order.astype(jnp.int32), jnp.sum(counts_PE, axis=0).astype(jnp.int32))


Glu = Callable[[jax.Array, jax.Array], jax.Array]


def silu_glu(gate_xF: jax.Array, up_xF: jax.Array) -> jax.Array:
    """SwiGLU's gating: ``silu(gate) * up``."""
    return jax.nn.silu(gate_xF) * up_xF


def clamped_glu(gate_xF: jax.Array, up_xF: jax.Array, *, limit: float, alpha: float) -> jax.Array:
    """GPT-OSS's clamped SwiGLU: ``(clip(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, l)`` (Hugging Face's ``GptOssExperts._apply_gate``)."""
    gate_xF = jnp.minimum(gate_xF, limit)
    up_xF = jnp.clip(up_xF, -limit, limit)
    return (up_xF + 1) * (gate_xF * jax.nn.sigmoid(gate_xF * alpha))


#: (gate, up, down) scales of quantized expert kernels ``[E, g, F]``, ``[E, g, D]``.
Scales = tuple[jax.Array, jax.Array, jax.Array]


def grouped_swiglu(
    x_RD: jax.Array,
    group_sizes_E: jax.Array,
    gate_EDF: jax.Array,
    up_EDF: jax.Array,
    down_EFD: jax.Array,
    gate_bias_RF: jax.Array | None = None,
    up_bias_RF: jax.Array | None = None,
    glu: Glu = silu_glu,
    scales: Scales | None = None,
) -> jax.Array:
    """SwiGLU experts on expert-sorted rows: ``ragged_dot`` per group, rows past the groups 0.

    FLOPs and weight reads follow the rows of each group (the grouped matmul); with the
    intermediate split over tensor parallelism the result is a partial sum. GPT-OSS: each
    row's expert's gate and up biases (``*_bias_RF``, gathered per row) and its ``glu``.
    Quantized kernels come with their ``scales`` (:mod:`jaxpar.models._moe_matmul`).
    """
    gate_s, up_s, down_s = scales or (None, None, None)
    gate_RF = grouped_matmul(x_RD, gate_EDF, group_sizes_E, gate_s)
    up_RF = grouped_matmul(x_RD, up_EDF, group_sizes_E, up_s)
    if gate_bias_RF is not None:
        gate_RF, up_RF = gate_RF + gate_bias_RF, up_RF + up_bias_RF
    h_RF = glu(gate_RF, up_RF).astype(x_RD.dtype)
    return grouped_matmul(h_RF, down_EFD, group_sizes_E, down_s)


def masked_swiglu(
    x_RD: jax.Array,
    group_sizes_E: jax.Array,
    gate_EDF: jax.Array,
    up_EDF: jax.Array,
    down_EFD: jax.Array,
    gate_bias_RF: jax.Array | None = None,
    up_bias_RF: jax.Array | None = None,
    glu: Glu = silu_glu,
    scales: Scales | None = None,
) -> jax.Array:
    """:func:`grouped_swiglu` as batched matmuls over the local experts, rows masked per group.

    E_l times the FLOPs of the routed rows, as XLA:CPU's own lowering of ``ragged_dot``;
    but the expert kernels are read where they lie: that lowering copies every expert
    kernel into a ``[E_l x D, F]`` operand on each call (measured: decode temporary memory
    growing by the layer's expert weights per layer).
    """
    gate_s, up_s, down_s = scales or (None, None, None)
    ends_E = jnp.cumsum(group_sizes_E)
    r = jnp.arange(x_RD.shape[0])
    mask_ER = (r[None, :] >= (ends_E - group_sizes_E)[:, None]) & (r[None, :] < ends_E[:, None])
    x_ERD = jnp.where(mask_ER[..., None], x_RD[None], 0).astype(x_RD.dtype)
    gate_ERF = masked_matmul(x_ERD, gate_EDF, gate_s)
    up_ERF = masked_matmul(x_ERD, up_EDF, up_s)
    if gate_bias_RF is not None:
        gate_ERF, up_ERF = gate_ERF + gate_bias_RF[None], up_ERF + up_bias_RF[None]
    h_ERF = glu(gate_ERF, up_ERF).astype(x_RD.dtype)
    if gate_bias_RF is not None:  # a masked row's biases alone would not give zeros
        h_ERF = jnp.where(mask_ER[..., None], h_ERF, 0)
    if down_s is None:
        return jnp.einsum("ERF,EFD->RD", h_ERF, down_EFD.astype(x_RD.dtype))
    # Each expert's output scaled before the sum over experts (masked rows add zeros).
    return jnp.sum(masked_matmul(h_ERF, down_EFD, down_s), axis=0)
