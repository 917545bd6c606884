"""The five-axis device mesh."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from jaxpar.errors import MeshError
from jaxpar.spec._config import ParallelConfig
from jaxpar.spec._enums import MESH_AXES
from jaxpar.spec._topology import is_tpu_slice, slice_order, tpu_device_array

#: The order of the mesh's axis *names*: ``pp`` first, then the others as in ``MESH_AXES``.
#: Devices keep the ``MESH_AXES`` layout (dp outermost, tp innermost): only the names are
#: permuted, with the device array transposed to match, so every axis still spans the same
#: devices. The pipeline runs its stages inside a ``shard_map`` manual over ``pp``; a
#: ``shard_map`` nested in it (the MoE layer's, manual over ``dp`` and ``ep``) then only
#: adds axes that come after ``pp``, and jax >= 0.11.2 requires a sharding's manual axes
#: sorted by mesh index (with ``dp`` before ``pp`` it aborts the process in an XLA CHECK:
#: "Manual axes must be sorted by mesh axis index").
MESH_NAME_ORDER: tuple[str, ...] = ("pp", *(a for a in MESH_AXES if a != "pp"))


def make_mesh(config: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the mesh for ``config``: devices laid out ``(dp, pp, sp, ep, tp)``.

    With ``devices=None`` it spans ``jax.devices()`` — every device of every process after
    ``jax.distributed.initialize``. On TPU the devices are ordered from the slice's physical
    torus (:func:`jaxpar.spec.tpu_device_array`): tp, then ep, sp, pp, dp take ICI
    neighbours, a physical axis is split where a degree needs part of it (tp=8 on a 4x4
    slice), and over several slices (``slice_index``) only dp and pp cross the DCN;
    :func:`jaxpar.spec.mesh_layout` says what each axis spans. On simulated CPU devices and
    GPUs, ``jax.make_mesh`` orders them. Axes are ``Auto``: jaxpar states shardings, XLA's
    SPMD partitioner inserts the collectives. The mesh names its axes in
    :data:`MESH_NAME_ORDER` (``pp`` first; see there), which changes no axis's devices.

    Raises:
        MeshError: the degrees do not multiply to the number of devices; on TPU, the
            devices are not whole slices or a box of one, or the degrees would put an axis
            other than dp and pp across slices.
    """
    available = list(jax.devices()) if devices is None else list(devices)
    if config.size != len(available):
        raise MeshError(
            f"[devices-product] strategy {config} needs {config.size} devices "
            f"(dp*pp*sp*ep*tp = {' * '.join(map(str, config.shape))}) but {len(available)} are "
            f"available; choose degrees whose product is {len(available)}"
        )
    if is_tpu_slice(available):
        array = tpu_device_array(config.shape, available)
        axis_types = (AxisType.Auto,) * len(MESH_AXES)
        return canonical_mesh(Mesh(array, MESH_AXES, axis_types=axis_types))
    try:
        mesh = jax.make_mesh(
            config.shape,
            MESH_AXES,
            axis_types=(AxisType.Auto,) * len(MESH_AXES),
            devices=available,
        )
    except (ValueError, NotImplementedError) as e:
        raise MeshError(f"cannot lay out {config} over {len(available)} devices: {e}") from e
    return canonical_mesh(mesh)


def default_mesh(config: ParallelConfig) -> Mesh:
    """The mesh an engine builds when it is given none: over the first ``config.size``
    devices (TPU: in :func:`jaxpar.spec.slice_order`), as the command line does (a one-device strategy on an 8-device host runs on
    device 0); over every device when the strategy uses them all, and always under
    ``jax.distributed`` (the first devices would all be process 0's, leaving the other
    processes out of the programs they must run).

    Raises:
        MeshError: the strategy needs more devices than there are, or fewer than every
            device of a multi-process job.
    """
    available = jax.devices()
    if config.size >= len(available) or jax.process_count() > 1:
        return make_mesh(config)
    return make_mesh(config, slice_order(available)[: config.size])


def canonical_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with its axes named in :data:`MESH_NAME_ORDER`, each over the same devices.

    For meshes a caller built with the five jaxpar axes in another order; any other mesh
    comes back as it is.
    """
    names = tuple(mesh.axis_names)
    if names == MESH_NAME_ORDER or sorted(names) != sorted(MESH_NAME_ORDER):
        return mesh
    perm = [names.index(a) for a in MESH_NAME_ORDER]
    return Mesh(
        mesh.devices.transpose(perm),
        MESH_NAME_ORDER,
        axis_types=tuple(mesh.axis_types[i] for i in perm),
    )
