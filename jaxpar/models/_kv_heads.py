"""Expanding a checkpoint's KV heads into a run's KV-head replicas (rule kv-head-replicas).

A run with ``kv_head_replicas = r`` (:class:`~jaxpar.models.ModelRun`, chosen by
:func:`jaxpar.spec.kv_head_replicas`) holds each KV head ``r`` times, adjacent: every
parameter with a ``kv_heads`` dimension (the fused K/V kernel, its bias, the scales of a
quantized kernel, in whatever storage order: the dimension is found by its logical name) is
repeated ``r`` times along it. Repeating is exact (per-output-channel scales are per head), so
the expanded run computes the same numbers as the checkpoint's heads.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KV_HEADS = "kv_heads"


def repeat_heads(value: Any, axis: int, replicas: int) -> Any:
    """``value`` with each entry of dimension ``axis`` repeated ``replicas`` times, adjacent
    (host arrays stay on the host; device arrays are repeated where they lie)."""
    if replicas == 1:
        return value
    if isinstance(value, jax.Array):
        return jnp.repeat(value, replicas, axis=axis)
    return np.repeat(np.asarray(value), replicas, axis=axis)


def repeat_kv_heads(params: Any, axes: Any, heads: int, replicas: int) -> Any:
    """``params`` (a checkpoint's ``heads`` KV heads) with every ``kv_heads`` dimension
    repeated ``replicas`` times.

    Args:
        params: the parameter pytree (host or device arrays).
        axes: its logical axis names, a pytree of tuples like ``params``.
        heads: the checkpoint's KV heads. A dimension that already holds
            ``heads * replicas`` (parameters expanded where they were loaded) is left as is.
        replicas: copies of each head.
    """
    if replicas == 1:
        return params

    def expand(value: Any, names: tuple[str | None, ...]) -> Any:
        if KV_HEADS not in names or np.shape(value)[names.index(KV_HEADS)] != heads:
            return value
        return repeat_heads(value, names.index(KV_HEADS), replicas)

    return jax.tree.map(expand, params, axes, is_leaf=lambda x: isinstance(x, tuple))


def state_axes(state: Any) -> Any:
    """The logical axis names of every leaf of a parameter state (tuples, like ``state``)."""
    from flax import nnx
    from jax.sharding import PartitionSpec

    specs = nnx.get_partition_spec(state)
    return jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
