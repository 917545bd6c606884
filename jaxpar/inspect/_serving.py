"""The serving programs' collectives and memory, in one table.

``jaxpar serve`` runs the paged decode step, bucketed prefill (with and without cached
context), the first tokens' draw and the insert, not the contiguous-cache steps
``jaxpar explain`` used to compile. :func:`serving_report` compiles each of them from an
:class:`~jaxpar.engine.AbstractEngine` (nothing allocated) and puts its collectives
beside the analytic minimum (:func:`~jaxpar.inspect.phase_report` with ``program=``) and
its memory per device (``memory_analysis()``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxpar.inspect._report import CollectiveReport, format_ratio, phase_report

if TYPE_CHECKING:
    from rich.table import Table


@dataclasses.dataclass(frozen=True)
class ServingRow:
    """One serving program: its collective report and its bytes per device.

    Attributes:
        program: the program's name (``"serve_decode"``, ...).
        report: compiled collectives against the analytic minimum.
        arguments, outputs, temporaries, aliased: ``memory_analysis()`` bytes per device.
    """

    program: str
    report: CollectiveReport
    arguments: int
    outputs: int
    temporaries: int
    aliased: int

    @property
    def peak(self) -> int:
        """Arguments + outputs + temporaries - donated (aliased) bytes, per device."""
        return self.arguments + self.outputs + self.temporaries - self.aliased

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "program": self.program,
            "collectives": self.report.to_dict(),
            "memory": {
                "arguments": self.arguments,
                "outputs": self.outputs,
                "temporaries": self.temporaries,
                "aliased": self.aliased,
                "peak": self.peak,
            },
        }


def serving_report(
    engine: Any,
    *,
    prompt_len: int,
    rows: int | None = None,
    programs: Sequence[str] | None = None,
    label: str | None = None,
) -> list[ServingRow]:
    """Compiles ``engine``'s serving programs and reports each.

    Args:
        engine: an unpipelined :class:`~jaxpar.engine.AbstractEngine`.
        prompt_len: new tokens per row of the prefill programs and the insert (and the
            cached context of ``serve_prefill_context``).
        rows: rows per program (default the engine's ``max_batch``).
        programs: which (default every one of :data:`jaxpar.engine.SERVING_PROGRAMS`).
        label: a name for the reports (default the strategy).
    """
    from jaxpar.engine import SERVING_PROGRAMS

    out = []
    for program in programs or SERVING_PROGRAMS:
        report, compiled = phase_report(
            engine, program, prompt_len=prompt_len, rows=rows, label=label
        )
        mem = compiled.memory_analysis()

        def size(name: str, mem=mem) -> int:
            return int(getattr(mem, name, 0) or 0) if mem is not None else 0

        out.append(
            ServingRow(
                program,
                report,
                arguments=size("argument_size_in_bytes"),
                outputs=size("output_size_in_bytes"),
                temporaries=size("temp_size_in_bytes"),
                aliased=size("alias_size_in_bytes"),
            )
        )
    return out


def serving_table(rows: Sequence[ServingRow], title: str | None = None) -> Table:
    """A ``rich.table.Table``: one row per serving program."""
    from rich.table import Table

    table = Table(
        title=title or "serving programs: collectives (compiled vs minimum) and memory per device",
        title_justify="left",
    )
    for header in (
        "program",
        "phase",
        "collectives",
        "minimum",
        "ratio",
        "above the minimum",
        "arguments",
        "temporaries",
        "peak",
    ):
        left = header in ("program", "phase", "above the minimum")
        table.add_column(header, justify="left" if left else "right")
    for r in rows:
        rep = r.report
        table.add_row(
            r.program,
            rep.phase.value,
            f"{rep.compiled_bytes:,}",
            f"{rep.minimum_bytes:,}",
            format_ratio(rep.ratio),
            ", ".join(f"{k} {v:,}" for k, v in rep.exceptions.items()),
            f"{r.arguments:,}",
            f"{r.temporaries:,}",
            f"{r.peak:,}",
        )
    return table
