"""``jaxpar explain``: what every tensor, module and collective does under a strategy.

Works from shapes only: the model's parameters are abstract (``ShapeDtypeStruct``), the
steps are lowered and compiled for abstract inputs, nothing is allocated, so it also
explains llama-1b on a laptop. Per phase it shows each tensor's logical axes,
``PartitionSpec`` and bytes per device, each module's table rows (status, sync point,
source document), the analytic minimum of communication beside the compiled collectives,
and the per-layer sequence of compute and communication steps (text, optionally DOT).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from jaxpar.cli._common import model_config, parallel_config
from jaxpar.cli._groups import DeviceGroup, describe_groups, device_groups, handoff
from jaxpar.cli._progress import stage
from jaxpar.engine import (
    AbstractEngine,
    batch_shards,
    kv_cache_tokens_for,
    pages_per_shard,
    run_form,
    sequence_pages,
)
from jaxpar.inspect import (
    CAUSES,
    MOE_EXCHANGES,
    communication_model,
    execution_steps,
    phase_report,
    serving_report,
    serving_table,
)
from jaxpar.models import (
    KV_CACHE_DTYPES,
    KV_SCORE_AXES,
    Q_AXES,
    STACKED_PAGE_AXES,
    KVCache,
    ModelConfig,
    ModelRun,
    abstract_model,
    element_bytes,
    kv_positions,
)
from jaxpar.spec import (
    Module,
    ParallelConfig,
    Phase,
    Plan,
    describe_layout,
    mesh_axes,
    param_partition_spec,
    partition_spec,
    validate,
)


def _compile_note(args: argparse.Namespace, group: DeviceGroup) -> str | None:
    """Why no program is compiled (the analytic model is shown instead), or None."""
    if args.no_compile:
        return "skipped (--no-compile)"
    if group.end > jax.device_count():
        return (
            f"{group.parallel} on devices {group.first}..{group.end - 1} needs {group.end} "
            f"devices, {jax.device_count()} available (on CPU raise --cpu-devices)"
        )
    return None


def _per_device(shape, spec, config: ParallelConfig, itemsize: float) -> int:
    split = math.prod(
        config.degree(a) for e in spec if e for a in ((e,) if isinstance(e, str) else e)
    )
    return int(math.prod(shape) * itemsize // split)


def _spec_text(spec) -> str:
    return (
        "P("
        + ", ".join(
            "None" if e is None else (e if isinstance(e, str) else "(" + ",".join(e) + ")")
            for e in spec
        )
        + ")"
    )


def parameter_rows(config: ModelConfig, parallel: ParallelConfig) -> list[dict[str, Any]]:
    """Every parameter: logical axes, its one PartitionSpec (both phases), bytes per device.

    Per-layer parameters (``layer_loop="unrolled"``) are one row each, named
    ``layers.*.<rest>``, with one layer's shape, ``count`` layers in the model and the bytes
    of the ``layers_per_device`` a device holds: under pp a device holds only its stage's
    ``count / pp`` layers. K/V tensors have the run's heads: each checkpoint head repeated
    for its group of tp devices when tp is a multiple of them (rule kv-head-replicas).
    """
    config = ModelRun.of(config).with_kv_heads_for(parallel)
    rows: dict[str, dict[str, Any]] = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(config))):
        value, axes = var.get_value(), tuple(var.get_metadata()["out_sharding"])
        spec = param_partition_spec(axes, parallel, dims=config)
        per_layer = len(path) > 1 and path[0] == "layers" and isinstance(path[1], int)
        name = ".".join(map(str, ("layers", "*", *path[2:]) if per_layer else path))
        nbytes = _per_device(value.shape, spec, parallel, element_bytes(value.dtype))
        if name in rows:
            rows[name]["count"] += 1
            rows[name]["bytes_per_device"] += nbytes
            continue
        rows[name] = {
            "tensor": name,
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "count": 1,
            "logical_axes": list(axes),
            "spec": _spec_text(spec),
            "bytes_per_device": nbytes,
            **({"layers_per_device": 1} if per_layer else {}),
        }
    for row in rows.values():
        if "layers_per_device" in row:  # a stage's layers per device (pipeline stages)
            row["layers_per_device"] = -(-row["count"] // parallel.pp)
            row["bytes_per_device"] = (
                row["bytes_per_device"] // row["count"] * (row["layers_per_device"])
            )
    return list(rows.values())


def tensor_rows(
    config: ModelConfig,
    parallel: ParallelConfig,
    phase: Phase,
    *,
    batch: int,
    prompt_len: int,
    max_seq_len: int,
    page_size: int = 16,
    kv_cache_tokens: int | None = None,
) -> list[dict[str, Any]]:
    """The KV cache and the main activations of ``phase`` in the layouts the model applies.

    Decode's cache is the page pool continuous batching and (unpipelined) ``generate`` run
    on, ``kv_cache_tokens`` (default: what ``batch`` sequences of ``max_seq_len`` hold,
    ``batch * max_seq_len`` tokens less the pages before sliding windows, which served
    rows give back: :func:`~jaxpar.engine.kv_cache_tokens_for`) in pages of ``page_size``,
    with the rows' block tables; pipelined decode keeps the contiguous ``[L, B, S, K, H]``.
    """
    config = ModelRun.of(config).with_kv_heads_for(parallel)  # the run's K/V heads
    c, t = config, prompt_len if phase is Phase.PREFILL else 1
    size, name_of = c.dtype.itemsize, c.dtype.name
    # Decode's cache as stored: int8/fp8 values plus one float32 scale per token per kv head
    # (``--kv-cache-dtype``); prefill's K/V leave the step in the compute dtype.
    kv = getattr(c, "kv_cache_dtype", None)
    kv_dtype = np.dtype(KV_CACHE_DTYPES[kv]) if kv else c.dtype
    # What the cache keeps per token and kv head: K and V of head_dim each, or (MLA) the
    # shared RoPE key and the compressed latent, one "head" (no head axis to split).
    parts = (
        [("K and V each", c.head_dim)]
        if not c.is_mla
        else [("MLA RoPE key", c.cache_kv_dims[0]), ("MLA latent", c.cache_kv_dims[1])]
    )
    if phase is Phase.PREFILL or parallel.pp > 1:
        cache_len = prompt_len if phase is Phase.PREFILL else max_seq_len
        cache_dtype = c.dtype if phase is Phase.PREFILL else kv_dtype
        shape = (c.n_layers, batch, cache_len, c.n_kv_heads, c.head_dim)
        table = [
            (
                f"KV cache ({what})",
                Module.ATTENTION,
                KVCache.KV_AXES,
                (c.n_layers, batch, cache_len, c.n_kv_heads, width),
                cache_dtype.itemsize,
                cache_dtype.name,
            )
            for what, width in parts
        ]
        scale_axes, scale_shape = KVCache.KV_AXES, shape
    else:
        shards = batch_shards(parallel, c)
        # Tokens of every layer; with KV groups a page holds one group's layers (positions).
        tokens = kv_cache_tokens or kv_cache_tokens_for(c, batch, max_seq_len, page_size)
        positions = kv_positions(c)
        pages = shards * pages_per_shard(
            math.ceil(tokens * c.n_layers / positions), page_size, shards
        )
        need = sequence_pages(c, max_seq_len, page_size)
        scale_axes = STACKED_PAGE_AXES
        scale_shape = (positions, c.n_kv_heads, pages, page_size, c.head_dim)
        held = " + ".join(
            f"{g.pages}" + (f" ({g.window}-token window)" if g.window else "") for g in need
        )
        table = [
            (
                f"KV page pool ({what}; {pages} pages incl. {shards} scratch; "
                f"a sequence of {max_seq_len} holds {held} pages)",
                Module.ATTENTION,
                STACKED_PAGE_AXES,
                (positions, c.n_kv_heads, pages, page_size, width),
                kv_dtype.itemsize,
                kv_dtype.name,
            )
            for what, width in parts
        ]
        table += [
            (
                "block tables (page ids per row"
                + (f", one table per KV group: {len(need)})" if len(need) > 1 else ")"),
                Module.ATTENTION,
                ("batch", None) if len(need) == 1 else (None, "batch", None),
                (batch, -(-max_seq_len // page_size))
                if len(need) == 1
                else (len(need), batch, -(-max_seq_len // page_size)),
                4,
                "int32",
            ),
        ]
    if kv and phase is Phase.DECODE:
        table.insert(
            1,
            (
                "KV cache scales (K and V each; per token per kv head)",
                Module.ATTENTION,
                (*scale_axes[:-1], None),
                (*scale_shape[:-1], 1),
                4,
                "float32",
            ),
        )
    table += [
        ("tokens", Module.EMBEDDING, ("batch", "seq"), (batch, t), 4, "int32"),
        (
            "hidden x",
            Module.ATTENTION,
            ("batch", "seq", "embed"),
            (batch, t, c.d_model),
            size,
            name_of,
        ),
        ("queries", Module.ATTENTION, Q_AXES, (batch, t, c.n_heads, c.head_dim), size, name_of),
    ]
    if phase is Phase.PREFILL:
        table += [
            (
                "K/V for scores" if not c.is_mla else f"{what} for scores",
                Module.ATTENTION,
                KV_SCORE_AXES,
                (batch, t, c.n_kv_heads, width),
                size,
                name_of,
            )
            for what, width in parts
        ]
    if not c.is_moe:
        table.append(
            ("FFN hidden", Module.FFN, ("batch", "seq", "mlp"), (batch, t, c.d_ff), size, name_of)
        )
    table.append(
        (
            "logits (last position)" if phase is Phase.PREFILL else "logits",
            Module.LM_HEAD,
            ("batch", "vocab"),
            (batch, c.vocab_size),
            4,
            "float32",
        )
    )
    rows = []
    for name, module, axes, shape, itemsize, dtype in table:
        spec = partition_spec(axes, module, phase, parallel, dims=config)
        rows.append(
            {
                "tensor": name,
                "module": module.value,
                "shape": list(shape),
                "dtype": dtype,
                "logical_axes": [a or "-" for a in axes],
                "spec": _spec_text(spec),
                "bytes_per_device": _per_device(shape, spec, parallel, itemsize),
            }
        )
    return rows + (moe_rows(config, parallel, phase, batch=batch, tokens=t) if c.is_moe else [])


def moe_rows(
    config: ModelConfig, parallel: ParallelConfig, phase: Phase, *, batch: int, tokens: int
) -> list[dict[str, Any]]:
    """The MoE's per-device buffers (inside its ``shard_map``: local shapes, no spec).

    A device's n tokens are one dispatch group; it sends each of its P expert peers a block
    of C rows (:meth:`ModelRun.expert_capacity`) and receives as many.
    """
    axes = mesh_axes(Module.MOE, phase, parallel, dims=config)
    split = math.prod(parallel.degree(a) for a in (*axes["batch"], *axes["seq"]))
    n = batch * tokens // split
    peers = math.prod(parallel.degree(a) for a in axes["experts"])
    cap = config.expert_capacity(n, peers)
    f_l = config.d_ff // math.prod(parallel.degree(a) for a in axes["mlp"])
    size = config.dtype.itemsize
    local = "local (shard_map)"
    return [
        {
            "tensor": f"MoE rows sent / received (n={n}, P={peers}, C={cap})",
            "module": Module.MOE.value,
            "shape": [peers * cap, config.d_model],
            "dtype": config.dtype.name,
            "logical_axes": ["-", "embed"],
            "spec": local,
            "bytes_per_device": peers * cap * config.d_model * size,
        },
        {
            "tensor": f"MoE expert hidden (routed rows: top_k x n = {config.moe.top_k * n})",
            "module": Module.MOE.value,
            "shape": [peers * cap, f_l],
            "dtype": config.dtype.name,
            "logical_axes": ["-", "mlp"],
            "spec": local,
            "bytes_per_device": peers * cap * f_l * size,
        },
    ]


def kv_head_rows(config: ModelConfig, groups: dict[Phase, DeviceGroup]) -> dict[str, int]:
    """The checkpoint's K/V heads, the copies of each the (decode) strategy holds and the
    heads it runs (rule kv-head-replicas; with ``--prefill``, the prefill group's too)."""
    out = {}
    for phase in (Phase.DECODE, Phase.PREFILL):
        run = ModelRun.of(config).with_kv_heads_for(groups[phase].parallel)
        if phase is Phase.PREFILL and groups[phase] == groups[Phase.DECODE]:
            break
        prefix = "" if phase is Phase.DECODE else "prefill_"
        out |= {
            f"{prefix}n_kv_heads": run.config.n_kv_heads,
            f"{prefix}replicas": run.kv_head_replicas,
            f"{prefix}run_kv_heads": run.n_kv_heads,
        }
    return out


def _kv_head_note(data: dict[str, Any]) -> str | None:
    r = data["kv_head_replicas"]
    if r["replicas"] == 1:
        return None
    return (
        f"K/V heads by groups (rule kv-head-replicas): the checkpoint's {r['n_kv_heads']} K/V "
        f"heads are held {r['replicas']} times each ({r['run_kv_heads']} run heads, split over "
        f"tp): every device holds the one K/V head its query heads read, replicated only "
        f"within its group of {r['replicas']} devices"
    )


def module_rows(plan: Plan, phase: Phase) -> list[dict[str, Any]]:
    """Per module and active primitive: the table row, why, its sync point, and where the
    row is written (file and key under ``sharding_specs/``)."""
    return [
        {
            "module": a.module.value,
            "primitive": f"{a.primitive.value}={a.degree}",
            "status": a.status.value,
            "splits": list(a.splits) or ["-"],
            "sync": a.sync or "-",
            "row": a.row,
            "source": f"sharding_specs/{a.module.value}.toml [{a.primitive.value}]",
        }
        for a in plan.for_phase(phase)
        if a.degree > 1
    ]


def _modules_table(phase: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=f"{phase}: modules (spec table rows)", title_justify="left")
    for col in ("module", "primitive", "status", "splits", "table row / sync point / source"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["module"],
            r["primitive"],
            r["status"],
            ", ".join(r["splits"]),
            f"{escape(r['row'])}\n[cyan]sync[/]: {escape(r['sync'])}\n[dim]{r['source']}[/]",
        )
    return table


def to_dot(phases: dict[str, list[dict[str, str]]]) -> str:
    """Graphviz DOT of the execution sequences: compute boxes, communication in orange."""
    lines = ["digraph jaxpar {", "  rankdir=TB; node [shape=box, fontsize=10];"]
    for phase, steps in phases.items():
        lines.append(f'  subgraph cluster_{phase} {{ label="{phase}";')
        sections: dict[str, list[int]] = {}
        for i, s in enumerate(steps):
            sections.setdefault(s["section"], []).append(i)
        for k, (section, ids) in enumerate(sections.items()):
            lines.append(f'    subgraph cluster_{phase}_{k} {{ label="{section}"; style=dashed;')
            for i in ids:
                style = ', style=filled, fillcolor="#ffcc80"' if steps[i]["kind"] == "comm" else ""
                text = steps[i]["text"].replace('"', "'")
                lines.append(f'      {phase}_{i} [label="{text}"{style}];')
            lines.append("    }")
        lines += [f"    {phase}_{i} -> {phase}_{i + 1};" for i in range(len(steps) - 1)]
        layer = next(
            (ids for section, ids in sections.items() if section.startswith("layer")), None
        )
        if layer:  # the scan runs the layer block again for every layer
            lines.append(
                f'    {phase}_{layer[-1]} -> {phase}_{layer[0]} [style=dashed, label="next layer"];'
            )
        lines.append("  }")
    return "\n".join([*lines, "}"]) + "\n"


def _config_of(args: argparse.Namespace) -> ModelRun:
    return model_config(args)  # --hf: config.json only (shapes), no tensor is read


def _json_fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields for JSON: dtypes by name."""
    return {
        k: (str(v) if k in ("dtype", "param_dtype") and v is not None else v)
        for k, v in dataclasses.asdict(obj).items()
    }


def explain(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``jaxpar explain`` shows, as a JSON-ready dict.

    With ``--prefill STRATEGY`` (disaggregated serving) the prefill phase is explained under
    that strategy on its own device group, the decode phase under the degree flags, and
    the K/V handoff between the groups is added (``"disaggregated"``).
    """
    config = _config_of(args)
    groups = device_groups(parallel_config(args), getattr(args, "prefill", None))
    phases = [Phase.PREFILL, Phase.DECODE] if args.phase == "both" else [Phase.coerce(args.phase)]
    decode = groups[Phase.DECODE]
    out: dict[str, Any] = {
        # The architecture (config.json's) and the options this explanation runs it under.
        "model": _json_fields(config.config),
        "options": _json_fields(config.options),
        "strategy": describe_groups(groups),
        "degrees": dict(zip(("dp", "pp", "sp", "ep", "tp"), decode.parallel.shape, strict=True)),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "max_seq_len": args.max_seq_len,
        "kv_head_replicas": kv_head_rows(config, groups),
        "parameters": parameter_rows(config, decode.parallel),
        "phases": {},
    }
    engines: dict[DeviceGroup, AbstractEngine | None] = {}
    for phase in phases:
        group = groups[phase]
        parallel = group.parallel
        plan = validate(
            run_form(config, parallel),
            parallel,
            n_devices=parallel.size,
            batch=args.batch,
            max_seq_len=args.max_seq_len,
        )
        note = _compile_note(args, group)
        if group not in engines:
            engines[group] = None if note else group.abstract_engine(config, args)
        out["compiled"], out["compiled_note"] = engines[group] is not None, note
        out["phases"][phase.value] = _phase(args, config, group, plan, phase, engines[group])
    if groups[Phase.PREFILL] != decode:
        out["disaggregated"] = handoff(config, groups, batch=args.batch, prompt_len=args.prompt_len)
    if getattr(args, "programs", "all") != "offline":
        out["serving"], out["_serving_rows"] = _serving(args, config, groups, engines)
    return out


def _serving(args, config, groups, engines) -> tuple[dict[str, Any], list]:
    """The serving programs of the decode group: compiled against the minimum, or the
    analytic model alone (``--no-compile``, too few devices)."""
    from jaxpar.engine import SERVING_PROGRAMS, program_phase

    decode = groups[Phase.DECODE]
    if groups[Phase.PREFILL] != decode:
        return {"note": "disaggregated: serving programs are reported per group by serve"}, []
    if decode.parallel.pp > 1:
        return {
            "note": f"pp={decode.parallel.pp}: pipelined serving programs are not reported here"
        }, []
    engine = engines.get(decode) if decode in engines else decode.abstract_engine(config, args)
    if engine is None:
        models = {
            p: communication_model(
                config,
                decode.parallel,
                program_phase(p),
                batch=args.batch,
                prompt_len=args.prompt_len,
                program=p,
                context_len=args.prompt_len,
            ).to_dict()
            for p in SERVING_PROGRAMS
        }
        return {"note": _compile_note(args, decode), "models": models}, []
    rows = serving_report(engine, prompt_len=args.prompt_len, label=str(decode.parallel))
    return {"programs": [r.to_dict() for r in rows]}, rows


def _phase(args, config, group, plan, phase, engine) -> dict[str, Any]:
    parallel = group.parallel
    model = communication_model(
        config, parallel, phase, batch=args.batch, prompt_len=args.prompt_len
    )
    report = None
    if engine is not None:
        report = phase_report(engine, phase, prompt_len=args.prompt_len, label=str(parallel))[0]
    return {
        "strategy": str(parallel),
        "devices": list(group.devices),
        # TPU: what each mesh axis spans on the chips (None off TPU or uncompiled).
        "layout": describe_layout(engine.mesh) if engine is not None else None,
        "tensors": tensor_rows(
            config,
            parallel,
            phase,
            batch=args.batch,
            prompt_len=args.prompt_len,
            max_seq_len=args.max_seq_len,
            page_size=getattr(args, "page_size", 16),
            kv_cache_tokens=getattr(args, "kv_cache_tokens", None),
        ),
        "modules": module_rows(plan, phase),
        "collectives": report.to_dict() if report else {"model": model.to_dict()},
        "execution": execution_steps(config, model),
        "_report": report,
        "_model": model,
    }


def _cell(column: str, value: Any) -> str:
    if isinstance(value, list):
        return (
            "x".join(map(str, value)) if column == "shape" else escape(", ".join(map(str, value)))
        )
    return f"{value:,}" if isinstance(value, int) else escape(str(value))


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(
            col.replace("_", " "), justify="right" if col.startswith("bytes") else "left"
        )
    for row in rows:
        table.add_row(*(_cell(col, row[col]) for col in columns))
    return table


def _print_report(console: Console, report: Any) -> None:
    """The compiled-vs-minimum table, the MoE exchange compiled, the causes of excess."""
    console.print(report.to_rich_table())
    if report.moe_exchange:
        how = report.moe_exchange
        console.print(f"[cyan]MoE exchange compiled[/]: {how}: {MOE_EXCHANGES[how]}")
    for cause, nbytes in report.exceptions.items():
        console.print(
            f"[yellow]above the minimum[/]: {cause} ({nbytes:,} B): {escape(CAUSES[cause])}"
        )


def run_explain(args: argparse.Namespace, console: Console) -> int:
    """Entry point of the ``explain`` subcommand."""
    what = (
        "analytic model" if args.no_compile else "lower and compile the steps (abstract parameters)"
    )
    with stage(Console(stderr=True) if args.json else console, what):  # stdout stays JSON
        data = explain(args)
    if not console.is_terminal:  # piped or captured: wide enough for the tables
        console = Console(width=160)
    # Keys starting with "_" hold the report objects behind the tables; JSON shows the rest.
    public = {
        p: {k: v for k, v in d.items() if not k.startswith("_")} for p, d in data["phases"].items()
    }
    if args.dot:
        Path(args.dot).write_text(to_dot({p: d["execution"] for p, d in data["phases"].items()}))
    serving_rows = data.pop("_serving_rows", [])
    if args.json:
        print(json.dumps({**data, "phases": public}, indent=1))
        return 0
    console.print(
        f"[bold]jaxpar explain[/]: {args.hf or args.model or args.default_model}, strategy "
        f"{data['strategy']}, batch {args.batch}, prompt {args.prompt_len}, cache {args.max_seq_len}"
    )
    console.print(
        _table(
            "parameters (one layout for both phases)",
            data["parameters"],
            ["tensor", "count", "shape", "dtype", "logical_axes", "spec", "bytes_per_device"],
        )
    )
    if note := _kv_head_note(data):
        console.print(f"[dim]{escape(note)}[/]")
    for phase, d in data["phases"].items():
        _print_phase(console, phase, d, data["compiled_note"])
    _print_handoff(console, data.get("disaggregated"))
    _print_serving(console, data.get("serving"), serving_rows)
    if args.dot:
        console.print(f"DOT graph written to {args.dot}")
    return 0


def _print_phase(console: Console, phase: str, d: dict[str, Any], compiled_note: str) -> None:
    """One phase's tables: its tensors, modules, collectives and execution steps."""
    console.rule(f"[bold]{phase}")
    if d.get("layout"):
        console.print(f"[bold]layout[/]: {escape(d['layout'])}", highlight=False)
    console.print(
        _table(
            f"{phase}: tensors",
            d["tensors"],
            ["tensor", "module", "shape", "dtype", "logical_axes", "spec", "bytes_per_device"],
        )
    )
    console.print(_modules_table(phase, d["modules"]))
    if d["_report"] is not None:
        _print_report(console, d["_report"])
    else:
        console.print(
            _table(
                f"{phase}: expected collectives ({compiled_note})",
                [i.to_dict() for i in d["_model"].items],
                ["kind", "axes", "module", "step", "shape", "count", "bytes", "why"],
            )
        )
    for note in d["_model"].notes:
        console.print(f"[dim]{escape(note)}[/]")
    console.print(f"[bold]{phase}: execution[/]")
    for s in d["execution"]:
        kind = "[yellow]comm   [/]" if s["kind"] == "comm" else "compute"
        console.print(f"  {kind} [dim]{s['section']:<16}[/] {escape(s['text'])}", highlight=False)


def _print_serving(console: Console, d: dict[str, Any] | None, rows: list) -> None:
    """The serving programs: one summary table, then each program's collectives."""
    if d is None:
        return
    console.rule("[bold]serving (what `jaxpar serve` runs)")
    if rows:
        console.print(serving_table(rows))
        for row in rows:
            _print_report(console, row.report)
        return
    if "models" in d:
        console.print(f"serving programs: analytic minimum only ({d['note']})")
        for program, model in d["models"].items():
            console.print(f"  {program}: {model['total_bytes']:,} B per device per run")
        return
    console.print(f"[dim]{escape(d['note'])}[/]")


def _print_handoff(console: Console, d: dict[str, Any] | None) -> None:
    if d is None:
        return
    console.rule("[bold]prefill -> decode handoff")
    for role, g in d["groups"].items():
        devices = g["devices"]
        console.print(f"  {role:<8} {g['strategy']:<24} devices {devices[0]}-{devices[-1]}")
    t = d["transfer"]
    console.print(
        f"  moves {escape(t['what'])}: {t['bytes_per_batch']:,} B per prefilled batch "
        f"({t['bytes_per_request']:,} B per request), {t['from_spec']} -> {t['to_spec']}, "
        f"{t['when']}",
        highlight=False,
    )
