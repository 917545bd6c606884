"""The five-axis device mesh."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from jaxpar.errors import MeshError
from jaxpar.spec._config import ParallelConfig
from jaxpar.spec._enums import MESH_AXES


def make_mesh(config: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the ``(dp, pp, sp, ep, tp)`` mesh for ``config``.

    With ``devices=None`` it spans ``jax.devices()`` — every device of every process after
    ``jax.distributed.initialize`` — and lets JAX order them for the physical topology (on
    TPU the innermost axes land on the closest chips). Works unchanged on simulated CPU
    devices and GPUs. Axes are ``Auto``: jaxpar states shardings, XLA's SPMD partitioner
    inserts the collectives.

    Raises:
        MeshError: the degrees do not multiply to the number of devices.
    """
    available = list(jax.devices()) if devices is None else list(devices)
    if config.size != len(available):
        raise MeshError(
            f"[devices-product] strategy {config} needs {config.size} devices "
            f"(dp*pp*sp*ep*tp = {' * '.join(map(str, config.shape))}) but {len(available)} are "
            f"available; choose degrees whose product is {len(available)}"
        )
    try:
        return jax.make_mesh(
            config.shape,
            MESH_AXES,
            axis_types=(AxisType.Auto,) * len(MESH_AXES),
            devices=available,
        )
    except (ValueError, NotImplementedError) as e:
        raise MeshError(f"cannot lay out {config} over {len(available)} devices: {e}") from e
