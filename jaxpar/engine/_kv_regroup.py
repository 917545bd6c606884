"""Disaggregated serving across two KV-head replica counts (rule kv-head-replicas).

A prefill group and a decode group with different tp may run different KV-head replicas
(prefill sp=4 holds a checkpoint's 2 heads, decode tp=4 holds each twice: 4 run heads). The
prefilled K/V then cross as the checkpoint's heads (every ``have``-th run head: the copies
are adjacent), each decode device receiving all of them, and are repeated ``want`` times
there into the decode group's prefill layout: the bytes that cross are those of the
checkpoint's heads, whatever either side's replicas.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.engine._group_transfer import Mover, device_put_all

#: The kv-head dimension of prefill K/V (``[P, T, K, H]``, stacked ``[L, P, T, K, H]``) and
#: of their scales when quantized (``[..., K, 1]``).
HEAD_AXIS = -2


def _heads_whole(sharding: NamedSharding, ndim: int) -> NamedSharding:
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    spec[ndim + HEAD_AXIS] = None
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def _repeat(x: jax.Array, sharding: NamedSharding, want: int) -> jax.Array:
    if want == 1:
        return jax.device_put(x, sharding)
    repeat = jax.jit(lambda a: jnp.repeat(a, want, axis=HEAD_AXIS), out_shardings=sharding)
    return repeat(x)


def regroup_kv(
    kv: Any, shardings: Any, have: int, want: int, move: Mover = device_put_all
) -> tuple[Any, int]:
    """``kv`` (a prefill K or V tree with ``have`` copies of each head, on the prefill
    devices) with ``want`` copies of each, placed in ``shardings`` (the decode group's
    prefill layout, a prefix of ``kv``); and the bytes that crossed. ``move`` carries the
    checkpoint's heads across (:func:`jaxpar.engine._group_transfer.move_tree` when the
    groups lie on other processes)."""
    leaves, treedef = jax.tree.flatten(kv)
    targets = jax.tree.leaves(jax.tree.broadcast(shardings, kv))
    heads = [x[..., ::have, :] if have > 1 else x for x in leaves]
    whole = [_heads_whole(s, x.ndim) for s, x in zip(targets, heads, strict=True)]
    moved = move(heads, whole)
    out = [_repeat(x, s, want) for x, s in zip(moved, targets, strict=True)]
    crossed = sum(x.size * x.dtype.itemsize for x in heads)
    return jax.tree.unflatten(treedef, out), crossed


def regrouped_shapes(kv: Any, have: int, want: int) -> Any:
    """The shapes (``ShapeDtypeStruct``, no sharding) of :func:`regroup_kv`'s result for
    K or V shaped like ``kv`` (to compile the decode group's insert ahead of time)."""

    def one(x: Any) -> jax.ShapeDtypeStruct:
        *lead, heads, width = x.shape
        return jax.ShapeDtypeStruct((*lead, heads // have * want, width), x.dtype)

    return jax.tree.map(one, kv)
