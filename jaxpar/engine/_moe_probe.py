"""Which MoE exchange a backend runs: one probe per platform, when an engine is built.

``moe_dispatch="auto"`` becomes ``"ragged"`` where XLA compiles ``ragged-all-to-all``
(GPU, TPU) and the MoE is dropless, ``"padded"`` otherwise (XLA:CPU has no ragged
all-to-all; a capacity factor needs fixed-size blocks anyway).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.errors import ConfigError
from jaxpar.models import ModelConfig


@functools.cache
def ragged_all_to_all_compiles(platform: str) -> bool:
    """Whether XLA on ``platform`` compiles a ``ragged_all_to_all`` (cached per platform).

    Compiles (nothing runs) a two-row exchange over one device of that platform, so the
    answer comes from the compiler itself rather than from a list of backends.
    """
    device = jax.local_devices(backend=platform)[0]  # addressable in multi-process runs too
    mesh = Mesh(np.array([device]), ("probe",))
    sharding = NamedSharding(mesh, PartitionSpec("probe"))

    def body(x, out, offsets, sizes):
        return jax.lax.ragged_all_to_all(x, out, offsets, sizes, offsets, sizes, axis_name="probe")

    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(PartitionSpec("probe"),) * 4,
            out_specs=PartitionSpec("probe"),
        )
    )
    rows = jax.ShapeDtypeStruct((2, 4), jnp.float32, sharding=sharding)
    ints = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=sharding)
    try:
        fn.lower(rows, rows, ints, ints).compile()
    except Exception:  # noqa: BLE001 - any failure to compile means: not on this backend
        return False
    return True


def resolve_moe_dispatch(config: ModelConfig, mesh: Mesh) -> ModelConfig:
    """``config`` with ``moe_dispatch="auto"`` replaced by the path this mesh runs.

    Raises:
        ConfigError: ``moe_dispatch="ragged"`` on a backend that cannot compile it.
    """
    if not config.is_moe or config.moe_dispatch == "padded":
        return config
    platform = mesh.devices.flat[0].platform
    if config.moe_dispatch == "ragged":
        if not ragged_all_to_all_compiles(platform):
            raise ConfigError(
                f"moe_dispatch='ragged': XLA:{platform} does not compile ragged-all-to-all; "
                "use moe_dispatch='padded' or 'auto'"
            )
        return config
    ragged = config.moe_capacity_factor is None and ragged_all_to_all_compiles(platform)
    return dataclasses.replace(config, moe_dispatch="ragged" if ragged else "padded")
