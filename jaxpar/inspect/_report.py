"""Compiled collectives next to the analytic minimum, per (kind, mesh axes, module).

:func:`collective_report` reads a compiled program, groups its collectives like
:func:`jaxpar.inspect.summarize` (loop bodies times their trip count) and puts each group
beside the :class:`~jaxpar.inspect.CommModel` items of the same key. Traffic the model does
not need is attributed to a named cause (:data:`CAUSES`), from the named scopes jaxpar's
model code sets (in the collective's ``op_name``) and its shape, so a report says *why*
XLA moved more than the minimum.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jaxpar.inspect._hlo import Collective, parse_collectives
from jaxpar.inspect._mesh_axes import MeshLike, module_of
from jaxpar.inspect._model import CommModel, Key
from jaxpar.inspect._summary import UNMAPPED, collective_axes
from jaxpar.spec import Phase

if TYPE_CHECKING:
    from rich.table import Table

#: Within this factor of the minimum a group counts as meeting it.
TOLERANCE = 1.05

#: Causes of compiled traffic above the analytic minimum, as measured on XLA:CPU.
CAUSES: dict[str, str] = {
    "moe-dispatch-buffer": (
        "padded MoE dispatch: a device sends each of its ep expert peers a block of C rows, "
        "C = ceil(cf x n x top_k / ep) with a capacity factor cf, or n x min(top_k, E/ep) "
        "dropless (what one peer can receive at most), for n tokens; the all-to-alls then "
        "move ep x C rows where top_k x n are routed: "
        "ep x C / (top_k x n) times the minimum (cf, rounded up; dropless ep x min(top_k, "
        "E/ep) / top_k), plus the E int32 row counts per layer. The ragged path (GPU, TPU) "
        "sends only the routed rows"
    ),
    "moe-ragged-receive-buffer": (
        "ragged MoE dispatch: the parser counts a ragged-all-to-all's whole receive buffer "
        "(ep x n x min(top_k, E/ep) rows); the rows that move are the routed ones, decided "
        "at run time"
    ),
    "kv-cache-gather": (
        "decode with K/V heads held whole on every tp device (a model holding its "
        "n_kv_heads < tp checkpoint heads; jaxpar's engine holds one head per device instead: "
        "rule kv-head-replicas): the partitioner splits "
        "the tp-sharded query heads N = K x G over sub-axes of tp, shards the replicated cache "
        "along K to match, and all-gathers cache-sized buffers every step"
    ),
    "pp-bubble": (
        "SPMD pipelining: every stage runs all M + pp - 1 schedule iterations, computing and "
        "communicating on placeholders in its bubbles, so what runs inside the pipeline costs "
        "(M + pp - 1) / M times the minimum (M microbatches, or decode groups)"
    ),
    "cpu-bf16-upcast": "XLA:CPU runs bf16 collectives in f32 (twice the bytes); GPUs do not",
    "branch-predicate": (
        "a lax.cond over rows split across devices (does any row sample, penalise, ask "
        "for logprobs?) decides on every device: a 1-byte all-reduce of its predicate"
    ),
    "unclassified": "no known cause; inspect the op_name in the JSON report",
}


def classify(
    c: Collective,
    phase: Phase | str,
    *,
    itemsize: int = 4,
    cache_dims: tuple[int, int] | None = None,
) -> str:
    """The :data:`CAUSES` key explaining a collective the minimum does not need.

    Args:
        c: the collective.
        phase: the phase of the program it came from.
        itemsize: bytes per activation element of the model.
        cache_dims: ``(max_seq_len, head_dim)`` of the KV cache, to recognise cache traffic.
    """
    from jaxpar.models import EXPERT_ROWS_SCOPE

    phase = Phase.coerce(phase)
    scopes = (c.op_name or "").split("/")  # jaxpar's own named scopes, outermost first
    if c.kind == "ragged-all-to-all":
        return "moe-ragged-receive-buffer"
    if c.dtypes and all(t == "pred" for t in c.dtypes):
        return "branch-predicate"
    if EXPERT_ROWS_SCOPE in scopes:
        return "moe-dispatch-buffer"
    if phase is Phase.DECODE and cache_dims is not None:
        positions, head_dim = cache_dims
        if any(len(s) >= 3 and s[-1] == head_dim and positions in s[:-1] for s in c.shapes):
            return "kv-cache-gather"
    if itemsize == 2 and c.dtypes and all(t == "f32" for t in c.dtypes):
        return "cpu-bf16-upcast"
    return "unclassified"


@dataclasses.dataclass(frozen=True)
class ReportRow:
    """One (kind, axes, module) group: compiled against minimum.

    Attributes:
        compiled_bytes / compiled_count: over one program run (loops times trip count).
        minimum_bytes / minimum_count: from the analytic model.
        causes: bytes above the minimum per :data:`CAUSES` key; empty when the group is
            within ``TOLERANCE`` of it. A group with no minimum splits its bytes by the
            cause of each collective; otherwise the excess goes to the dominant cause.
        steps: the model's step names for this key.
    """

    kind: str
    axes: tuple[str, ...] | None
    module: str | None
    compiled_bytes: int
    compiled_count: int
    minimum_bytes: int
    minimum_count: int
    causes: Mapping[str, int]
    steps: tuple[str, ...] = ()

    @property
    def cause(self) -> str | None:
        """The causes' names joined, or None."""
        return "+".join(self.causes) or None

    @property
    def ratio(self) -> float | None:
        """compiled / minimum (inf without a minimum; None when both are 0)."""
        return _ratio(self.compiled_bytes, self.minimum_bytes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``ratio`` inf is the string ``"inf"``)."""
        return {
            "kind": self.kind,
            "axes": UNMAPPED if self.axes is None else list(self.axes),
            "module": self.module,
            "steps": list(self.steps),
            "compiled_count": self.compiled_count,
            "compiled_bytes": self.compiled_bytes,
            "minimum_count": self.minimum_count,
            "minimum_bytes": self.minimum_bytes,
            "ratio": _json_ratio(self.ratio),
            "causes": dict(self.causes),
        }


def _ratio(compiled: int, minimum: int) -> float | None:
    if minimum:
        return compiled / minimum
    return math.inf if compiled else None


def _json_ratio(ratio: float | None) -> float | str | None:
    return "inf" if ratio == math.inf else (None if ratio is None else round(ratio, 4))


@dataclasses.dataclass(frozen=True)
class CollectiveReport:
    """Compiled collective bytes of one (strategy, phase) against the analytic minimum."""

    label: str
    phase: Phase
    rows: tuple[ReportRow, ...]
    model: CommModel
    trip_counts_known: bool = True
    #: MoE models: how this program moves expert rows, read from the compiled program
    #: (:func:`moe_exchange`); None for dense models.
    moe_exchange: str | None = None
    #: The serving program reported (``"serve_decode"``, ...), None for an offline step.
    program: str | None = None

    @property
    def name(self) -> str:
        """The program's name: a serving program's, else the phase's."""
        return self.program or self.phase.value

    @property
    def compiled_bytes(self) -> int:
        return sum(r.compiled_bytes for r in self.rows)

    @property
    def minimum_bytes(self) -> int:
        return self.model.total_bytes

    @property
    def ratio(self) -> float | None:
        """All compiled bytes / the minimum."""
        return _ratio(self.compiled_bytes, self.minimum_bytes)

    @property
    def exceptions(self) -> dict[str, int]:
        """Bytes above the minimum per cause (empty when every group meets it)."""
        out: dict[str, int] = {}
        for row in self.rows:
            for cause, excess in row.causes.items():
                out[cause] = out.get(cause, 0) + excess
        return out

    @property
    def ratio_explained(self) -> float | None:
        """(compiled - bytes attributed to named causes) / minimum."""
        return _ratio(self.compiled_bytes - sum(self.exceptions.values()), self.minimum_bytes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "label": self.label,
            "phase": self.phase.value,
            "program": self.name,
            "compiled_bytes": self.compiled_bytes,
            "minimum_bytes": self.minimum_bytes,
            "ratio": _json_ratio(self.ratio),
            "ratio_explained": _json_ratio(self.ratio_explained),
            "exceptions": self.exceptions,
            "causes": {k: CAUSES[k] for k in self.exceptions},
            "trip_counts_known": self.trip_counts_known,
            "moe_exchange": self.moe_exchange,
            "rows": [r.to_dict() for r in self.rows],
            "model": self.model.to_dict(),
        }

    def to_rich_table(self, title: str | None = None) -> Table:
        """A ``rich.table.Table``: one row per group, then the total."""
        from rich.table import Table

        table = Table(
            title=title
            or f"{self.label} {self.name}: collectives, compiled "
            "vs minimum (bytes per device per step)",
            title_justify="left",
        )
        for header in (
            "kind",
            "mesh axes",
            "module",
            "step",
            "count",
            "compiled",
            "minimum",
            "ratio",
            "cause",
        ):
            right = header in ("count", "compiled", "minimum", "ratio")
            table.add_column(header, justify="right" if right else "left")
        for r in self.rows:
            axes = UNMAPPED if r.axes is None else (",".join(r.axes) or "-")
            table.add_row(
                r.kind,
                axes,
                r.module or "-",
                ", ".join(r.steps) or "-",
                f"{r.compiled_count}/{r.minimum_count}",
                f"{r.compiled_bytes:,}",
                f"{r.minimum_bytes:,}",
                format_ratio(r.ratio),
                f"[yellow]{r.cause}[/]" if r.cause else "",
            )
        table.add_row(
            "[bold]total[/]",
            "",
            "",
            "",
            "",
            f"[bold]{self.compiled_bytes:,}[/]",
            f"[bold]{self.minimum_bytes:,}[/]",
            f"[bold]{format_ratio(self.ratio)}[/]",
            "",
        )
        return table


def format_ratio(ratio: float | None) -> str:
    """``1.00``, ``inf`` or ``-`` (nothing compiled and nothing needed)."""
    if ratio is None:
        return "-"
    return "inf" if ratio == math.inf else f"{ratio:.2f}"


def collective_report(
    compiled: Any,
    mesh: MeshLike,
    model: CommModel,
    *,
    label: str | None = None,
    cache_dims: tuple[int, int] | None = None,
) -> CollectiveReport:
    """Builds the report of a compiled program against its analytic model.

    Args:
        compiled: ``jax.stages.Compiled``, its text, or parsed :class:`Collective` records.
        mesh: the mesh it was compiled for.
        model: :func:`communication_model` of the same strategy and phase.
        label: a name for tables (default: the strategy).
        cache_dims: ``(max_seq_len, head_dim)`` so cache-sized traffic is recognised.
    """
    collectives = compiled if isinstance(compiled, list) else parse_collectives(compiled)
    itemsize = model.items[0].itemsize if model.items else 4
    expected = model.by_key()
    groups = _group(collectives, mesh, expected)
    keys = list(expected) + [k for k in groups if k not in expected]
    cfg = model.config
    runs = (
        (cfg.microbatches if model.phase is Phase.PREFILL else cfg.decode_groups)
        if cfg.pp > 1
        else 1
    )
    bubble = (runs + cfg.pp - 1) / runs
    rows = [
        _row(k, groups.get(k, []), expected.get(k, []), model.phase, itemsize, cache_dims, bubble)
        for k in keys
    ]
    rows.sort(key=lambda r: (r.kind, r.axes is None, r.axes or (), r.module or "~"))
    return CollectiveReport(
        label=label or str(model.config),
        phase=model.phase,
        rows=tuple(rows),
        model=model,
        trip_counts_known=all(c.trip_count is not None for c in collectives),
    )


def _group(collectives, mesh, expected) -> dict[Key, list[Collective]]:
    """Collectives by key; one outside every module scope may fill a needed group.

    Transformations (e.g. a pipeline's vmap) can drop the named scope from ``op_name``;
    such a collective joins a needed group of the same kind and axes that it fits into.
    """
    groups: dict[Key, list[Collective]] = {}
    for c in collectives:
        axes = collective_axes(c, mesh)
        if c.kind == "all-reduce" and axes:  # a sum does not depend on the order of ids
            axes = tuple(a for a in mesh.axis_names if a in axes)
        key = (c.kind, axes, module_of(c.op_name))
        if key not in expected and key[2] is None:
            for want, items in expected.items():
                have = sum(x.bytes * (x.trip_count or 1) for x in groups.get(want, []))
                need = sum(item.bytes for item in items)
                if want[:2] == key[:2] and have + c.bytes * (c.trip_count or 1) <= need:
                    key = want
                    break
        groups.setdefault(key, []).append(c)
    return groups


def _row(key, members: list[Collective], items, phase, itemsize, cache_dims, bubble) -> ReportRow:
    compiled = sum(c.bytes * (c.trip_count or 1) for c in members)
    minimum = sum(item.bytes for item in items)
    causes: dict[str, int] = {}
    if minimum and TOLERANCE * minimum < compiled <= TOLERANCE * bubble * minimum:
        causes = {"pp-bubble": compiled - minimum}
    elif compiled > TOLERANCE * minimum:
        for c in members:
            cause = classify(c, phase, itemsize=itemsize, cache_dims=cache_dims)
            causes[cause] = causes.get(cause, 0) + c.bytes * (c.trip_count or 1)
        if minimum:  # the excess of a needed group goes to its dominant cause
            causes = {max(causes, key=causes.__getitem__): compiled - minimum}
    return ReportRow(
        kind=key[0],
        axes=key[1],
        module=key[2],
        compiled_bytes=compiled,
        compiled_count=sum(c.trip_count or 1 for c in members),
        minimum_bytes=minimum,
        minimum_count=sum(item.count for item in items),
        causes=causes,
        steps=tuple(dict.fromkeys(item.step for item in items)),
    )


#: What :func:`moe_exchange` reports, by what the compiled program contains.
MOE_EXCHANGES: dict[str, str] = {
    "ragged": "ragged-all-to-all of the routed rows (GPU/TPU), grouped expert matmul",
    "padded": "all-to-all of capacity-sized blocks per expert peer, grouped expert matmul",
    "local": "every expert on every device holding tokens (no expert peers), grouped matmul",
}


def moe_exchange(collectives: list[Collective]) -> str:
    """``"ragged"``, ``"padded"`` or ``"local"``: how a compiled MoE program moves rows."""
    from jaxpar.models import EXPERT_ROWS_SCOPE

    if any(c.kind == "ragged-all-to-all" for c in collectives):
        return "ragged"
    in_rows = (EXPERT_ROWS_SCOPE in (c.op_name or "").split("/") for c in collectives)
    kinds = (c.kind for c in collectives)
    if any(inside and kind == "all-to-all" for inside, kind in zip(in_rows, kinds, strict=True)):
        return "padded"
    return "local"


def compile_step(
    engine: Any,
    phase: Phase | str,
    *,
    prompt_len: int,
    rows: int | None = None,
    context_len: int | None = None,
) -> Any:
    """Compiles the engine's prefill or decode step, or one of its serving programs
    (:data:`jaxpar.engine.SERVING_PROGRAMS`: ``rows`` rows, ``context_len`` cached
    positions), for abstract inputs (nothing runs).

    ``engine`` is a :class:`jaxpar.engine.InferenceEngine` or
    :class:`jaxpar.engine.AbstractEngine` (anything with their ``lower(phase,
    prompt_len=)``); inputs are ``ShapeDtypeStruct`` in the step's own shardings, so
    nothing is allocated beyond the parameters the engine already holds.
    """
    if rows is None and context_len is None:
        return engine.lower(phase, prompt_len=prompt_len).compile()
    return engine.lower(phase, prompt_len=prompt_len, rows=rows, context_len=context_len).compile()


def phase_report(
    engine: Any,
    phase: Phase | str,
    *,
    prompt_len: int,
    label: str | None = None,
    rows: int | None = None,
    context_len: int | None = None,
) -> tuple[CollectiveReport, Any]:
    """Compiles one program of ``engine`` and reports it against the analytic model.

    Args:
        engine: an :class:`~jaxpar.engine.AbstractEngine` (or an inference engine, for
            the offline steps).
        phase: ``"prefill"``/``"decode"`` (the offline steps) or a serving program
            (:data:`jaxpar.engine.SERVING_PROGRAMS`: what ``jaxpar serve`` runs).
        prompt_len: new tokens per row (prefill programs, insert).
        label: a name for tables (default: the strategy).
        rows: rows of a serving program (default the engine's ``max_batch``).
        context_len: cached positions of ``serve_prefill_context`` (default
            ``prompt_len``, whole pages).

    Returns:
        ``(report, compiled)``; ``compiled.memory_analysis()`` gives per-device memory.
    """
    from jaxpar.engine import SERVING_PROGRAMS, program_phase
    from jaxpar.inspect._model import communication_model
    from jaxpar.models import ModelRun

    program = phase if isinstance(phase, str) and phase in SERVING_PROGRAMS else None
    config = ModelRun(engine.model_config, engine.options)  # true vocabulary, run's MoE
    context = 0
    if program == "serve_prefill_context":
        z = engine.serving.pool.page_size
        context = -(-(context_len or prompt_len) // z) * z
    compiled = compile_step(
        engine,
        phase,
        prompt_len=prompt_len,
        rows=rows if program else None,
        context_len=context or None,
    )
    model = communication_model(
        config,
        engine.parallel_config,
        program_phase(phase),
        batch=(rows or engine.max_batch) if program else engine.max_batch,
        prompt_len=prompt_len,
        program=program,
        context_len=context,
    )
    collectives = parse_collectives(compiled)
    report = collective_report(
        collectives,
        engine.mesh,
        model,
        label=label,
        cache_dims=(engine.max_seq_len, config.head_dim),
    )
    report = dataclasses.replace(report, program=program)
    if config.is_moe:
        report = dataclasses.replace(report, moe_exchange=moe_exchange(collectives))
    return report, compiled
