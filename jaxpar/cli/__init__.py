"""Command line: ``jaxpar demo | run | explain``. Thin: parsing and printing only."""

from __future__ import annotations

import argparse
import sys

from jaxpar.cli._common import add_degree_args, add_model_args, force_cpu_devices


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpar", description=__doc__)
    parser.add_argument("--cpu-devices", type=int, default=8,
                        help="simulated devices when running on the CPU (default 8)")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    force_cpu_devices(args.cpu_devices)  # before JAX starts its backends

    from rich.console import Console

    from jaxpar.errors import JaxparError

    console = Console()
    try:
        if args.command == "demo":
            from jaxpar.cli._demo import run_demo

            return run_demo(args, console)
        if args.command == "run":
            from jaxpar.cli._run import run_generate

            return run_generate(args, console)
    except JaxparError as e:
        console.print(f"[bold red]error[/]: {e}")
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
