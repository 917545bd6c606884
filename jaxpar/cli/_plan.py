"""``jaxpar plan``: the prefill and decode strategies for a model, a cluster and a workload.

Analytic: nothing is compiled or allocated, so a plan for 2 x 8 H100 or a TPU v5e-16 is
made on a laptop (``--compile`` then compiles the plans shown for their TPU slice,
compile-only, and prints the bytes per device XLA gives them). Prints the top plans with their breakdown, why the best wins and the
command line that runs it; ``--json`` prints everything; ``--picture`` draws the best plan.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from jaxpar.cli._common import model_config
from jaxpar.plan import (
    KINDS,
    OBJECTIVES,
    Bounds,
    Planning,
    Prediction,
    Workload,
    duration,
    load_hardware,
    placement,
    plan,
    run_flags,
    serve_flags,
    why,
)


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, required=True, help="devices in the cluster")
    parser.add_argument(
        "--hosts",
        type=int,
        default=None,
        help="fast-link domains the devices are spread over evenly (GPU hosts, TPU slices); "
        "default: as few as the hardware's domain size allows",
    )
    parser.add_argument(
        "--topology",
        default=None,
        metavar="AxB[xC]",
        help="TPU: one slice's torus shape (e.g. 4x4, 4x4x4); default: Cloud TPU's slice "
        "of --devices chips (or of devices / --hosts), from the hardware file",
    )
    parser.add_argument(
        "--hardware",
        required=True,
        metavar="KIND",
        help=f"device kind ({', '.join(KINDS)}) or a .toml file in the same form",
    )
    parser.add_argument(
        "--hw",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a hardware figure, e.g. hbm_gib=24, peak_tflops.bfloat16=900, "
        "fast_link.gbps=400 (repeatable)",
    )
    parser.add_argument("--batch", type=int, required=True, help="sequences per step")
    parser.add_argument("--prompt-len", type=int, required=True, help="padded prompt tokens")
    parser.add_argument("--gen-len", type=int, required=True, help="tokens generated per sequence")
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="latency",
        help="latency: one batch's request time (jaxpar run); throughput: tokens/s of a "
        "server (jaxpar serve), its batch grown while it fits; cost: device-seconds per token "
        "(default latency)",
    )
    parser.add_argument(
        "--max-ttft-ms",
        type=float,
        default=None,
        metavar="MS",
        help="serving: the longest predicted time to first token a plan may have",
    )
    parser.add_argument(
        "--max-tpot-ms",
        type=float,
        default=None,
        metavar="MS",
        help="serving: the longest predicted time per output token a plan may have",
    )
    parser.add_argument(
        "--hbm-budget", type=float, default=None, metavar="GiB", help="HBM per device to plan for"
    )
    parser.add_argument("--top", type=int, default=5, help="plans shown (default 5)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--picture", default=None, metavar="FILE", help="draw the best plan (.png or .svg)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="TPU v5e/v6e: compile the plans shown for their slice (compile-only, libtpu) and "
        "print the bytes per device each step needs next to the prediction",
    )
    parser.add_argument(
        "--deploy",
        action="store_true",
        help="print Kubernetes manifests (jaxpar deploy's) serving the best plan on its slice",
    )
    from jaxpar.cli._deploy import add_deploy_options

    add_deploy_options(parser)


def make_plan(args: argparse.Namespace) -> tuple[Any, Planning]:
    model = model_config(args)
    hardware = load_hardware(args.hardware, args.hw).with_hosts(args.devices, args.hosts)
    hardware = hardware.with_topology(getattr(args, "topology", None), args.devices)
    workload = Workload(batch=args.batch, prompt_len=args.prompt_len, gen_len=args.gen_len)
    bounds = Bounds(
        max_ttft_s=None if args.max_ttft_ms is None else args.max_ttft_ms / 1e3,
        max_tpot_s=None if args.max_tpot_ms is None else args.max_tpot_ms / 1e3,
    )
    planning = plan(
        model,
        hardware,
        args.devices,
        workload,
        objective=args.objective,
        hbm_budget_gib=args.hbm_budget,
        bounds=bounds,
    )
    return model, planning


def command(pred: Prediction, args: argparse.Namespace) -> str:
    """The command line that runs ``pred``: ``jaxpar serve`` for a serving or disaggregated
    plan (a preset has no checkpoint: ``--hf DIR`` stands for one of its model), else
    ``jaxpar run``."""
    source = source_flag(args)
    if not (pred.workload.serving or pred.disaggregated):
        return run_flags(pred, source)
    if args.hf is None:
        source = source.replace(f"--model {args.model or 'tiny-dense'}", "--hf DIR")
    return serve_flags(pred, source)


def source_flag(args: argparse.Namespace) -> str:
    """The model flags of the plan's command line (with ``--quantize`` and
    ``--kv-cache-dtype`` when planned so)."""
    source = f"--hf {args.hf}" if args.hf is not None else f"--model {args.model or 'tiny-dense'}"
    quantize = getattr(args, "quantize", None)
    if quantize is not None:
        source = f"{source} --quantize {quantize}"
    if getattr(args, "quantize_embeddings", False):
        source = f"{source} --quantize-embeddings"
    kv = getattr(args, "kv_cache_dtype", None)
    return source if kv is None else f"{source} --kv-cache-dtype {kv}"


def plain(x: float, digits: int = 4) -> str:
    """``x`` to about ``digits`` significant digits, never in scientific notation:
    ``104152``, ``19.66``, ``0.002401``."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def time_unit(seconds: list[float]) -> tuple[float, str]:
    """One unit for a column of durations: that of its largest."""
    top = max(seconds, default=0.0)
    if top < 1e-3:
        return 1e6, "us"
    return (1e3, "ms") if top < 1 else (1.0, "s")


def byte_unit(sizes: list[float]) -> tuple[float, str]:
    """One unit for a column of byte counts: that of its largest."""
    top = max(sizes, default=0.0)
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if top >= scale:
            return scale, unit
    return 1.0, "B"


def _gib(n: float) -> str:
    return plain(n / 2**30, 3)


def _table(planning: Planning, top: int) -> Table:
    shown = planning.ranked[:top]
    serving = planning.serving
    table = Table(
        title=f"top {len(shown)} of {len(planning.ranked)} plans ({planning.objective}"
        f"{', serving' if serving else ''})",
        title_justify="left",
    )
    pre_s, pre_u = time_unit([p.prefill.seconds for p in shown])
    dec_s, dec_u = time_unit([p.decode.seconds for p in shown])
    comm_s, comm_u = byte_unit([p.comm_bytes for p in shown])
    if serving:
        ttft_s, ttft_u = time_unit([p.ttft_s for p in shown])
        tpot_s, tpot_u = time_unit([p.tpot_s for p in shown])
        timing = (f"TTFT ({ttft_u})", f"TPOT ({tpot_u})")
    else:
        req_s, req_u = time_unit([p.request_s for p in shown])
        timing = (f"request ({req_u})",)
    cols = (
        "#",
        "strategy",
        "dev",
        "batch",
        *(("prefill batch",) if serving else ()),
        *timing,
        "tok/s",
        f"prefill ({pre_u}): cmp/hbm/comm",
        f"decode ({dec_u}): cmp/hbm/comm",
        f"comm/req ({comm_u})",
        "GiB/dev: par+kv+rest",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for i, p in enumerate(shown, 1):
        if serving:
            times = (plain(p.ttft_s * ttft_s), plain(p.tpot_s * tpot_s))
            batches = (str(p.workload.batch), str(p.workload.prefill_rows))
        else:
            times = (plain(p.request_s * req_s),)
            batches = (str(p.workload.batch),)
        table.add_row(
            str(i),
            p.label,
            str(p.devices),
            *batches,
            *times,
            f"{p.tokens_per_s:.0f}",
            _phase_cell(p.prefill, pre_s),
            _phase_cell(p.decode, dec_s),
            plain(p.comm_bytes / comm_s, 3),
            _memory_cell(p),
        )
    return table


def _memory_cell(p: Prediction) -> str:
    """``19.7: 7.48+12.0+0.219`` GiB per device (disaggregated: of the decode group)."""
    m = p.memory
    if p.disaggregated:
        total, rest = m.decode_total, m.decode_inputs + m.activations
    else:
        total, rest = m.total, m.activations + m.prompt_kv + m.inputs
    return f"{_gib(total)}: {_gib(m.params)}+{_gib(m.kv_cache)}+{_gib(rest)}"


def _phase_cell(cost, scale: float) -> str:
    """``304: 151/2.45/154``: the step, then compute / HBM / communication, in the
    column's unit."""
    parts = "/".join(plain(x * scale, 3) for x in (cost.compute_s, cost.memory_s, cost.comm_s))
    return f"{plain(cost.seconds * scale, 3)}: {parts}"


def _collectives(pred: Prediction) -> Table:
    table = Table(title=f"collectives per step of {pred.label}", title_justify="left")
    rows = [(cost.phase.value, c) for cost in (pred.prefill, pred.decode) for c in cost.comm]
    b_scale, b_unit = byte_unit([c.bytes for _, c in rows])
    t_scale, t_unit = time_unit([c.seconds for _, c in rows])
    cols = ("phase", "step", "kind", "axes", "link", "n", "algo", "runs")
    for col in (*cols, f"bytes ({b_unit})", f"time ({t_unit})"):
        table.add_column(col, justify="left" if col in ("phase", "step", "kind") else "right")
    for phase, c in rows:
        table.add_row(
            phase,
            c.item.step,
            c.item.kind,
            ",".join(c.item.axes),
            c.link,
            str(c.group),
            c.algorithm,
            str(c.executions),
            plain(c.bytes / b_scale, 3),
            plain(c.seconds * t_scale, 4),
        )
    return table


def to_json(model: Any, planning: Planning, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "objective": planning.objective,
        "devices": planning.devices,
        "hardware": planning.hardware.to_dict(),
        "workload": {
            "batch": planning.workload.batch,
            "prompt_len": planning.workload.prompt_len,
            "gen_len": planning.workload.gen_len,
        },
        "why": why(planning),
        "command": command(planning.best, args),
        "serving": planning.serving,
        "bounds": {
            "max_ttft_s": planning.bounds.max_ttft_s,
            "max_tpot_s": planning.bounds.max_tpot_s,
        },
        "plans": [p.to_dict() for p in planning.ranked[: args.top]],
        "legal": _colocated(planning),
        "fit": len(planning.ranked) - _disaggregated(planning),
        "missed_bounds": len(planning.missed),
        "disaggregated": _disaggregated(planning),
        "refused": [
            {"strategy": str(r.config), "rule": r.rule, "reason": r.reason}
            for r in planning.refused
        ],
        "notes": list(planning.notes),
    }


def layout_line(planning: Planning) -> str:
    """What each axis of the best plan spans on the slice (TPU): ``"slice 4x4: dp=2 over
    y(2 of 4), split, strided; tp=8 over x(4)·y(2 of 4), split, contiguous"``."""
    best = planning.best
    where = placement(planning.hardware, planning.devices)
    head = f"slice {where.slice_name}" if where is not None else "slice"
    if best.prefill_layout is None:
        return f"{head}: {best.layout}"
    return f"{head}: decode {best.layout} | prefill {best.prefill_layout}"


def _disaggregated(planning: Planning) -> int:
    return sum(p.disaggregated for p in planning.ranked)


def _colocated(planning: Planning) -> int:
    return (
        len(planning.ranked) + len(planning.unfit) + len(planning.missed) - _disaggregated(planning)
    )


def run_plan(args: argparse.Namespace, console: Console) -> int:
    model, planning = make_plan(args)
    if args.picture:
        from jaxpar.plan import draw_plan

        draw_plan(model, planning, args.picture)
    if args.json:
        print(json.dumps(to_json(model, planning, args), indent=1))
        return 0
    if not console.is_terminal:  # piped or captured: wide enough for the tables
        console = Console(width=180)
    hw, w = planning.hardware, planning.workload
    console.print(
        f"[bold]{model.arch}[/] on {planning.devices} x {hw.name} ({hw.source}); "
        f"{w.batch} sequences x ({w.prompt_len} prompt + {w.gen_len} new) tokens; "
        f"{_colocated(planning)} legal strategies ({len(planning.unfit)} do not fit in HBM, "
        + (f"{len(planning.missed)} miss the bounds, " if planning.bounds.given else "")
        + f"{len(planning.refused)} refused by the validator"
        + (
            " or the slice's topology"
            if any(r.rule == "topology" for r in planning.refused)
            else ""
        )
        + (" or as pipelines with other than pp groups" if planning.serving else "")
        + "), "
        f"{_disaggregated(planning)} disaggregated prefill | decode splits",
        highlight=False,
    )
    console.print(_table(planning, args.top))
    console.print(_collectives(planning.best))
    console.print(f"[bold]why[/]: {escape(why(planning))}", highlight=False)
    best = planning.best
    if planning.serving:
        console.print(
            f"[bold]serving[/]: {best.label}, {best.workload.batch} slots, prefill batch "
            f"{best.workload.prefill_rows}: TTFT {duration(best.ttft_s)}, TPOT "
            f"{duration(best.tpot_s)}, {best.tokens_per_s:.0f} tokens/s"
            + (f" (bounds: {planning.bounds.describe()})" if planning.bounds.given else ""),
            highlight=False,
        )
    if best.layout is not None:
        console.print(f"[bold]layout[/]: {escape(layout_line(planning))}", highlight=False)
    verb = "serve" if planning.serving or best.disaggregated else "run"
    console.print(f"[bold]{verb}[/]: {escape(command(best, args))}", soft_wrap=True)
    if args.hf is None and verb == "serve":
        console.print(
            "[dim]DIR: a checkpoint of this preset's model (jaxpar serve needs --hf)[/]",
            highlight=False,
        )
    for note in planning.notes:
        console.print(f"[dim]{escape(note)}[/]", highlight=False)
    if args.picture:
        console.print(f"picture: {args.picture}")
    if args.compile:
        console.print(_compiled_table(model, planning, args))
    return 0


def _compiled_table(model: Any, planning: Planning, args: argparse.Namespace) -> Table:
    from jaxpar.cli._plan_compile import COLUMNS, compile_plans, rows

    results = compile_plans(model, planning.ranked[: args.top], args.hardware, args.devices)
    table = Table(title="compiled for the slice (compile-only): bytes per device")
    for name in COLUMNS:
        table.add_column(name)
    for row in rows(results):
        table.add_row(*map(escape, row))
    return table
