"""``jaxpar demo``: the plan, generation under a mixed strategy, and the one-device check."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from jaxpar.cli._common import (
    DEMO_STRATEGIES,
    degrees_given,
    describe_devices,
    load_model,
    model_config,
    parallel_config,
    select_devices,
    weights_note,
)
from jaxpar.cli._compare import compare_exact, compare_to_float32, teacher_forced_logits
from jaxpar.cli._progress import stage
from jaxpar.cli._render import plan_table
from jaxpar.engine import InferenceEngine
from jaxpar.errors import IllegalStrategyError
from jaxpar.spec import ParallelConfig, Phase, make_mesh, validate

DEMO_PROMPT_LENGTHS = (5, 12, 3, 9, 7, 1, 10, 4)


def demo_prompts(vocab: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, size=DEMO_PROMPT_LENGTHS[i % 8]).tolist() for i in range(n)]


def default_strategy(config, *, n_devices: int, batch: int, max_seq_len: int) -> ParallelConfig:
    """The first of the demo's defaults (:data:`DEMO_STRATEGIES`) that is legal for the
    model and fits ``n_devices``; one device if none does."""
    for candidate in DEMO_STRATEGIES["moe" if config.is_moe else "dense"]:
        if candidate.size > n_devices:
            continue
        try:
            validate(
                config, candidate, n_devices=candidate.size, batch=batch, max_seq_len=max_seq_len
            )
        except IllegalStrategyError:
            continue
        return candidate
    return ParallelConfig()


def demo_strategy(args: argparse.Namespace, config, n_devices: int) -> ParallelConfig:
    """The degrees on the command line (any one replaces the defaults; the others are 1),
    else :func:`default_strategy`."""
    if degrees_given(args):
        return parallel_config(args)
    return default_strategy(
        config, n_devices=n_devices, batch=args.batch, max_seq_len=args.max_seq_len
    )


def run_demo(args: argparse.Namespace, console: Console) -> int:
    config = model_config(args)
    parallel = demo_strategy(args, config, jax.device_count())
    validate(
        config, parallel, n_devices=parallel.size, batch=args.batch, max_seq_len=args.max_seq_len
    )
    console.print(
        f"[bold]jaxpar demo[/bold]: {args.model or args.hf or args.default_model} "
        f"({config.arch}, {config.n_layers} layers, d_model {config.d_model}"
        f"{f', {config.n_experts} experts top-{config.moe.top_k}' if config.is_moe else ''}, "
        f"{config.dtype}) on {describe_devices()}, strategy {parallel}"
        f"{'' if degrees_given(args) else ' (default)'}",
        soft_wrap=True,
    )
    devices = select_devices(parallel, console)
    config, params = load_model(args, console)
    with stage(console, f"place parameters on {parallel.size} device(s)"):
        engine = InferenceEngine(
            config,
            params,
            parallel,
            max_batch=args.batch,
            max_seq_len=args.max_seq_len,
            mesh=make_mesh(parallel, devices),
        )
    console.print(f"[dim]{weights_note(engine.params)}[/]", soft_wrap=True)
    for phase in Phase:
        console.print(plan_table(engine.plan, phase))

    prompts = demo_prompts(config.vocab_size, args.batch)
    with stage(console, "compile prefill, handoff and decode loop (a first, untimed run)"):
        engine.generate(prompts, args.max_new_tokens)
    result = engine.generate(prompts, args.max_new_tokens)  # timed warm run
    with stage(console, "single-device reference (compile and run)"):
        single = _single_device(config, params, args)
        reference = single.generate(prompts, args.max_new_tokens)

    dtype = str(config.dtype)
    if dtype == "float32":
        comparison = compare_exact(result.tokens, reference.tokens)
    else:
        with stage(console, f"teacher-forced logits: sharded, 1 device {dtype}, 1 device float32"):
            exact = _single_device(
                config.with_options(dtype="float32"),
                jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params),
                args,
            )
            logits = [
                teacher_forced_logits(e, prompts, reference.tokens) for e in (engine, single, exact)
            ]
        comparison = compare_to_float32(result.tokens, reference.tokens, *logits)

    tokens = Table(title="generated tokens (greedy)", title_justify="left")
    tokens.add_column("prompt")
    tokens.add_column("new tokens")
    tokens.add_column("= 1 device")
    for prompt, got, want in zip(prompts, result.tokens, reference.tokens, strict=True):
        tokens.add_row(str(prompt), str(got), "[green]yes[/]" if got == want else "[yellow]no[/]")
    console.print(tokens)

    perf = Table(title="per phase (compile, then a warm run)", title_justify="left")
    for col in ("phase", "compile s", "tokens", "seconds", "tokens/s"):
        perf.add_column(col, justify="right" if col != "phase" else "left")
    compile_s = engine.steps.compile_seconds
    perf.add_row(
        "prefill",
        f"{compile_s.get('prefill', 0) + compile_s.get('handoff', 0):.2f}",
        str(result.prompt_tokens),
        f"{result.prefill_seconds:.3f}",
        f"{result.prefill_tokens_per_second:.1f}",
    )
    perf.add_row(
        "decode",
        f"{compile_s.get('decode_loop', 0):.2f}",
        str(result.new_tokens),
        f"{result.decode_seconds:.3f}",
        f"{result.decode_tokens_per_second:.1f}",
    )
    console.print(perf)
    console.print("[dim]tokens/s from a warm run on simulated devices; see scripts/bench.py[/dim]")
    for line in comparison.lines(dtype):
        console.print(line, soft_wrap=True, highlight=False)
    if comparison.ok and dtype == "float32":
        console.print(
            f"[bold green]OK[/]: all {len(prompts)} sequences match the single-device run token for token."
        )
        return 0
    if comparison.ok:
        console.print(
            f"[bold green]OK[/] ({dtype}): the sharded logits are as close to float32 as "
            "the single-device ones (within the stated tolerance).",
            soft_wrap=True,
        )
        return 0
    console.print(
        "[bold red]MISMATCH[/]: "
        + (
            "sharded tokens differ from the single-device run."
            if dtype == "float32"
            else "the sharded logits are farther from float32 than the tolerance allows."
        )
    )
    return 1


def _single_device(config, params, args) -> InferenceEngine:
    one = ParallelConfig()
    return InferenceEngine(
        config,
        params,
        one,
        max_batch=args.batch,
        max_seq_len=args.max_seq_len,
        mesh=make_mesh(one, jax.devices()[:1]),
    )
