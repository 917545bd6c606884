"""Activation constraints by logical axis name.

Model code calls :func:`constrain` with logical names only. Outside a
:func:`sharding_context` it is the identity (single device, or a user's own placement), and
says so (a warning, or an error with ``required=True``) unless jaxpar's own models call it;
inside one, the engine's phase and parallel config turn the names into a
``PartitionSpec`` through the spec layer's rules, and XLA inserts the collectives.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxpar.errors import ConfigError
from jaxpar.spec._config import ParallelConfig
from jaxpar.spec._dims import ModelDims
from jaxpar.spec._enums import Module, Phase
from jaxpar.spec._rules import partition_spec


@dataclasses.dataclass(frozen=True)
class _Active:
    mesh: Mesh | AbstractMesh
    phase: Phase
    config: ParallelConfig
    dims: ModelDims | None
    platform: str


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar(
    "jaxpar_sharding_context", default=None
)


@contextlib.contextmanager
def sharding_context(
    mesh: Mesh | AbstractMesh,
    phase: Phase | str,
    config: ParallelConfig,
    dims: ModelDims | None = None,
    *,
    platform: str | None = None,
) -> Iterator[None]:
    """Makes :func:`constrain` resolve logical names for ``phase`` on ``mesh``.

    Used around the body of a function while ``jax.jit`` traces it.

    Args:
        mesh: The mesh the traced program runs on (inside a ``shard_map``, the abstract
            mesh it sees).
        phase, config, dims: The phase, the degrees and the model sizes the rules read.
        platform: What the program is compiled for (``"cpu"``, ``"gpu"``/``"cuda"``,
            ``"tpu"``); kernels are chosen for it. Default: the mesh's devices' platform,
            which a compile-only TPU topology reports as ``"tpu"``. Name it to lower for a
            platform whose devices this process does not have.
    """
    platform = platform or mesh_platform(mesh)
    token = _ACTIVE.set(_Active(mesh, Phase.coerce(phase), config, dims, platform))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def mesh_platform(mesh: Mesh | AbstractMesh) -> str:
    """The platform of a concrete mesh's devices; an abstract mesh has none, so the
    default backend's (a pipeline stage's context names its outer mesh's platform)."""
    if isinstance(mesh, Mesh):
        return mesh.devices.flat[0].platform
    return jax.default_backend()


def active_phase() -> Phase | None:
    """The phase of the enclosing :func:`sharding_context`, or None outside one."""
    active = _ACTIVE.get()
    return None if active is None else active.phase


def active_mesh() -> Mesh | AbstractMesh | None:
    """The mesh of the enclosing :func:`sharding_context`, or None outside one."""
    active = _ACTIVE.get()
    return None if active is None else active.mesh


def active_platform() -> str:
    """The platform the enclosing :func:`sharding_context` compiles for; outside one, the
    default backend (a single-device program runs there)."""
    active = _ACTIVE.get()
    return jax.default_backend() if active is None else active.platform


def constrain(
    x: jax.Array,
    logical_axes: Sequence[str | None],
    module: Module | str,
    *,
    required: bool | None = None,
) -> jax.Array:
    """Constrains ``x`` to the sharding its logical axes have in ``module`` this phase.

    ``None`` in ``logical_axes`` leaves that dimension replicated. It only acts inside a
    :func:`sharding_context` (which says the mesh, phase and degrees); outside one it
    returns ``x`` unchanged, and then:

    * ``required=True`` raises :class:`ConfigError` (code that must be sharded);
    * ``required=False`` stays silent (code that also runs on one device);
    * ``required=None`` (default) warns once per call site, unless the caller is jaxpar's
      own model code, whose single-device use is deliberate.
    """
    active = _ACTIVE.get()
    if active is None:
        if required or (required is None and not _caller_is_jaxpar()):
            message = (
                f"constrain(x, {tuple(logical_axes)}, {str(module)!r}) outside a "
                "sharding_context does nothing; trace the function inside `with "
                "jaxpar.spec.sharding_context(mesh, phase, parallel_config):` for it to "
                "constrain (pass required=False where no sharding is intended)"
            )
            if required:
                raise ConfigError(message)
            warnings.warn(message, UserWarning, stacklevel=2)
        return x
    if len(logical_axes) != x.ndim:
        raise ValueError(f"constrain: {len(logical_axes)} logical axes for a rank-{x.ndim} array")
    spec = partition_spec(logical_axes, module, active.phase, active.config, dims=active.dims)
    return jax.lax.with_sharding_constraint(x, NamedSharding(active.mesh, spec))


def active_mesh_axes(logical_name: str, module: Module | str) -> tuple[str, ...]:
    """The mesh axes that split ``logical_name`` in ``module`` in the active context.

    For collectives inside a :func:`logical_shard_map` body (e.g. an all-to-all over the
    axes that hold ``"experts"``): model code passes the result through as ``axis_name``
    without naming a mesh axis itself. Empty outside a :func:`sharding_context`, and for
    a name no axis of degree > 1 splits.
    """
    active = _ACTIVE.get()
    if active is None:
        return ()
    spec = partition_spec((logical_name,), module, active.phase, active.config, dims=active.dims)
    entry = spec[0] if len(spec) else None
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def active_degree(logical_name: str, module: Module | str) -> int:
    """How many ways ``logical_name`` is split in ``module`` in the active context: the
    product of the degrees of :func:`active_mesh_axes`; 1 outside a context."""
    active = _ACTIVE.get()
    if active is None:
        return 1
    axes = active_mesh_axes(logical_name, module)
    return math.prod(active.config.degree(a) for a in axes)


def logical_shard_map(
    fn: Callable,
    in_axes: Sequence[Sequence[str | None] | None],
    out_axes: Sequence[str | None] | None | tuple[Sequence[str | None] | None, ...],
    module: Module | str,
    *,
    multiple_outputs: bool = False,
) -> Callable:
    """``fn`` run once per shard, with in/out specs named by logical axes.

    For ops XLA cannot partition (Pallas kernels, cuDNN custom calls): inside a
    :func:`sharding_context` each input is split as its logical axes are split in ``module``
    this phase, ``fn`` sees the local shards, and its output is assembled from
    ``out_axes``. Every mesh axis that is not manual already becomes manual: a Mosaic
    (TPU) kernel refuses to run under any automatic axis ("cannot be automatically
    partitioned") and cuDNN's custom partitioning asserts on partly manual shardings. An
    axis no spec mentions is replicated: ``fn`` runs on the whole of that dimension on
    every device of it. Inside the pipeline's ``pp``-manual ``shard_map`` the context mesh
    is the abstract one it sees, and ``pp`` stays as it is. Outside a context, or on a
    one-device mesh, ``fn`` is called on the whole arrays, so ``fn`` must work on any
    consistent slice of its inputs.

    Args:
        fn: The per-shard function, positional array arguments only, one array out.
        in_axes: Per argument, its logical axis names (``None`` entries replicate that
            dimension); ``None`` for the whole argument means replicated.
        out_axes: Logical axis names of the output (``None``: replicated); with
            ``multiple_outputs``, a tuple of those, one per output of ``fn``.
        module: The module whose sharding rules apply, e.g. ``"attention"``.
        multiple_outputs: ``fn`` returns a tuple of arrays.

    Returns:
        A function with ``fn``'s signature.
    """
    active = _ACTIVE.get()
    if active is None:
        return fn

    mesh = active.mesh
    already = frozenset(mesh.manual_axes)

    def local(entry):
        # An axis manual already (a pipeline stage's ``pp``) is split outside: the array
        # here is its local block, whole along that axis.
        names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n)
        kept = tuple(n for n in names if n not in already)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    def spec(axes: Sequence[str | None] | None) -> PartitionSpec:
        if axes is None:
            return PartitionSpec()
        full = partition_spec(axes, module, active.phase, active.config, dims=active.dims)
        return PartitionSpec(*(local(e) for e in full)) if already else full

    in_specs = tuple(spec(axes) for axes in in_axes)
    out_spec = tuple(spec(a) for a in out_axes) if multiple_outputs else spec(out_axes)
    manual = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    if not manual or mesh.size == 1:
        return fn  # nothing to partition
    _check_nesting_order(mesh, manual)
    # check_vma=False: Pallas and cuDNN calls carry no replication rules; the specs above
    # say exactly how each output varies.
    mapped = jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_spec,
        axis_names=manual,
        check_vma=False,
    )
    if not already:
        return mapped

    def run(*args):
        # Outputs vary over the outer manual axes as the inputs do (a stage's results
        # differ per stage); the unchecked map above types them as not varying.
        varying = set()
        for x in jax.tree.leaves(args):
            varying |= set(jax.typeof(x).manual_axis_type.varying) & already
        out = mapped(*args)
        if not varying:
            return out
        names = tuple(sorted(varying))
        return jax.tree.map(lambda y: jax.lax.pcast(y, names, to="varying"), out)

    return run


# From this release on, XLA requires a sharding's manual axes sorted by mesh index and
# aborts the process otherwise (a CHECK, no Python exception).
_SORTED_MANUAL_AXES = (0, 11, 2)


def _check_nesting_order(mesh: Mesh | AbstractMesh, new_manual: frozenset[str]) -> None:
    """Refuses, before tracing, a ``shard_map`` that would make an axis manual inside one
    manual over a later mesh axis (e.g. ``dp`` inside ``pp`` on a mesh naming ``dp``
    first): under jax >= 0.11.2 XLA aborts the whole process on it."""
    if _jax_version() < _SORTED_MANUAL_AXES or not mesh.manual_axes:
        return
    names = list(mesh.axis_names)
    last_manual = max(names.index(a) for a in mesh.manual_axes)
    early = [a for a in names[:last_manual] if a in new_manual and mesh.shape[a] > 1]
    if early:
        raise ConfigError(
            f"logical_shard_map: mesh axes {early} would become manual inside a shard_map "
            f"manual over {list(mesh.manual_axes)}, which the mesh {names} orders after them; "
            f"jax {jax.__version__} aborts on that nesting. Name the axes with the outer "
            "manual ones first (jaxpar.spec.make_mesh and canonical_mesh put pp first)"
        )


def _jax_version() -> tuple[int, ...]:
    return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def _caller_is_jaxpar() -> bool:
    """Whether :func:`constrain` was called from a jaxpar module (two frames up)."""
    return sys._getframe(2).f_globals.get("__name__", "").startswith("jaxpar.")
