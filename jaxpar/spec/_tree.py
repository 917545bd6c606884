"""Whole pytrees placed by logical axis names: a user's parameters, caches or batches.

The rules of :mod:`jaxpar.spec._rules` name one ``PartitionSpec`` per tensor; a model has
trees of them. Here a tree of logical axes (one tuple of names per array, or a
``PartitionSpec`` of names, as Flax's ``nnx.get_partition_spec`` returns) becomes a tree of
``NamedSharding``\\ s, and an array tree is put on the mesh by it. Flax is not imported:
any pytree whose leaves line up with the axes tree works.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.errors import ConfigError
from jaxpar.spec._config import ParallelConfig
from jaxpar.spec._dims import ModelDims
from jaxpar.spec._enums import Module, Phase
from jaxpar.spec._rules import param_partition_spec, partition_spec
from jaxpar.spec._tables import SpecTable


def _is_axes(x: Any) -> bool:
    """A leaf of an axes tree: a ``PartitionSpec`` or a tuple of names (or ``None``s)."""
    if isinstance(x, PartitionSpec):
        return True
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def _names(axes: Any, where: str) -> Sequence[str | None]:
    if not _is_axes(axes):
        raise ConfigError(
            f"logical axes at {where} are {axes!r}: each array needs a tuple of logical axis "
            "names (or None for a dimension that is not split), e.g. ('embed', 'mlp'), or a "
            "PartitionSpec of such names"
        )
    for name in axes:
        if isinstance(name, tuple):
            raise ConfigError(
                f"logical axes at {where} are {axes!r}: one name per dimension; a dimension "
                "split over several mesh axes gets them from the rules, not from the tree"
            )
    return tuple(axes)


def tree_shardings(
    logical_axes: Any,
    mesh: Mesh,
    config: ParallelConfig,
    *,
    phase: Phase | str | None = None,
    module: Module | str | None = None,
    dims: ModelDims | None = None,
    table: SpecTable | None = None,
) -> Any:
    """The ``NamedSharding`` of every array named in a tree of logical axes.

    With ``phase=None`` the arrays are parameters: each gets
    :func:`~jaxpar.spec.param_partition_spec`, the one layout both phases share, so weights
    are placed once and never move. With ``phase`` (``"prefill"`` or ``"decode"``) and
    ``module`` they are activations or a cache of that module in that phase, each getting
    :func:`~jaxpar.spec.partition_spec`: a KV cache's sequence split over ``sp`` in prefill
    and its batch carried by ``sp`` in decode, for instance. The result has the structure
    of ``logical_axes``; pass it as ``jax.jit``'s ``in_shardings`` / ``out_shardings`` (for
    instance to initialise a model already sharded) or to ``jax.device_put``.

    Args:
        logical_axes: A pytree whose leaves are tuples of logical axis names (``None`` for
            a dimension that stays whole) or ``PartitionSpec``\\ s of such names.
        mesh: The mesh to place on (:func:`~jaxpar.spec.make_mesh`).
        config: The degrees the mesh was made for.
        phase: ``None`` for parameters, else the phase the arrays are used in.
        module: The module whose rows apply, required with ``phase``.
        dims: The model's sizes (any :class:`~jaxpar.spec.ModelDims`), needed wherever
            ``kv_heads`` meets tp > 1 and for a model with rows of its own (MLA).
        table: The legality tables; default the shipped ones.

    Raises:
        ConfigError: a leaf that is not a tuple of names, ``phase`` without ``module`` or
            ``module`` without ``phase``, or ``kv_heads`` under tp > 1 without ``dims``.
        IllegalStrategyError: two dimensions of one array that need the same mesh axis.
        JaxparError: an unknown logical axis name, phase or module.
    """
    if (phase is None) != (module is None):
        raise ConfigError(
            f"tree_shardings got phase={phase!r} and module={module!r}: give both to place "
            "activations or caches of a module in a phase, or neither to place parameters "
            "(one layout for both phases)"
        )

    def one(path: Any, axes: Any) -> NamedSharding:
        names = _names(axes, jax.tree_util.keystr(path) or "the root")
        if phase is None:
            spec = param_partition_spec(names, config, dims=dims, table=table)
        else:
            spec = partition_spec(names, module, phase, config, dims=dims, table=table)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, logical_axes, is_leaf=_is_axes)


def shard_tree(
    tree: Any,
    logical_axes: Any,
    mesh: Mesh,
    config: ParallelConfig,
    *,
    phase: Phase | str | None = None,
    module: Module | str | None = None,
    dims: ModelDims | None = None,
    table: SpecTable | None = None,
) -> Any:
    """Puts every array of ``tree`` on ``mesh`` as its logical axes say.

    ``logical_axes`` has ``tree``'s structure down to its arrays, with a tuple of logical
    axis names in place of each (a Flax NNX model's ``nnx.get_partition_spec(state)`` of
    the same state is such a tree). ``phase=None`` places parameters, the layout shared by
    prefill and decode; ``phase`` and ``module`` place activations or caches for that phase
    (:func:`tree_shardings` says more). Returns a tree of ``tree``'s structure whose arrays
    are sharded; each device receives only its slices.

    Example::

        params = {"w_in": jnp.ones((64, 256)), "w_out": jnp.ones((256, 64))}
        axes = {"w_in": ("embed", "mlp"), "w_out": ("mlp", "embed")}
        placed = shard_tree(params, axes, mesh, ParallelConfig(dp=2, tp=4))
        placed["w_in"].sharding.spec  # P(None, 'tp')

    Raises:
        ConfigError, IllegalStrategyError, JaxparError: as :func:`tree_shardings`.
        ConfigError: also when ``tree`` and ``logical_axes`` differ in structure.
    """
    shardings = tree_shardings(
        logical_axes, mesh, config, phase=phase, module=module, dims=dims, table=table
    )
    treedef = jax.tree_util.tree_structure(shardings)
    try:
        treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"shard_tree: the tree of arrays and the tree of logical axes differ in structure "
            f"({e}); give one tuple of axis names per array, in the same containers"
        ) from None
    return jax.device_put(tree, shardings)
