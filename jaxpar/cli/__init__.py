"""Command line: ``jaxpar demo | run | explain | serve | plan | deploy``. Thin: parsing and printing only."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxpar.cli._common import (
    DEFAULT_CPU_DEVICES,
    DEMO_STRATEGIES,
    DTYPES,
    add_context_arg,
    add_degree_args,
    add_kv_cache_arg,
    add_model_args,
    add_quantize_arg,
    add_speculative_arg,
    join_option_values,
    setup_devices,
)

_DEMO_HELP = """\
Presets (--model): {presets}.

Without degrees the demo picks the first of its default strategies that is legal for
the model and fits the devices:
  MoE models:            {moe}
  dense models (no ep):  {dense}
Any degree on the command line replaces the default; degrees not given are 1.

The check against one device: float32 runs must give the same tokens. Lower precision
(--dtype bfloat16) rounds sums in another order, so near-ties may flip: the sharded
logits must be as close to a float32 run as the one-device logits are (within a stated
factor), and how many sequences kept the same tokens is reported."""


def _parser() -> argparse.ArgumentParser:
    from jaxpar.models import PRESETS

    parser = argparse.ArgumentParser(prog="jaxpar", description=__doc__)
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="run on the CPU with this many simulated devices (per process). Default: JAX's "
        "platform (GPU or TPU when present), and on the CPU "
        f"{DEFAULT_CPU_DEVICES} simulated devices",
    )
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--compile-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="JAX's persistent compilation cache: a restart with the same model and flags "
        "loads its programs from here instead of compiling them (default "
        "$XDG_CACHE_HOME/jaxpar/xla, else ~/.cache/jaxpar/xla)",
    )
    cache.add_argument(
        "--no-compile-cache", action="store_true", help="compile every program afresh"
    )
    dist = parser.add_argument_group("several processes (jax.distributed)")
    dist.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-process job (TPU pod / SLURM: detected automatically)",
    )
    dist.add_argument("--coordinator", default=None, help="host:port of process 0")
    dist.add_argument("--num-processes", type=int, default=None)
    dist.add_argument("--process-id", type=int, default=None)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="plan + generation under a mixed strategy + check vs 1 device",
        description="The plan, generation under a mixed strategy, and the check against one device.",
        epilog=_DEMO_HELP.format(
            presets=", ".join(PRESETS),
            **{kind: " / ".join(map(str, c)) for kind, c in DEMO_STRATEGIES.items()},
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(demo, default_model="tiny-moe")
    add_degree_args(demo, "1, or the default strategy below when no degree is given")
    demo.add_argument("--batch", type=int, default=8, help="sequences (default 8)")
    demo.add_argument("--max-seq-len", type=int, default=64, help="KV cache length (default 64)")
    demo.add_argument("--max-new-tokens", type=int, default=16, help="(default 16)")

    run = sub.add_parser("run", help="generate from a preset or an HF checkpoint directory")
    add_model_args(run, default_model="tiny-dense")
    add_degree_args(run)
    run.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="text (needs tokenizer.json) or token ids '1,2,3' (also '--prompt=-5,2'); "
        "repeat for a batch",
    )
    run.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user message, rendered with the chat template of "
        "tokenizer_config.json",
    )
    run.add_argument("--system", default=None, help="with --chat: a system message first")
    run.add_argument("--max-new-tokens", type=int, default=32)
    add_speculative_arg(run)
    run.add_argument("--max-seq-len", type=int, default=256)
    add_context_arg(run)
    run.add_argument(
        "--batch",
        type=int,
        default=None,
        help="engine batch (default: the prompts, padded to what the strategy divides)",
    )
    run.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 is greedy (default: generation_config.json's, else greedy)",
    )
    run.add_argument("--top-k", type=int, default=None)
    run.add_argument("--top-p", type=float, default=None)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--stop",
        type=int,
        action="append",
        default=[],
        help="stop token id (repeatable), besides the checkpoint's EOS",
    )
    run.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at the EOS ids of generation_config.json / config.json",
    )

    explain = sub.add_parser(
        "explain", help="tensors, specs, table rows and collectives (expected vs compiled)"
    )
    add_model_args(explain, default_model="tiny-dense")
    add_degree_args(explain)
    explain.add_argument("--phase", choices=("prefill", "decode", "both"), default="both")
    explain.add_argument(
        "--programs",
        choices=("offline", "serving", "all"),
        default="all",
        help="offline: the contiguous-cache prefill and decode steps (generate); serving: the "
        "programs `jaxpar serve` runs (paged decode step with sampling, prefill with and "
        "without cached context, first tokens, insert); all: both (default)",
    )
    explain.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    explain.add_argument(
        "--prompt-len", type=int, default=16, help="padded prompt length (default 16)"
    )
    explain.add_argument("--max-seq-len", type=int, default=64, help="KV cache length (default 64)")
    explain.add_argument(
        "--page-size", type=int, default=16, help="tokens per KV cache page (default 16)"
    )
    explain.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="decode's paged KV cache size in tokens (default: batch x max-seq-len)",
    )
    explain.add_argument("--json", action="store_true", help="print JSON instead of tables")
    explain.add_argument(
        "--dot", type=str, default=None, help="write the execution graph (Graphviz DOT) here"
    )
    explain.add_argument(
        "--no-compile", action="store_true", help="analytic model only (no compiled program)"
    )
    explain.add_argument(
        "--prefill",
        metavar="STRATEGY",
        default=None,
        help="disaggregated serving: prefill under STRATEGY (e.g. sp=4) on the devices after "
        "decode's; shows both groups and the K/V transfer between them",
    )
    _add_serve(sub)
    plan = sub.add_parser(
        "plan",
        help="choose the strategy for a model, a cluster and a workload (analytic, no compile)",
    )
    add_model_args(plan, default_model="tiny-dense")
    from jaxpar.cli._plan import add_plan_args

    add_plan_args(plan)
    _add_deploy(sub)
    return parser


def _add_deploy(sub) -> None:
    from jaxpar.cli._deploy import add_deploy_args

    deploy = sub.add_parser(
        "deploy",
        help="Kubernetes manifests (LeaderWorkerSet, Service, InferencePool, autoscaler) that "
        "serve a checkpoint on a TPU slice or GPU hosts",
        description="Prints YAML for `kubectl apply -f -`: one LeaderWorkerSet replica per "
        "slice (the leader is process 0 and serves HTTP, the workers the other processes), "
        "the leaders' Service, an InferencePool and a HorizontalPodAutoscaler on "
        "vllm:num_requests_waiting.",
    )
    add_degree_args(deploy, "1; their product must be the slice's devices")
    add_deploy_args(deploy)


def _add_serve(sub) -> None:
    from jaxpar.cli._serve import add_serve_args

    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (continuous batching) for a checkpoint",
        description="POST /v1/completions, POST /v1/chat/completions and POST "
        "/v1/responses (stream: true for server-sent events), GET /v1/responses/{id}, GET "
        "/v1/models, GET /health (readiness), GET /live (liveness), GET /metrics "
        "(Prometheus).",
    )
    serve.add_argument("--hf", type=Path, required=True, help="Hugging Face checkpoint directory")
    serve.add_argument("--dtype", choices=DTYPES, default=None, help="(default: the model's own)")
    add_quantize_arg(serve)
    add_kv_cache_arg(serve)
    add_speculative_arg(serve)
    add_degree_args(serve, "1; decode's strategy when --prefill is given")
    add_serve_args(serve)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(join_option_values(sys.argv[1:] if argv is None else list(argv)))
    distributed = args.distributed or args.coordinator is not None

    from rich.console import Console
    from rich.markup import escape

    from jaxpar.errors import JaxparError

    console = Console()
    try:
        if not distributed:
            setup_devices(args.cpu_devices)  # before JAX starts its backends

        from jaxpar.engine import enable_compile_cache, initialize_distributed, peer_failures

        if not args.no_compile_cache:
            enable_compile_cache(args.compile_cache)

        if distributed:
            cpu_devices = args.cpu_devices
            if cpu_devices is None and _on_cpu():
                cpu_devices = DEFAULT_CPU_DEVICES
            info = initialize_distributed(
                args.coordinator,
                args.num_processes,
                args.process_id,
                local_device_count=cpu_devices,
            )
            console.print(
                f"process {info.process_id} of {info.num_processes}: "
                f"{info.local_devices} local, {info.global_devices} global devices"
            )
        with peer_failures():
            return _dispatch(args, console)
    except JaxparError as e:
        console.print(f"[bold red]error[/]: {escape(str(e))}", highlight=False, soft_wrap=True)
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
    if args.command == "serve":
        from jaxpar.cli._serve import run_serve

        return run_serve(args, console)
    if args.command == "plan":
        from jaxpar.cli._plan import make_plan, run_plan

        if args.deploy:
            from jaxpar.cli._deploy import plan_deployment

            return plan_deployment(make_plan(args)[1], args)
        return run_plan(args, console)
    if args.command == "deploy":
        from jaxpar.cli._deploy import run_deploy

        return run_deploy(args, console)
    return 1


if __name__ == "__main__":
    sys.exit(main())
