"""TPU slices: the device order of a mesh from the chips' physical torus, and what it gives.

A TPU slice is a 2-D (v5e, v6e) or 3-D (v4, v5p) grid of chips joined by ICI links to their
neighbours; several slices are joined by the data-centre network (DCN), far slower.
:func:`tpu_device_array` orders a slice's devices for the mesh degrees ``(dp, pp, sp, ep,
tp)``: JAX's ``mesh_utils`` maps the most communication-heavy axes (tp, then ep, sp, pp, dp)
onto physical axes first, splitting a physical axis where a degree is not a product of whole
ones (tp=8 on a 4x4 slice: all 4 chips of x and 2 of y's 4); over several slices only dp and
pp may cross the DCN. :func:`mesh_layout` reads back, from the chips' coordinates, what
each mesh axis spans. :func:`slice_devices` makes stand-in chips for a slice shape, so
that the planner lays out a strategy exactly as :func:`jaxpar.spec.make_mesh` would, with
no TPU and no libtpu.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpar.errors import MeshError
from jaxpar.spec._enums import MESH_AXES

PHYSICAL_AXES = ("x", "y", "z")
#: Mesh axes that may cross slices: their collectives are rare (dp: none in inference;
#: pp: one activation hand-off per stage), the others' are per layer.
DCN_AXES = ("dp", "pp")


def is_tpu_slice(devices: Sequence[Any]) -> bool:
    """Whether ``devices`` are TPU chips that carry torus coordinates."""
    return bool(devices) and all(
        getattr(d, "platform", None) == "tpu" and getattr(d, "coords", None) is not None
        for d in devices
    )


def _slice_of(device: Any) -> int:
    return getattr(device, "slice_index", None) or 0


def slice_order(devices: Sequence[Any]) -> list[Any]:
    """TPU chips in the order a slice numbers them (slice, then z, y, x; x fastest), so that
    the first ``k`` of them are the ones :func:`slice_devices` stands in for; other devices
    as they are."""
    if not is_tpu_slice(devices):
        return list(devices)
    return sorted(devices, key=lambda d: (_slice_of(d), *reversed(tuple(d.coords))))


def dcn_shape(shape: Sequence[int], n_slices: int) -> tuple[int, ...]:
    """How many slices each axis of ``shape`` (``MESH_AXES`` order) crosses.

    dp takes as many as divide it, pp the rest; every other axis stays inside a slice.

    Raises:
        MeshError: dp and pp cannot absorb ``n_slices``.
    """
    degrees = dict(zip(MESH_AXES, shape, strict=True))
    over_dp = math.gcd(degrees["dp"], n_slices)
    over_pp = n_slices // over_dp
    if degrees["pp"] % over_pp:
        raise MeshError(
            f"[slices] {n_slices} TPU slices need dp*pp to span them (only dp and pp may "
            f"cross the slow DCN between slices; sp, ep and tp communicate every layer), but "
            f"dp={degrees['dp']}, pp={degrees['pp']}: choose dp and pp whose product is a "
            f"multiple of {n_slices}, with every slice holding the same share of each"
        )
    return tuple(over_dp if a == "dp" else over_pp if a == "pp" else 1 for a in MESH_AXES)


def tpu_device_array(shape: Sequence[int], devices: Sequence[Any]) -> np.ndarray:
    """``devices`` (TPU chips, one or several slices) as an array of ``shape``.

    Raises:
        MeshError: the devices do not form whole boxes of their slices, the slices differ
            in size, or an axis other than dp and pp would cross slices.
    """
    from jax.experimental import mesh_utils

    shape = tuple(int(s) for s in shape)
    n_slices = len({_slice_of(d) for d in devices})
    try:
        if n_slices == 1:
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        dcn = dcn_shape(shape, n_slices)
        ici = tuple(s // d for s, d in zip(shape, dcn, strict=True))
        return mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, allow_split_physical_axes=True
        )
    except (ValueError, NotImplementedError, AssertionError) as e:
        # AssertionError: mesh_utils found a hole in a slice (devices that are not a box).
        raise MeshError(
            f"cannot lay out degrees {dict(zip(MESH_AXES, shape, strict=True))} over "
            f"{len(devices)} TPU chips in {n_slices} slice(s): {e}; pass whole slices, or a "
            "box of neighbouring chips of one slice"
        ) from e


@dataclasses.dataclass(frozen=True)
class AxisLayout:
    """What one mesh axis spans on the chips.

    Attributes:
        axis: the mesh axis (``tp``, ...).
        degree: its size.
        spans: ``(physical axis, chips spanned, chips on that axis of the slice)`` for each
            physical axis a group of this mesh axis spans (``"dcn"``: slices spanned, of all).
        contiguous: every group (per slice) is a box of neighbouring chips.
        ring: every group, in mesh order, is a closed chain of ICI neighbours.
    """

    axis: str
    degree: int
    spans: tuple[tuple[str, int, int], ...]
    contiguous: bool
    ring: bool

    @property
    def split(self) -> bool:
        """Whether a group takes only part of some physical axis (others share it)."""
        return any(used < extent for name, used, extent in self.spans if name != "dcn")

    @property
    def over_dcn(self) -> bool:
        return any(name == "dcn" for name, _, _ in self.spans)

    def __str__(self) -> str:
        parts = [
            f"DCN({used} slices)"
            if name == "dcn"
            else f"{name}({used}{'' if used == extent else f' of {extent}'})"
            for name, used, extent in self.spans
        ]
        notes = ["split"] if self.split else []
        notes.append("ring" if self.ring else "contiguous" if self.contiguous else "strided")
        return f"{self.axis}={self.degree} over {'·'.join(parts)}, {', '.join(notes)}"


def _is_box(coords: np.ndarray) -> bool:
    """Whether the chips at ``coords`` (one slice) fill a box, no holes, no gaps."""
    lo, hi = coords.min(axis=0), coords.max(axis=0)
    return int(np.prod(hi - lo + 1)) == len({tuple(c) for c in coords})


def _is_ring(coords: np.ndarray) -> bool:
    """Whether each chip is an ICI neighbour of the next, the last of the first (no
    wrap-around links are assumed: a slice smaller than a full pod has none)."""
    steps = np.abs(np.diff(np.vstack([coords, coords[:1]]), axis=0)).sum(axis=1)
    return bool((steps == 1).all()) if len(coords) > 2 else bool((steps[:1] == 1).all())


def _group_shape(group: Sequence[Any], extents: Sequence[int], n_slices: int):
    coords = np.array([d.coords for d in group])
    spans = []
    slices = len({_slice_of(d) for d in group})
    if slices > 1:
        spans.append(("dcn", slices, n_slices))
    for i, name in enumerate(PHYSICAL_AXES[: coords.shape[1]]):
        used = len(set(coords[:, i]))
        if used > 1:
            spans.append((name, used, extents[i]))
    per_slice = [coords[[_slice_of(d) == s for d in group]] for s in {_slice_of(d) for d in group}]
    return tuple(spans), all(_is_box(c) for c in per_slice), slices == 1 and _is_ring(coords)


def _axis_layout(axis: str, groups: np.ndarray, extents, n_slices: int) -> AxisLayout:
    shapes = [_group_shape(g, extents, n_slices) for g in groups]
    return AxisLayout(
        axis=axis,
        degree=groups.shape[1],
        spans=shapes[0][0],
        contiguous=all(s[1] for s in shapes),
        ring=all(s[2] for s in shapes),
    )


def mesh_layout(mesh: Any) -> tuple[AxisLayout, ...] | None:
    """What each mesh axis of degree > 1 spans on a TPU slice, in ``MESH_AXES`` order.

    None when the mesh's devices carry no torus coordinates (CPU, GPU).
    """
    return array_layout(mesh.devices, tuple(mesh.axis_names))


def array_layout(devices: np.ndarray, names: Sequence[str]) -> tuple[AxisLayout, ...] | None:
    """:func:`mesh_layout` of a device array whose axes are ``names``."""
    flat = list(devices.flat)
    if not is_tpu_slice(flat):
        return None
    first = [d for d in flat if _slice_of(d) == _slice_of(flat[0])]
    coords = np.array([d.coords for d in first])
    extents = tuple(int(e) for e in coords.max(axis=0) - coords.min(axis=0) + 1)
    n_slices = len({_slice_of(d) for d in flat})
    out = []
    for axis in MESH_AXES:
        if axis not in names or devices.shape[names.index(axis)] == 1:
            continue
        k = names.index(axis)
        groups = np.moveaxis(devices, k, -1).reshape(-1, devices.shape[k])
        out.append(_axis_layout(axis, groups, extents, n_slices))
    return tuple(out)


def describe_layout(mesh: Any) -> str | None:
    """``mesh_layout`` as one line (``"tp=8 over x(4)·y(2 of 4), split, contiguous; ..."``),
    ``"one chip"`` for a one-chip TPU mesh, None off TPU."""
    return layout_text(mesh_layout(mesh))


def layout_text(layout: tuple[AxisLayout, ...] | None) -> str | None:
    """A layout as one line; ``"one chip"`` for no axis of degree > 1; None for None."""
    if layout is None:
        return None
    return "; ".join(map(str, layout)) or "one chip"


def slice_layout(
    shape: Sequence[int],
    device_kind: str,
    slice_shape: Sequence[int],
    n_slices: int = 1,
    first: int = 0,
) -> tuple[AxisLayout, ...]:
    """The layout :func:`jaxpar.spec.make_mesh` gives degrees ``shape`` (``MESH_AXES``
    order) on ``n_slices`` slices of ``slice_shape`` chips of ``device_kind``: on all their
    chips, or on ``prod(shape)`` of them from the ``first`` in :func:`slice_order`.

    Raises:
        MeshError: no such layout (an axis other than dp, pp would cross slices; the chips
            taken are not a box of one slice or whole slices).
    """
    chips = slice_devices(device_kind, slice_shape, n_slices)
    count = math.prod(shape)
    if first + count > len(chips):
        raise MeshError(
            f"chips {first}..{first + count - 1} of {len(chips)}: past the slice(s)' chips"
        )
    array = tpu_device_array(shape, chips[first : first + count])
    layout = array_layout(array, MESH_AXES)
    assert layout is not None  # stand-in chips carry coordinates
    return layout


@dataclasses.dataclass(frozen=True)
class _Chip:
    """A stand-in TPU chip: what ``mesh_utils`` reads of a device."""

    id: int
    coords: tuple[int, int, int]
    slice_index: int
    device_kind: str
    platform: str = "tpu"
    core_on_chip: int = 0
    process_index: int = 0


def slice_devices(device_kind: str, shape: Sequence[int], n_slices: int = 1) -> list[_Chip]:
    """Stand-in chips of ``n_slices`` slices of ``shape`` (e.g. ``(4, 4)``, ``(4, 4, 4)``)
    of ``device_kind`` (``jax.Device.device_kind``: ``"TPU v5 lite"``, ``"TPU v6 lite"``,
    ``"TPU v5"``), numbered x fastest as a slice numbers its chips. :func:`make_mesh` lays
    them out as it would the real chips, which is how the planner checks a strategy."""
    dims = (*(int(s) for s in shape), 1, 1, 1)[:3]
    chips = []
    for s in range(n_slices):
        for z, y, x in np.ndindex(dims[2], dims[1], dims[0]):
            chips.append(_Chip(len(chips), (x, y, z), s, device_kind))
    return chips
