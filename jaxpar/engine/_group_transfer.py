"""Moving arrays between two device groups of a multi-process job, device to device.

A disaggregated server whose prefill group sits on other processes than its decode group
must move each prefilled batch's K/V across hosts. ``jax.device_put`` cannot: across
processes it reshards only within one set of devices, and crosses hosts only where the
runtime has a cross-host transfer service (``jax_cross_host_transfer_socket_address``;
XLA:CPU has none: "Cross-host transfers are not supported by this backend").
So the move is one SPMD program over both groups, the *global mesh* of
:func:`union_mesh`: axis ``group`` of size 2 (index 0 the destination devices, index 1
the source devices, in the destination mesh's shape) before the destination's axes.
Each array is first laid out on its own devices as the destination lays it out (a
reshard inside the source group), then joined with a placeholder on the destination
devices into one global array sharded ``P("group", *spec)``, and one ``ppermute`` from
group 1 to group 0 sends every shard straight to its destination device (over the
interconnect: ICI/DCN, NVLink/NCCL, gloo on CPU). The bytes never pass through a host,
process 0's or any other; each process touches only its own devices' shards.

Every process runs the same calls in the same order (the lockstep executor replays
them), so the program's collectives pair up; a process with no device in either group
joins with no shards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.errors import ConfigError

#: Places arrays in shardings, one each: :func:`device_put_all` or :func:`move_tree`.
Mover = Callable[[list[jax.Array], list[NamedSharding]], list[jax.Array]]

#: The global mesh's axis that tells the two groups apart (0: destination, 1: source).
GROUP_AXIS = "group"


def moves_globally() -> bool:
    """Whether moving between two groups takes :func:`move_tree` rather than
    ``jax.device_put``: in a multi-process job, where every process runs each move (the
    others replay process 0's), also a process with no device in either group, and
    ``jax.device_put`` refuses to move an array it has no shard of to other devices."""
    return jax.process_count() > 1


def check_groups(source: Mesh, target: Mesh) -> None:
    """Raises unless arrays can move from ``source``'s devices to ``target``'s by
    :func:`move_tree`: disjoint groups of as many devices each (one destination device
    per source device).

    Raises:
        ConfigError: the groups share devices or differ in size.
    """
    src, dst = list(source.devices.flat), list(target.devices.flat)
    if set(src) & set(dst):
        raise ConfigError(
            "prefill and decode groups must not share devices; they "
            f"share {sorted(d.id for d in set(src) & set(dst))}"
        )
    if len(src) != len(dst):
        raise ConfigError(
            f"in a multi-process job the prefill group ({len(src)} devices) and the decode group "
            f"({len(dst)} devices) must have as many devices: the prefilled K/V move one "
            "device to one device; give --prefill a strategy over "
            f"{len(dst)} devices (e.g. 'tp={len(dst)}' or 'sp={len(dst)}')"
        )


@functools.cache
def union_mesh(source: Mesh, target: Mesh) -> Mesh:
    """The global mesh over both groups: ``(group, *target axes)``, the destination's
    devices at group 0 and the source's, in the destination's shape, at group 1."""
    check_groups(source, target)
    src = np.asarray(list(source.devices.flat), dtype=object).reshape(target.devices.shape)
    return Mesh(np.stack([target.devices, src]), (GROUP_AXIS, *target.axis_names))


def _staging(mesh: Mesh, target: NamedSharding) -> NamedSharding:
    """``target``'s layout on the source devices: group 1 of the global ``mesh``."""
    return NamedSharding(Mesh(mesh.devices[1], target.mesh.axis_names), target.spec)


def _spread(spec: PartitionSpec) -> PartitionSpec:
    return PartitionSpec(GROUP_AXIS, *spec)


@functools.cache
def _stage_program(shardings: tuple[NamedSharding, ...]):
    return jax.jit(lambda xs: xs, out_shardings=list(shardings))


@functools.cache
def _send_program(mesh: Mesh, specs: tuple[PartitionSpec, ...]):
    """Group 1's shards to group 0's devices, one ``ppermute`` per array (group 1 is left
    with zeros); donates the joined arrays."""
    spread = [_spread(s) for s in specs]

    def send(xs):
        return [jax.lax.ppermute(x, GROUP_AXIS, [(1, 0)]) for x in xs]

    body = jax.shard_map(send, mesh=mesh, in_specs=(spread,), out_specs=spread)
    return jax.jit(body, donate_argnums=0)


def _joined(staged: jax.Array, mesh: Mesh, spec: PartitionSpec) -> jax.Array:
    """``staged`` (on the source devices) as group 1 of a global array over ``mesh``, a
    placeholder (zeros, made on the device) as group 0."""
    sharding = NamedSharding(mesh, _spread(spec))
    shape = (2, *staged.shape)
    local = set(sharding.addressable_devices)
    shards = {s.device: s.data[None] for s in staged.addressable_shards}
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        if device in shards:
            arrays.append(shards[device])
            continue
        block = tuple(
            len(range(*i.indices(n))) if isinstance(i, slice) else 1
            for i, n in zip(index, shape, strict=True)
        )
        arrays.append(jnp.zeros(block, staged.dtype, device=device))
    assert len(arrays) == len(local)
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=staged.dtype)


def _received(moved: jax.Array, target: NamedSharding) -> jax.Array:
    """Group 0 of ``moved`` as an array in ``target``."""
    shape = moved.shape[1:]
    mine = set(target.addressable_devices)
    arrays = [s.data[0] for s in moved.addressable_shards if s.device in mine]
    return jax.make_array_from_single_device_arrays(shape, target, arrays, dtype=moved.dtype)


def move_tree(xs: list[jax.Array], targets: list[NamedSharding]) -> list[jax.Array]:
    """``xs`` (arrays on one group's devices) placed in ``targets`` (shardings over another
    group's devices, of as many devices), device to device in one program (see the module
    docstring). Every process must call it with the same shapes, in the same order."""
    if not xs:
        return []
    source = xs[0].sharding.mesh
    mesh = union_mesh(source, targets[0].mesh)
    for x, t in zip(xs, targets, strict=True):
        same = set(x.sharding.device_set) == set(source.devices.flat)
        if not same or union_mesh(source, t.mesh) != mesh:
            raise ValueError("move_tree moves from one group's devices to another's")
    staging = tuple(_staging(mesh, t) for t in targets)
    staged = _stage_program(staging)(list(xs))
    specs = tuple(t.spec for t in targets)
    joined = [_joined(x, mesh, s) for x, s in zip(staged, specs, strict=True)]
    moved = _send_program(mesh, specs)(joined)
    return [_received(m, t) for m, t in zip(moved, targets, strict=True)]


def device_put_all(xs: list[jax.Array], targets: list[NamedSharding]) -> list[jax.Array]:
    """``jax.device_put`` of each of ``xs`` to its target (one process)."""
    return list(jax.device_put(list(xs), list(targets)))


def put_tree(tree: Any, shardings: Any, move: Mover = device_put_all) -> tuple[Any, int]:
    """``tree`` placed in ``shardings`` (a prefix of it) by ``move``; and its bytes."""
    leaves, treedef = jax.tree.flatten(tree)
    targets = jax.tree.leaves(jax.tree.broadcast(shardings, tree))
    moved = move(leaves, targets)
    return jax.tree.unflatten(treedef, moved), sum(x.size * x.dtype.itemsize for x in leaves)
