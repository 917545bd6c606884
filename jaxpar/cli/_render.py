"""Rich rendering of a validated plan: per phase, which primitive splits which module how."""

from __future__ import annotations

from rich.table import Table

from jaxpar.spec import Module, Phase, Plan, Primitive, Status

_STATUS_STYLE = {
    Status.ALLOWED: "",
    Status.LAYER_ONLY: "",
    Status.ONLY_IF_MOE: "dim",
    Status.NOT_ALLOWED: "red",
    Status.RARELY_APPLICABLE: "dim",
}


def _status_note(status: Status) -> str:
    """`` (layer_only)`` after a cell, styled where the status has a style (none for allowed)."""
    if status is Status.ALLOWED:
        return ""
    style = _STATUS_STYLE[status]
    text = f"({status.value})"
    return f" [{style}]{text}[/]" if style else f" {text}"


def plan_table(plan: Plan, phase: Phase) -> Table:
    """Rows: modules; columns: mesh axes; cells: the logical dims the axis splits there."""
    config = plan.config
    table = Table(
        title=f"{phase.value}: what each mesh axis splits ({config})", title_justify="left"
    )
    table.add_column("module")
    for primitive in Primitive:
        table.add_column(f"{primitive.value}={config.degree(primitive)}")
    modules: list[Module] = []
    for a in plan.for_phase(phase):
        if a.module not in modules:
            modules.append(a.module)
    for module in modules:
        cells = []
        for primitive in Primitive:
            a = next(
                x for x in plan.for_phase(phase) if x.module is module and x.primitive is primitive
            )
            if a.degree == 1:
                text = "[dim]-[/dim]"
            elif a.splits:
                text = ", ".join(a.splits)
            else:
                text = "replicated"
            cells.append(text + (_status_note(a.status) if a.degree > 1 else ""))
        table.add_row(module.value, *cells)
    return table
