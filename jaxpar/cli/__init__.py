"""Command line: ``jaxpar demo | run | explain``. Thin: parsing and printing only."""

from __future__ import annotations

import argparse
import sys

from jaxpar.cli._common import add_degree_args, add_model_args, force_cpu_devices


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpar", description=__doc__)
    parser.add_argument("--cpu-devices", type=int, default=8,
                        help="simulated devices (per process) when running on the CPU (default 8)")
    dist = parser.add_argument_group("several processes (jax.distributed)")
    dist.add_argument("--distributed", action="store_true",
                      help="join a multi-process job (TPU pod / SLURM: detected automatically)")
    dist.add_argument("--coordinator", default=None, help="host:port of process 0")
    dist.add_argument("--num-processes", type=int, default=None)
    dist.add_argument("--process-id", type=int, default=None)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="plan + generation under a mixed strategy + check vs 1 device")
    add_model_args(demo, default_model="tiny-moe")
    add_degree_args(demo, {"sp": 2, "ep": 2, "tp": 2})
    demo.add_argument("--batch", type=int, default=8)
    demo.add_argument("--max-seq-len", type=int, default=64)
    demo.add_argument("--max-new-tokens", type=int, default=16)

    run = sub.add_parser("run", help="generate from a preset or an HF checkpoint directory")
    add_model_args(run, default_model="tiny-dense")
    add_degree_args(run, {})
    run.add_argument("--prompt", action="append", required=True,
                     help="text (needs tokenizer.json) or token ids '1,2,3'; repeat for a batch")
    run.add_argument("--max-new-tokens", type=int, default=32)
    run.add_argument("--max-seq-len", type=int, default=256)
    run.add_argument("--batch", type=int, default=None, help="engine batch (default: number of prompts)")
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-k", type=int, default=None)
    run.add_argument("--top-p", type=float, default=None)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--stop", type=int, action="append", default=[], help="stop token id (repeatable)")

    explain = sub.add_parser("explain", help="tensors, specs, table rows and collectives (expected vs compiled)")
    add_model_args(explain, default_model="tiny-dense")
    add_degree_args(explain, {})
    explain.add_argument("--phase", choices=("prefill", "decode", "both"), default="both")
    explain.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    explain.add_argument("--prompt-len", type=int, default=16, help="padded prompt length (default 16)")
    explain.add_argument("--max-seq-len", type=int, default=64, help="KV cache length (default 64)")
    explain.add_argument("--json", action="store_true", help="print JSON instead of tables")
    explain.add_argument("--dot", type=str, default=None, help="write the execution graph (Graphviz DOT) here")
    explain.add_argument("--no-compile", action="store_true", help="analytic model only (no compiled program)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    distributed = args.distributed or args.coordinator is not None
    if not distributed:
        force_cpu_devices(args.cpu_devices)  # before JAX starts its backends

    from rich.console import Console

    from jaxpar.engine import initialize_distributed, peer_failures
    from jaxpar.errors import JaxparError

    console = Console()
    try:
        if distributed:
            info = initialize_distributed(
                args.coordinator, args.num_processes, args.process_id,
                local_device_count=args.cpu_devices if _on_cpu() else None,
            )
            console.print(f"process {info.process_id} of {info.num_processes}: "
                          f"{len(info.local_devices)} local, {len(info.global_devices)} global devices")
        with peer_failures():
            return _dispatch(args, console)
    except JaxparError as e:
        console.print(f"[bold red]error[/]: {e}")
        return 2


def _on_cpu() -> bool:
    import os

    return os.environ.get("JAX_PLATFORMS", "") == "cpu"


def _dispatch(args: argparse.Namespace, console) -> int:
    if args.command == "demo":
        from jaxpar.cli._demo import run_demo

        return run_demo(args, console)
    if args.command == "run":
        from jaxpar.cli._run import run_generate

        return run_generate(args, console)
    if args.command == "explain":
        from jaxpar.cli._explain import run_explain

        return run_explain(args, console)
    return 1


if __name__ == "__main__":
    sys.exit(main())
