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
from jaxpar.inspect._model import (
    CommModel,
    Expected,
    communication_model,
    execution_steps,
    moe_routed_rows,
)
from jaxpar.inspect._report import (
    CAUSES,
    MOE_EXCHANGES,
    TOLERANCE,
    CollectiveReport,
    ReportRow,
    classify,
    collective_report,
    compile_step,
    moe_exchange,
    phase_report,
)
from jaxpar.inspect._serving import ServingRow, serving_report, serving_table
from jaxpar.inspect._summary import (
    UNMAPPED,
    CollectiveSummary,
    SummaryRow,
    collective_axes,
    summarize,
)
from jaxpar.inspect._targets import KERNELS, kernel_calls, tpu_devices

__all__ = [
    "CAUSES",
    "KERNELS",
    "KINDS",
    "MODULE_SCOPES",
    "MOE_EXCHANGES",
    "UNMAPPED",
    "Collective",
    "CollectiveReport",
    "CollectiveSummary",
    "CommModel",
    "Expected",
    "ReportRow",
    "ServingRow",
    "SummaryRow",
    "TOLERANCE",
    "axes_for_groups",
    "axes_for_pairs",
    "classify",
    "collective_axes",
    "collective_report",
    "communication_model",
    "compile_step",
    "execution_steps",
    "kernel_calls",
    "expand_iota",
    "expand_mesh_axes",
    "groups_for_axes",
    "module_of",
    "moe_exchange",
    "moe_routed_rows",
    "parse_collectives",
    "parse_replica_groups",
    "phase_report",
    "serving_report",
    "serving_table",
    "summarize",
    "tpu_devices",
]
