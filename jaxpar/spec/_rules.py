"""Logical axis names -> mesh axes, per (module, phase), computed from the tables.

For a module in a phase every primitive whose status lets it split (``allowed``,
``layer_only``, and ``only_if_moe`` rows — whose ``splits`` are empty unless the module is
the MoE layer itself) contributes its mesh axis to the logical dimensions of its row's
``splits``. Axes whose primitive does not split the module's tokens then take the roles of
``rules.toml`` (in decode ``sp`` carries batch; ``ep`` carries the batch of token
activations everywhere). Axes of degree 1 are left out, so specs stay readable.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from jax.sharding import PartitionSpec

from jaxpar.errors import ConfigError, IllegalStrategyError, JaxparError
from jaxpar.spec._config import ParallelConfig
from jaxpar.spec._dims import ModelDims
from jaxpar.spec._enums import LOGICAL_AXES, MESH_AXES, Module, Phase, Primitive, Status
from jaxpar.spec._tables import SpecTable, spec_table

SPLITTING = frozenset({Status.ALLOWED, Status.LAYER_ONLY, Status.ONLY_IF_MOE})

MeshAxes = tuple[str, ...]


def _require_dims(
    logical_axes: Sequence[str | None], config: ParallelConfig, dims: ModelDims | None
) -> None:
    """``kv_heads`` under tp > 1 is split or replicated by the model's KV-head count: without
    ``dims`` there is no telling which, and a wrong guess fails later inside JAX."""
    if dims is None and config.tp > 1 and "kv_heads" in logical_axes:
        raise ConfigError(
            f"logical axes {tuple(logical_axes)} hold 'kv_heads' and tp={config.tp}: pass "
            "dims= (any object with n_kv_heads, e.g. jaxpar.Dims or your ModelConfig). KV heads "
            "split over tp when tp divides n_kv_heads; a count tp does not divide is held "
            "whole (a run with kv_head_replicas, as jaxpar's engine builds when tp is a "
            "multiple of n_kv_heads, has tp heads and splits them: rule kv-head-replicas); "
            "without the count the spec may split heads that do not divide"
        )


def _kv_heads_replicated(config: ParallelConfig, dims: ModelDims | None) -> bool:
    """Whether ``kv_heads`` drops its ``tp`` split: when ``tp`` does not divide
    ``dims.n_kv_heads``. jaxpar's engine never runs that for multi-head attention: when
    ``tp`` is a multiple of the checkpoint's heads its run repeats each head
    (:func:`~jaxpar.spec.kv_head_replicas`, rule kv-head-replicas) and ``dims`` (the run)
    then has ``tp`` heads, which split. What remains is MLA's one latent "head" (rule
    latent-cache-no-heads) and dims of a model that holds its checkpoint's heads (a user's
    own model, or a ``ModelConfig`` passed as dims), whose heads are held whole on every
    tp device; other non-divisible counts are refused by the validator."""
    return dims is not None and config.tp > 1 and dims.n_kv_heads % config.tp != 0


@functools.cache
def _resolve(
    module: Module, phase: Phase, config: ParallelConfig, kv_replicated: bool, table: SpecTable
) -> dict[str, MeshAxes]:
    axes: dict[str, list[str]] = {name: [] for name in LOGICAL_AXES}
    for primitive in Primitive:
        if config.degree(primitive) == 1:
            continue
        entry = table.entry(module, primitive)
        status = entry.status[phase]
        if status in SPLITTING:
            for name in entry.splits:
                axes[name].append(primitive.value)
        for role in table.roles:
            applies = role.when == "always" or status not in SPLITTING
            if role.axis is primitive and phase in role.phases and applies:
                axes[role.carries].append(primitive.value)
    if kv_replicated:
        axes["kv_heads"] = [a for a in axes["kv_heads"] if a != Primitive.TP.value]
    for follows in table.follows:
        if follows.module is module and phase in follows.phases:
            axes[follows.axis] = list(axes[follows.follows])
    # Token groups of an expert-sharded dispatch tensor: the batch axes that do not hold experts.
    axes["expert_batch"] += [a for a in axes["batch"] if a not in axes["experts"]]
    order = {name: i for i, name in enumerate(MESH_AXES)}
    return {name: tuple(sorted(set(v), key=order.__getitem__)) for name, v in axes.items()}


def mesh_axes(
    module: Module | str,
    phase: Phase | str,
    config: ParallelConfig,
    *,
    dims: ModelDims | None = None,
    table: SpecTable | None = None,
) -> dict[str, MeshAxes]:
    """Every logical axis name -> the mesh axes that split it, for ``module`` in ``phase``
    (the rows of ``dims``' attention variant where it has one: :meth:`SpecTable.for_model`)."""
    return _resolve(
        Module.coerce(module),
        Phase.coerce(phase),
        config,
        _kv_heads_replicated(config, dims),
        (table or spec_table()).for_model(dims),
    )


def logical_axis_rules(
    module: Module | str,
    phase: Phase | str,
    config: ParallelConfig,
    *,
    dims: ModelDims | None = None,
    table: SpecTable | None = None,
) -> list[tuple[str, str | tuple[str, ...] | None]]:
    """The rules in Flax's list-of-pairs form, e.g. ``[("heads", "tp"), ("batch", ("dp", "ep"))]``.

    Every logical name appears once; ``None`` means replicated.
    """
    resolved = mesh_axes(module, phase, config, dims=dims, table=table)
    return [(name, _entry(axes)) for name, axes in resolved.items()]


def _entry(axes: MeshAxes) -> str | tuple[str, ...] | None:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def partition_spec(
    logical_axes: Sequence[str | None],
    module: Module | str,
    phase: Phase | str,
    config: ParallelConfig,
    *,
    dims: ModelDims | None = None,
    table: SpecTable | None = None,
) -> PartitionSpec:
    """The ``PartitionSpec`` of a tensor with ``logical_axes`` in ``module`` during ``phase``.

    Example: ``partition_spec(("batch", "seq", "embed"), "attention", "prefill",
    ParallelConfig(dp=2, sp=2, tp=2))`` is ``PartitionSpec("dp", "sp", None)``.

    Raises:
        JaxparError: an unknown logical name, or two dimensions that would need one mesh axis.
        ConfigError: ``kv_heads`` under tp > 1 without ``dims`` (whether they split or are
            replicated depends on the model's KV-head count).
    """
    _require_dims(logical_axes, config, dims)
    resolved = mesh_axes(module, phase, config, dims=dims, table=table)
    used: dict[str, str] = {}
    out = []
    for name in logical_axes:
        if name is None:
            out.append(None)
            continue
        if name not in resolved:
            raise JaxparError(
                f"unknown logical axis {name!r}; legal: {sorted(resolved)} (or None for replicated)"
            )
        for axis in resolved[name]:
            if axis in used:
                raise IllegalStrategyError(
                    f"{Module.coerce(module)}/{axis}/{Phase.coerce(phase)}: logical axes "
                    f"{used[axis]!r} and {name!r} of {tuple(logical_axes)} both map to mesh axis "
                    f"{axis!r}; a tensor can be split over a mesh axis only once"
                )
            used[axis] = name
        out.append(_entry(resolved[name]))
    return PartitionSpec(*out)


_PARAM_DIMS = (
    "vocab",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "experts",
    "layers",
    "positions",
)


@functools.cache
def _param_rules(
    config: ParallelConfig, kv_replicated: bool, table: SpecTable
) -> dict[str, MeshAxes]:
    owners: dict[str, dict[MeshAxes, list[str]]] = {d: {} for d in _PARAM_DIMS}
    for module in Module:
        for phase in Phase:
            resolved = _resolve(module, phase, config, kv_replicated, table)
            for dim in _PARAM_DIMS:
                if resolved[dim]:
                    owners[dim].setdefault(resolved[dim], []).append(f"{module}/{phase}")
    rules = {}
    for dim, choices in owners.items():
        if len(choices) > 1:
            detail = "; ".join(f"{axes} in {', '.join(where)}" for axes, where in choices.items())
            raise IllegalStrategyError(
                f"parameter dim {dim!r} would be split differently by module or phase ({detail}); "
                "weights must keep one layout in both phases so they never move"
            )
        rules[dim] = next(iter(choices), ())
    return rules


def param_partition_spec(
    logical_axes: Sequence[str | None],
    config: ParallelConfig,
    *,
    dims: ModelDims | None = None,
    table: SpecTable | None = None,
) -> PartitionSpec:
    """The one ``PartitionSpec`` of a parameter, shared by prefill and decode.

    Each dimension is split as in the modules that split it (``vocab`` as in embedding and
    LM head, ``heads`` as in attention, ``mlp`` as in FFN/MoE, ``experts`` as in MoE,
    ``layers`` as in the layer stack); the tables must agree across modules and phases,
    so weights are placed once and never move between phases.
    """
    _require_dims(logical_axes, config, dims)
    table = (table or spec_table()).for_model(dims)
    rules = _param_rules(config, _kv_heads_replicated(config, dims), table)
    out = []
    for name in logical_axes:
        if name is not None and name not in rules:
            raise JaxparError(
                f"unknown parameter logical axis {name!r}; legal: {list(rules)} or None"
            )
        out.append(None if name is None else _entry(rules[name]))
    return PartitionSpec(*out)
