"""Inspection of compiled programs: which collectives run, over which mesh axes, where."""

from jaxpar.inspect._groups import expand_iota, expand_mesh_axes, parse_replica_groups
from jaxpar.inspect._hlo import KINDS, Collective, parse_collectives
from jaxpar.inspect._mesh_axes import (
    MODULE_SCOPES,
    axes_for_groups,
    axes_for_pairs,
    groups_for_axes,
    module_of,
)
from jaxpar.inspect._summary import (
    UNMAPPED,
    CollectiveSummary,
    SummaryRow,
    collective_axes,
    summarize,
)

__all__ = [
    "KINDS",
    "MODULE_SCOPES",
    "UNMAPPED",
    "Collective",
    "CollectiveSummary",
    "SummaryRow",
    "axes_for_groups",
    "axes_for_pairs",
    "collective_axes",
    "expand_iota",
    "expand_mesh_axes",
    "groups_for_axes",
    "module_of",
    "parse_collectives",
    "parse_replica_groups",
    "summarize",
]
