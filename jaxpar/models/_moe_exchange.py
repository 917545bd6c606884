"""MoE dispatch and combine between expert-parallel peers (inside the MoE ``shard_map``).

Two exchanges, the same layout on the receiver: ``[P * C, D]`` rows, source s's rows from
row ``s * C``, its rows for local expert 0 first, then 1, ..., padding after them.

* **padded** (every backend): each device sends P blocks of C rows with ``all_to_all``;
  C is the capacity (or the dropless bound), so padding travels too.
* **ragged** (where XLA implements ``ragged-all-to-all``: GPU, TPU): each device sends
  exactly its routed rows to each peer with ``ragged_all_to_all``; only the receive
  buffer is padded. Dropless.

Both exchange the per-(destination, local expert) row counts first (``E`` int32s): the
receiver groups its rows by expert from them. ``axes`` are the mesh axes holding the
experts (from the spec layer); with none (one peer) nothing moves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.models._moe_route import SendPlan

Axes = tuple[str, ...]


def _a2a(x: jax.Array, axes: Axes) -> jax.Array:
    """Block p of axis 0 goes to peer p; block s of the result came from peer s."""
    return jax.lax.all_to_all(x, axes, 0, 0) if axes else x


def exchange_counts(plan: SendPlan, axes: Axes) -> tuple[jax.Array, jax.Array]:
    """``(counts [P, E_l], offsets [P])`` as received: source s's rows per local expert,
    and where they started in s's compact send buffer (the ragged combine writes there)."""
    both = jnp.concatenate([plan.counts_PE, plan.offsets_P[:, None]], axis=1)
    got = _a2a(both, axes)
    return got[:, :-1], got[:, -1]


def padded_dispatch(rows_RD: jax.Array, peers: int, axes: Axes) -> jax.Array:
    """Sends block p of the peer-padded buffer ``[P * C, D]`` to peer p."""
    r, d = rows_RD.shape
    return _a2a(rows_RD.reshape(peers, r // peers, d), axes).reshape(r, d)


def padded_combine(y_RD: jax.Array, peers: int, axes: Axes) -> jax.Array:
    """Returns each source's block (the inverse of :func:`padded_dispatch`)."""
    return padded_dispatch(y_RD, peers, axes)


def ragged_dispatch(
    rows_AD: jax.Array, plan: SendPlan, recv_counts_PE: jax.Array, capacity: int, axes: Axes
) -> jax.Array:
    """Sends the compact expert-sorted rows, only the routed ones, into peer-padded blocks.

    Args:
        rows_AD: kept rows in expert order (:func:`~jaxpar.models._moe_route.sorted_rows`).
        plan: this device's send plan (offsets and sizes per destination).
        recv_counts_PE: :func:`exchange_counts`' counts.
        capacity: C, the rows reserved per source on the receiver.
        axes: the expert mesh axes.
    """
    peers = recv_counts_PE.shape[0]
    out = jnp.zeros((peers * capacity, rows_AD.shape[-1]), rows_AD.dtype)
    if not axes:
        return _local_copy(rows_AD, out, plan.sizes_P[0])
    me = jax.lax.axis_index(axes)
    return jax.lax.ragged_all_to_all(
        rows_AD,
        out,
        plan.offsets_P,
        plan.sizes_P,
        jnp.full((peers,), me * capacity, jnp.int32),
        jnp.sum(recv_counts_PE, axis=1),
        axis_name=axes,
    )


def ragged_combine(
    y_RD: jax.Array,
    plan: SendPlan,
    recv_counts_PE: jax.Array,
    recv_offsets_P: jax.Array,
    n_rows: int,
    axes: Axes,
) -> jax.Array:
    """Sends each source its rows' expert outputs back, to where they left its buffer."""
    peers = recv_counts_PE.shape[0]
    capacity = y_RD.shape[0] // peers
    out = jnp.zeros((n_rows, y_RD.shape[-1]), y_RD.dtype)
    if not axes:
        return _local_copy(y_RD, out, plan.sizes_P[0])
    return jax.lax.ragged_all_to_all(
        y_RD,
        out,
        jnp.arange(peers, dtype=jnp.int32) * capacity,
        jnp.sum(recv_counts_PE, axis=1),
        recv_offsets_P,
        plan.sizes_P,
        axis_name=axes,
    )


def _local_copy(src: jax.Array, out: jax.Array, rows: jax.Array) -> jax.Array:
    """One peer: the first ``rows`` rows of ``src`` at the top of ``out``."""
    n = min(src.shape[0], out.shape[0])
    keep = (jnp.arange(n) < rows)[:, None]
    return out.at[:n].set(jnp.where(keep, src[:n], 0))
