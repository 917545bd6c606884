"""Replica groups and source-target pairs of HLO collectives, in all printed forms.

XLA prints ``replica_groups=`` in three forms, all of which jax 0.10.2 emits on CPU:

* explicit lists, ``{{0,1},{2,3}}`` (``{}`` means one group of all devices);
* iota, ``[G,S]<=[d0,d1,...]T(p0,p1,...)``: the ids ``arange(prod(d))`` reshaped to
  ``d``, transposed by ``p`` (identity when ``T(...)`` is absent), reshaped to ``G``
  groups of ``S``;
* mesh axes, ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``, optionally with
  ``, device_ids=(...)`` after the mesh (an iota ``[d..]T(p..)`` or an explicit id
  list) and sub-axes written ``'x':(pre)size``. The mesh is the partitioner's tile
  mesh, with synthetic axis names -- not the user's ``jax.sharding.Mesh`` -- so the
  form is expanded to explicit groups before it is mapped back to user axes.
"""

from __future__ import annotations

import re

import numpy as np

Groups = tuple[tuple[int, ...], ...]
Pairs = tuple[tuple[int, int], ...]

_EXPLICIT_RE = re.compile(r"\{\s*(?:\{[\d,\s]*\}\s*,?\s*)*\}")
_IOTA_RE = re.compile(r"\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_MESH_RE = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]+)\))?"
    r"\s*\{(?P<group>[^}]*)\}"
)
_MESH_AXIS_RE = re.compile(r"'?(?P<name>[^'=,\s]+)'?\s*=\s*(?P<size>\d+)")
_GROUP_AXIS_RE = re.compile(r"'?(?P<name>[^':,\s]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?")


def _ints(text: str | None) -> list[int]:
    return [int(t) for t in (text or "").replace(" ", "").split(",") if t]


def expand_iota(
    group_shape: tuple[int, int], reshape_dims: tuple[int, ...], perm: tuple[int, ...] | None = None
) -> np.ndarray:
    """Groups of the iota form ``[G,S]<=[reshape_dims]T(perm)`` as a ``(G, S)`` array."""
    ids = np.arange(int(np.prod(reshape_dims))).reshape(reshape_dims)
    if perm is not None:
        ids = ids.transpose(perm)
    return ids.reshape(group_shape)


def _device_array(sizes: list[int], ids: str | None) -> np.ndarray:
    total = int(np.prod(sizes))
    if ids is None:
        return np.arange(total).reshape(sizes)
    iota = re.fullmatch(r"\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?", ids.strip())
    if iota is None:
        return np.array(_ints(ids)).reshape(sizes)
    array = np.arange(total).reshape(_ints(iota["dims"]))
    if iota["perm"]:
        array = array.transpose(_ints(iota["perm"]))
    return array.reshape(sizes)


def expand_mesh_axes(
    axes: list[tuple[str, int]],
    group_axes: list[tuple[str, int | None, int | None]],
    device_ids: str | None = None,
) -> np.ndarray:
    """Groups of the mesh-axes form as a ``(num_groups, group_size)`` array.

    Args:
        axes: the mesh's ``(name, size)`` pairs, major to minor.
        group_axes: the grouped axes in printed order as ``(name, pre_size, size)``;
            ``pre_size`` and ``size`` are None for a whole axis. A sub-axis
            ``x:(pre)size`` is the factor of size ``size`` of axis ``x`` whose more
            major factors multiply to ``pre``.
        device_ids: the printed ``device_ids=(...)`` content, or None for iota.
    """
    sizes = [size for _, size in axes]
    index = {name: i for i, (name, _) in enumerate(axes)}
    # Split each mesh axis into factors (major to minor) so every referenced sub-axis is
    # one factor; remember which factor each grouped axis reference became.
    by_axis: dict[int, list[tuple[int, int, int]]] = {}
    for ref, (name, pre, size) in enumerate(group_axes):
        full = sizes[index[name]]
        by_axis.setdefault(index[name], []).append((pre or 1, size or full, ref))
    factors: list[int] = []
    factor_of_ref: dict[int, int] = {}
    for axis, full in enumerate(sizes):
        covered = 1
        for pre, size, ref in sorted(by_axis.get(axis, [])):
            if pre != covered:
                factors.append(pre // covered)
            factor_of_ref[ref] = len(factors)
            factors.append(size)
            covered = pre * size
        if covered != full:
            factors.append(full // covered)
    grouped = [factor_of_ref[ref] for ref in range(len(group_axes))]
    others = [f for f in range(len(factors)) if f not in grouped]
    group_size = int(np.prod([factors[f] for f in grouped]))
    array = _device_array(sizes, device_ids).reshape(factors)
    return array.transpose(others + grouped).reshape(-1, group_size)


def parse_replica_groups(attrs: str, num_devices: int | None = None) -> tuple[Groups | None, str]:
    """Read the ``replica_groups=`` attribute of an instruction's attribute text.

    Args:
        attrs: the attribute text after the operand list.
        num_devices: devices in the program (``num_partitions``), used to expand the
            empty list ``{}`` that means "one group of every device".

    Returns:
        ``(groups, form)`` with form one of ``"explicit"``, ``"iota"``, ``"mesh"``, or
        ``(None, "none")`` when no groups are printed (or ``{}`` with no device count).
    """
    start = re.search(r"(?:^|[\s,])replica_groups=", attrs)
    if start is None:
        return None, "none"
    text = attrs[start.end() :]
    if (found := _MESH_RE.match(text)) is not None:
        axes = [(m["name"], int(m["size"])) for m in _MESH_AXIS_RE.finditer(found["axes"])]
        group_axes = [
            (m["name"], int(m["pre"]) if m["pre"] else None, int(m["size"]) if m["size"] else None)
            for m in _GROUP_AXIS_RE.finditer(found["group"])
        ]
        array = expand_mesh_axes(axes, group_axes, found["ids"])
        return _as_groups(array), "mesh"
    if (found := _IOTA_RE.match(text)) is not None:
        perm = tuple(_ints(found["perm"])) if found["perm"] else None
        shape = _ints(found["shape"])
        array = expand_iota((shape[0], shape[1]), tuple(_ints(found["dims"])), perm)
        return _as_groups(array), "iota"
    if (found := _EXPLICIT_RE.match(text)) is not None:
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", found.group(0)[1:-1]))
        groups = tuple(g for g in groups if g)
        if not groups:
            if num_devices is None:
                return None, "none"
            groups = (tuple(range(num_devices)),)
        return groups, "explicit"
    raise ValueError(f"unrecognised replica_groups form: {text[:80]!r}")


def _as_groups(array: np.ndarray) -> Groups:
    return tuple(tuple(int(i) for i in row) for row in array)


def parse_source_target_pairs(attrs: str) -> Pairs | None:
    """Read ``source_target_pairs={{0,1},...}`` (collective-permute) if present.

    GPU pipelining also prints pairs for send/recv in the frontend attribute
    ``_xla_send_recv_source_target_pairs="{{0,1},...}"``, which is read as a fallback.
    """
    found = re.search(
        r"(?:source_target_pairs=|_xla_send_recv_source_target_pairs=\"?)(\{\s*(?:\{[\d,\s]*\}\s*,?\s*)*\})",
        attrs,
    )
    if found is None:
        return None
    pairs = re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", found.group(1))
    return tuple((int(s), int(t)) for s, t in pairs)
