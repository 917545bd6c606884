"""``jaxpar plan``: the prefill and decode strategies for a model, a cluster and a workload.

Analytic only: nothing is compiled or allocated, so a plan for 2 x 8 H100 or a TPU v5e-16
is made on a laptop. Prints the top plans with their breakdown, why the best wins and the
command line that runs it; ``--json`` prints everything; ``--picture`` draws the best plan.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from jaxpar.cli._common import model_config
from jaxpar.plan import (
    KINDS,
    OBJECTIVES,
    Planning,
    Prediction,
    Workload,
    duration,
    load_hardware,
    plan,
    run_flags,
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
    parser.add_argument("--objective", choices=OBJECTIVES, default="latency")
    parser.add_argument(
        "--hbm-budget", type=float, default=None, metavar="GiB", help="HBM per device to plan for"
    )
    parser.add_argument("--top", type=int, default=5, help="plans shown (default 5)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--picture", default=None, metavar="FILE", help="draw the best plan (.png or .svg)"
    )


def make_plan(args: argparse.Namespace) -> tuple[Any, Planning]:
    model = model_config(args)
    hardware = load_hardware(args.hardware, args.hw).with_hosts(args.devices, args.hosts)
    workload = Workload(batch=args.batch, prompt_len=args.prompt_len, gen_len=args.gen_len)
    planning = plan(
        model,
        hardware,
        args.devices,
        workload,
        objective=args.objective,
        hbm_budget_gib=args.hbm_budget,
    )
    return model, planning


def source_flag(args: argparse.Namespace) -> str:
    """The model flags of the plan's command line (with ``--quantize`` when planned so)."""
    source = f"--hf {args.hf}" if args.hf is not None else f"--model {args.model or 'tiny-dense'}"
    quantize = getattr(args, "quantize", None)
    return source if quantize is None else f"{source} --quantize {quantize}"


def _unit(seconds: float) -> tuple[float, str]:
    if seconds < 1e-3:
        return 1e6, "us"
    return (1e3, "ms") if seconds < 1 else (1.0, "s")


def _bytes(n: float) -> str:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g}"


def _table(planning: Planning, top: int) -> Table:
    table = Table(
        title=f"top {min(top, len(planning.ranked))} of {len(planning.ranked)} plans "
        f"({planning.objective})",
        title_justify="left",
    )
    for col in (
        "#",
        "strategy",
        "dev",
        "batch",
        "request",
        "tok/s",
        "prefill: cmp/hbm/comm",
        "decode: cmp/hbm/comm",
        "comm/req",
        "GiB/dev: par+kv+rest",
    ):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for i, p in enumerate(planning.ranked[:top], 1):
        table.add_row(
            str(i),
            p.label,
            str(p.devices),
            str(p.workload.batch),
            duration(p.request_s),
            f"{p.tokens_per_s:.4g}",
            _phase_cell(p.prefill),
            _phase_cell(p.decode),
            _bytes(p.comm_bytes),
            f"{_gib(p.memory.total)}: {_gib(p.memory.params)}+{_gib(p.memory.kv_cache)}"
            f"+{_gib(p.memory.activations + p.memory.prompt_kv + p.memory.inputs)}",
        )
    return table


def _phase_cell(cost) -> str:
    """``304 ms: 151/2.45/154`` (compute / HBM / communication, in the total's unit)."""
    scale, unit = _unit(cost.seconds)
    parts = "/".join(f"{x * scale:.3g}" for x in (cost.compute_s, cost.memory_s, cost.comm_s))
    return f"{cost.seconds * scale:.3g} {unit}: {parts}"


def _collectives(pred: Prediction) -> Table:
    table = Table(title=f"collectives per step of {pred.label}", title_justify="left")
    for col in ("phase", "step", "kind", "axes", "link", "n", "algo", "runs", "bytes", "time"):
        table.add_column(col, justify="left" if col in ("phase", "step", "kind") else "right")
    for cost in (pred.prefill, pred.decode):
        for c in cost.comm:
            table.add_row(
                cost.phase.value,
                c.item.step,
                c.item.kind,
                ",".join(c.item.axes),
                c.link,
                str(c.group),
                c.algorithm,
                str(c.executions),
                _bytes(c.bytes),
                duration(c.seconds),
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
        "command": run_flags(planning.best, source_flag(args)),
        "plans": [p.to_dict() for p in planning.ranked[: args.top]],
        "legal": _colocated(planning),
        "fit": len(planning.ranked) - _disaggregated(planning),
        "disaggregated": _disaggregated(planning),
        "refused": [
            {"strategy": str(r.config), "rule": r.rule, "reason": r.reason}
            for r in planning.refused
        ],
        "notes": list(planning.notes),
    }


def _disaggregated(planning: Planning) -> int:
    return sum(p.disaggregated for p in planning.ranked)


def _colocated(planning: Planning) -> int:
    return len(planning.ranked) + len(planning.unfit) - _disaggregated(planning)


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
        f"{len(planning.refused)} refused by the validator), "
        f"{_disaggregated(planning)} disaggregated prefill | decode splits",
        highlight=False,
    )
    console.print(_table(planning, args.top))
    console.print(_collectives(planning.best))
    console.print(f"[bold]why[/]: {escape(why(planning))}", highlight=False)
    console.print(f"[bold]run[/]: {escape(run_flags(planning.best, source_flag(args)))}")
    for note in planning.notes:
        console.print(f"[dim]{escape(note)}[/]", highlight=False)
    if args.picture:
        console.print(f"picture: {args.picture}")
    return 0
