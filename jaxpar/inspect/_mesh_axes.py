"""Map HLO device groups back to the axis names of a ``jax.sharding.Mesh``.

Device ids in an SPMD program's collectives are *logical* ids: the position of a
device in ``mesh.devices.flat``, not ``Device.id``. Permuting the physical devices of a
mesh therefore leaves the compiled text unchanged (checked on 8 simulated CPU devices
in ``tests/test_inspect_hlo.py``), and only the mesh's shape and axis names matter here.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations, permutations
from typing import Protocol

import numpy as np

from jaxpar.inspect._groups import Groups, Pairs
from jaxpar.spec import Module

# Scopes jaxpar's model code opens with ``jax.named_scope(module.value)`` around each module.
MODULE_SCOPES = tuple(m.value for m in Module)


class MeshLike(Protocol):
    """What the mapping needs of a mesh: ``jax.sharding.Mesh`` and ``AbstractMesh`` fit."""

    @property
    def axis_names(self) -> tuple[str, ...]: ...

    @property
    def axis_sizes(self) -> tuple[int, ...]: ...


def _positions(mesh: MeshLike) -> np.ndarray:
    return np.arange(int(np.prod(mesh.axis_sizes))).reshape(tuple(mesh.axis_sizes))


def groups_for_axes(mesh: MeshLike, axes: Sequence[str]) -> Groups:
    """The device groups (logical ids) a collective over ``axes`` of ``mesh`` uses.

    Within a group, ids are ordered with the first of ``axes`` most major, which is
    the order jax uses for a collective over a tuple of axis names.
    """
    names = list(mesh.axis_names)
    grouped = [names.index(a) for a in axes]
    others = [i for i in range(len(names)) if i not in grouped]
    size = int(np.prod([mesh.axis_sizes[i] for i in grouped]))
    array = _positions(mesh).transpose(others + grouped).reshape(-1, size)
    return tuple(tuple(int(i) for i in row) for row in array)


def axes_for_groups(groups: Groups, mesh: MeshLike) -> tuple[str, ...] | None:
    """The mesh axes whose device groups equal ``groups``, or None if none do.

    Size-1 axes never change groups and are left out. The smallest matching axis set
    is returned, in the order that reproduces the order of ids within each group
    (mesh order when only the set of groups matches). Groups of single devices give
    ``()``.

    Args:
        groups: replica groups as logical device ids.
        mesh: the mesh the program was compiled for.
    """
    target = {frozenset(g) for g in groups}
    if sum(len(g) for g in groups) != int(np.prod(mesh.axis_sizes)):
        return None
    if all(len(g) == 1 for g in groups):
        return ()
    candidates = [n for n, s in zip(mesh.axis_names, mesh.axis_sizes, strict=True) if s > 1]
    for count in range(1, len(candidates) + 1):
        for subset in combinations(candidates, count):
            if {frozenset(g) for g in groups_for_axes(mesh, subset)} != target:
                continue
            exact = set(groups)
            for order in permutations(subset):
                if set(groups_for_axes(mesh, order)) == exact:
                    return order
            return subset
    return None


def axes_for_pairs(pairs: Pairs, mesh: MeshLike) -> tuple[str, ...] | None:
    """The mesh axes along which the sources and targets of a permute differ.

    Returns the axes (in mesh order) on which any pair's two devices have different
    coordinates; ``()`` if every pair is a self-copy; None if an id is not in the mesh.
    """
    total = int(np.prod(mesh.axis_sizes))
    if any(not 0 <= d < total for pair in pairs for d in pair):
        return None
    moved: set[int] = set()
    for source, target in pairs:
        a = np.unravel_index(source, tuple(mesh.axis_sizes))
        b = np.unravel_index(target, tuple(mesh.axis_sizes))
        moved |= {i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y}
    return tuple(mesh.axis_names[i] for i in sorted(moved))


def module_of(op_name: str | None, scopes: Sequence[str] = MODULE_SCOPES) -> str | None:
    """The jaxpar module a collective belongs to, from its ``op_name`` metadata.

    Args:
        op_name: e.g. ``"jit(step)/while/body/attention/psum"``.
        scopes: the module scope names to look for.

    Returns:
        The first ``/``-separated component of ``op_name`` that is one of ``scopes``,
        else None.
    """
    if not op_name:
        return None
    return next((part for part in op_name.split("/") if part in scopes), None)
