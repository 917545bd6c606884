"""Activation constraints by logical axis name.

Model code calls :func:`constrain` with logical names only. Outside a
:func:`sharding_context` it is the identity (single device, or a user's own placement);
inside one, the engine's phase and parallel config turn the names into a
``PartitionSpec`` through the spec layer's rules, and XLA inserts the collectives.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from jaxpar.spec._config import ParallelConfig
from jaxpar.spec._dims import ModelDims
from jaxpar.spec._enums import Module, Phase
from jaxpar.spec._rules import partition_spec


@dataclasses.dataclass(frozen=True)
class _Active:
    mesh: Mesh
    phase: Phase
    config: ParallelConfig
    dims: ModelDims | None


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar(
    "jaxpar_sharding_context", default=None
)


@contextlib.contextmanager
def sharding_context(
    mesh: Mesh,
    phase: Phase | str,
    config: ParallelConfig,
    dims: ModelDims | None = None,
) -> Iterator[None]:
    """Makes :func:`constrain` resolve logical names for ``phase`` on ``mesh``.

    Used around the body of a function while ``jax.jit`` traces it.
    """
    token = _ACTIVE.set(_Active(mesh, Phase.coerce(phase), config, dims))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_phase() -> Phase | None:
    """The phase of the enclosing :func:`sharding_context`, or None outside one."""
    active = _ACTIVE.get()
    return None if active is None else active.phase


def constrain(x: jax.Array, logical_axes: Sequence[str | None], module: Module | str) -> jax.Array:
    """Constrains ``x`` to the sharding its logical axes have in ``module`` this phase.

    ``None`` in ``logical_axes`` leaves that dimension replicated.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    if len(logical_axes) != x.ndim:
        raise ValueError(f"constrain: {len(logical_axes)} logical axes for a rank-{x.ndim} array")
    spec = partition_spec(logical_axes, module, active.phase, active.config, dims=active.dims)
    return jax.lax.with_sharding_constraint(x, NamedSharding(active.mesh, spec))
