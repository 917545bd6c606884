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
import sys
import warnings
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from jaxpar.errors import ConfigError
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


def _caller_is_jaxpar() -> bool:
    """Whether :func:`constrain` was called from a jaxpar module (two frames up)."""
    return sys._getframe(2).f_globals.get("__name__", "").startswith("jaxpar.")
