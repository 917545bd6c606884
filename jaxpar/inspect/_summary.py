"""Summaries of collectives by (kind, mesh axes, module), for tables and JSON."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxpar.inspect._hlo import Collective
from jaxpar.inspect._mesh_axes import (
    MODULE_SCOPES,
    MeshLike,
    axes_for_groups,
    axes_for_pairs,
    module_of,
)

if TYPE_CHECKING:
    from rich.table import Table

UNMAPPED = "unmapped"


def collective_axes(collective: Collective, mesh: MeshLike) -> tuple[str, ...] | None:
    """Mesh axes a collective runs over: from its groups, or its pairs for permutes.

    Returns None ("unmapped") when neither matches an axis set of ``mesh``.
    """
    if collective.source_target_pairs is not None:
        return axes_for_pairs(collective.source_target_pairs, mesh)
    if collective.replica_groups is not None:
        return axes_for_groups(collective.replica_groups, mesh)
    return None


@dataclass(frozen=True)
class SummaryRow:
    """Collectives of one (kind, mesh axes, module) group.

    Attributes:
        kind: the collective kind.
        axes: mesh axes, or None when unmapped (or no mesh was given).
        module: jaxpar module scope from op_name metadata, or None.
        count: executions per program run (loop bodies times their trip count).
        static_count: collective instructions in the program text.
        bytes: total bytes over ``count`` executions (see ``Collective.bytes``).
        trip_counts_known: False if some collective sits in a loop of unknown trip
            count; it is then counted once in ``count`` and ``bytes``.
    """

    kind: str
    axes: tuple[str, ...] | None
    module: str | None
    count: int
    static_count: int
    bytes: int
    trip_counts_known: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``axes`` is a list of names or ``"unmapped"``."""
        return {
            "kind": self.kind,
            "axes": UNMAPPED if self.axes is None else list(self.axes),
            "module": self.module,
            "count": self.count,
            "static_count": self.static_count,
            "bytes": self.bytes,
            "trip_counts_known": self.trip_counts_known,
        }


@dataclass(frozen=True)
class CollectiveSummary:
    """All summary rows, sorted by kind, axes and module."""

    rows: tuple[SummaryRow, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes over all rows."""
        return sum(row.bytes for row in self.rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with the rows and the byte total."""
        return {"rows": [row.to_dict() for row in self.rows], "total_bytes": self.total_bytes}

    def to_rich_table(self, title: str = "Collectives") -> Table:
        """A ``rich.table.Table`` of the rows (rich is imported only when called)."""
        from rich.table import Table

        table = Table(title=title)
        for header in ("kind", "mesh axes", "module", "count", "in text", "bytes"):
            justify = "right" if header in ("count", "in text", "bytes") else "left"
            table.add_column(header, justify=justify)
        for row in self.rows:
            axes = UNMAPPED if row.axes is None else (",".join(row.axes) or "-")
            count = f"{row.count}" if row.trip_counts_known else f"{row.count}+?"
            table.add_row(
                row.kind, axes, row.module or "-", count, str(row.static_count), f"{row.bytes:,}"
            )
        return table


def summarize(
    collectives: Iterable[Collective],
    mesh: MeshLike | None = None,
    scopes: Sequence[str] = MODULE_SCOPES,
) -> CollectiveSummary:
    """Group collectives by (kind, mesh axes, module) with counts and bytes.

    Args:
        collectives: records from :func:`parse_collectives`.
        mesh: the mesh the program was compiled for; without one, axes are None.
        scopes: module scope names for :func:`module_of`.
    """
    groups: dict[tuple[str, tuple[str, ...] | None, str | None], list[Collective]] = {}
    for c in collectives:
        axes = collective_axes(c, mesh) if mesh is not None else None
        groups.setdefault((c.kind, axes, module_of(c.op_name, scopes)), []).append(c)
    rows = [
        SummaryRow(
            kind=kind,
            axes=axes,
            module=module,
            count=sum(c.trip_count or 1 for c in members),
            static_count=len(members),
            bytes=sum(c.bytes * (c.trip_count or 1) for c in members),
            trip_counts_known=all(c.trip_count is not None for c in members),
        )
        for (kind, axes, module), members in groups.items()
    ]
    rows.sort(key=lambda r: (r.kind, r.axes is None, r.axes or (), r.module or "~"))
    return CollectiveSummary(tuple(rows))
