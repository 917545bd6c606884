"""``jaxpar demo``: the plan, generation under a mixed strategy, and the one-device check."""

from __future__ import annotations

import argparse

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from jaxpar.cli._common import load_model, parallel_config
from jaxpar.cli._render import plan_table
from jaxpar.engine import InferenceEngine
from jaxpar.spec import ParallelConfig, Phase, make_mesh

DEMO_PROMPT_LENGTHS = (5, 12, 3, 9, 7, 1, 10, 4)


def demo_prompts(vocab: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, size=DEMO_PROMPT_LENGTHS[i % 8]).tolist() for i in range(n)]


def run_demo(args: argparse.Namespace, console: Console) -> int:
    config, params, _ = load_model(args)
    parallel = parallel_config(args)
    console.print(
        f"[bold]jaxpar demo[/bold]: {args.model or args.hf or args.default_model} "
        f"({config.arch}, {config.n_layers} layers, d_model {config.d_model}"
        f"{f', {config.n_experts} experts top-{config.top_k}' if config.is_moe else ''}) "
        f"on {jax.device_count()} {jax.devices()[0].platform} devices, strategy {parallel}"
    )
    devices = jax.devices()[: parallel.size]
    engine = InferenceEngine(
        config, params, parallel, max_batch=args.batch, max_seq_len=args.max_seq_len,
        mesh=make_mesh(parallel, devices),
    )
    for phase in Phase:
        console.print(plan_table(engine.plan, phase))

    prompts = demo_prompts(config.vocab_size, args.batch)
    engine.generate(prompts, args.max_new_tokens)  # compiles prefill, handoff, decode loop
    result = engine.generate(prompts, args.max_new_tokens)  # timed warm run
    single = InferenceEngine(
        config, params, ParallelConfig(), max_batch=args.batch, max_seq_len=args.max_seq_len,
        mesh=make_mesh(ParallelConfig(), jax.devices()[:1]),
    )
    reference = single.generate(prompts, args.max_new_tokens)

    tokens = Table(title="generated tokens (greedy)", title_justify="left")
    tokens.add_column("prompt")
    tokens.add_column("new tokens")
    tokens.add_column("= 1 device")
    for prompt, got, want in zip(prompts, result.tokens, reference.tokens, strict=True):
        tokens.add_row(str(prompt), str(got), "[green]yes[/]" if got == want else "[red]NO[/]")
    console.print(tokens)

    perf = Table(title="per phase", title_justify="left")
    for col in ("phase", "compile s", "tokens", "seconds", "tokens/s"):
        perf.add_column(col, justify="right" if col != "phase" else "left")
    compile_s = engine.steps.compile_seconds
    perf.add_row("prefill", f"{compile_s.get('prefill', 0) + compile_s.get('handoff', 0):.2f}",
                 str(result.prompt_tokens), f"{result.prefill_seconds:.3f}",
                 f"{result.prefill_tokens_per_second:.1f}")
    perf.add_row("decode", f"{compile_s.get('decode_loop', 0):.2f}", str(result.new_tokens),
                 f"{result.decode_seconds:.3f}", f"{result.decode_tokens_per_second:.1f}")
    console.print(perf)
    console.print("[dim]tokens/s from a warm run on simulated devices; see scripts/bench.py[/dim]")
    if result.tokens == reference.tokens:
        console.print(f"[bold green]OK[/]: all {len(prompts)} sequences match the single-device run token for token.")
        return 0
    console.print("[bold red]MISMATCH[/]: sharded tokens differ from the single-device run.")
    return 1
