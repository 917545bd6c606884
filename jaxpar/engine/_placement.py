"""Shardings of parameters, caches and step inputs, from logical names via the spec layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.errors import ConfigError
from jaxpar.spec import (
    ModelDims,
    Module,
    ParallelConfig,
    Phase,
    param_partition_spec,
    partition_spec,
)


def logical_axes_of(state: nnx.State) -> Any:
    """The logical axis names of every parameter leaf (a pytree of tuples, like ``state``).

    Raises:
        ConfigError: a parameter without names, or with a rank that disagrees with them.
    """
    specs = nnx.get_partition_spec(state)

    def names(path, spec, value) -> tuple[str | None, ...]:
        where = "/".join(str(getattr(k, "key", k)) for k in path)
        if not isinstance(spec, PartitionSpec):
            raise ConfigError(f"parameter {where} carries no logical axis names")
        axes = tuple(spec)
        if len(axes) != np.ndim(value):
            raise ConfigError(
                f"parameter {where}: {len(axes)} logical names {axes} for shape {np.shape(value)}"
            )
        return axes

    values = jax.tree.map(lambda v: v, state)
    return jax.tree_util.tree_map_with_path(
        names, specs, values, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def param_shardings(state: nnx.State, mesh: Mesh, config: ParallelConfig, dims: ModelDims) -> Any:
    """One ``NamedSharding`` per parameter, the same in prefill and decode."""
    axes = logical_axes_of(state)
    return jax.tree.map(
        lambda names: NamedSharding(mesh, param_partition_spec(names, config, dims=dims)),
        axes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def sharding(
    mesh: Mesh,
    logical_axes: Sequence[str | None],
    module: Module,
    phase: Phase,
    config: ParallelConfig,
    dims: ModelDims,
) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(logical_axes, module, phase, config, dims=dims))


def put_global(value: np.ndarray, target: NamedSharding) -> jax.Array:
    """A host array (identical on every process) placed as one global array.

    Each process only materialises the shards of its own devices, so this works the same
    on one host and after ``jax.distributed.initialize`` on many. The value is copied
    first: on CPU a device buffer may alias the host array it came from (zero-copy), and
    callers reuse theirs (a release mask, block tables) while the step that reads it may
    still be queued.
    """
    value = np.array(value, copy=True)
    # dtype: a process with no device in ``target`` (a group on other processes) makes
    # no shard to read it from.
    return jax.make_array_from_callback(
        value.shape, target, lambda index: value[index], dtype=value.dtype
    )


def place(value: Any, target: NamedSharding) -> jax.Array:
    """A parameter (host array or ``jax.Array``) placed in ``target``.

    Arrays already spread over other processes' devices are resharded by ``device_put``.
    Host arrays, and process-local arrays whose target spans other processes, go through
    :func:`put_global`: ``device_put`` would check with one cross-process collective per
    array that every process holds the same value (uncommitted arrays, e.g. fresh from
    ``init_params``) or refuse outright (committed ones).
    """
    if isinstance(value, jax.Array) and (
        target.is_fully_addressable or not value.is_fully_addressable
    ):
        return jax.device_put(value, target)
    return put_global(np.asarray(value), target)


def to_host(value: jax.Array) -> np.ndarray:
    """The whole of a global array as a host array, on every process.

    An array with shards on other processes' devices is gathered first (a collective, so
    every process must call this in the same order, as the engine's loops do).
    """
    if value.is_fully_addressable or value.is_fully_replicated:
        return np.asarray(jax.device_get(value))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
