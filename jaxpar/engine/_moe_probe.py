"""Which MoE exchange a backend runs: one probe per platform, when an engine is built.

``ExecutionOptions.moe_dispatch="auto"`` becomes ``"ragged"`` where XLA compiles
``ragged-all-to-all`` (GPU, TPU) and the MoE is dropless, ``"padded"`` otherwise (XLA:CPU
has no ragged all-to-all; a capacity factor needs fixed-size blocks anyway): this module
answers whether it compiles, :meth:`ExecutionOptions.resolve` decides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def ragged_all_to_all_compiles(device: jax.Device | str) -> bool:
    """Whether XLA for ``device``'s platform (or a platform's name) compiles a
    ``ragged_all_to_all``.

    Compiles (nothing runs) a two-row exchange over that one device, so the answer comes
    from the compiler itself rather than from a list of backends. Compile-only devices
    (a TPU topology on a CPU host) work as well as attached ones. Cached per platform and
    device kind.
    """
    if isinstance(device, str):
        device = jax.local_devices(backend=device)[0]
    key = (device.platform, device.device_kind)
    if key not in _PROBED:
        _PROBED[key] = _compiles_on(device)
    return _PROBED[key]


_PROBED: dict[tuple[str, str], bool] = {}


def _compiles_on(device: jax.Device) -> bool:
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


def _probe_device(mesh: Mesh) -> jax.Device:
    """The mesh's first device this process can compile for (in multi-process runs the
    first device of the mesh may belong to another process)."""
    here = jax.process_index()
    return next((d for d in mesh.devices.flat if d.process_index == here), mesh.devices.flat[0])


def mesh_compiles_ragged(mesh: Mesh, platform: str | None = None) -> bool:
    """Whether the mesh's backend compiles ragged-all-to-all (probed once per device kind).

    ``platform``: lowering for another platform than the mesh's (see
    ``AbstractEngine.build``), whose compiler cannot be probed here: GPU and TPU are taken
    to compile it (XLA implements it on both), anything else not.
    """
    device = _probe_device(mesh)
    if platform is None or platform == device.platform:
        return ragged_all_to_all_compiles(device)
    return platform in ("gpu", "cuda", "rocm", "tpu")
