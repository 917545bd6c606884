"""``jaxpar run``: generate from a preset or a Hugging Face checkpoint directory."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxpar.cli._common import load_model, load_tokenizer, parallel_config, parse_prompt
from jaxpar.engine import InferenceEngine, Sampling, engine_from_hf


def run_generate(args: argparse.Namespace, console: Console) -> int:
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    batch = args.batch or len(args.prompt)
    if args.hf is not None:  # each device reads only its shards of the checkpoint
        tokenizer = load_tokenizer(args.hf)
        prompts = [parse_prompt(p, tokenizer) for p in args.prompt]
        engine = engine_from_hf(
            args.hf, parallel_config(args), max_batch=batch, max_seq_len=args.max_seq_len
        )
    else:
        config, params, tokenizer = load_model(args)
        prompts = [parse_prompt(p, tokenizer) for p in args.prompt]
        engine = InferenceEngine(
            config, params, parallel_config(args), max_batch=batch, max_seq_len=args.max_seq_len
        )
    with Progress(
        TextColumn("decode"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:
        task = progress.add_task("decode", total=args.max_new_tokens)
        result = engine.generate(
            prompts, args.max_new_tokens, sampling=sampling, seed=args.seed,
            stop_tokens=args.stop, callback=lambda step, tokens: progress.update(task, completed=step + 1),
        )
    for i, (prompt, new) in enumerate(zip(prompts, result.tokens, strict=True)):
        if tokenizer is not None:
            console.print(f"[bold]{i}[/] {tokenizer.decode(prompt)!r} -> {tokenizer.decode(new)!r}")
        else:
            console.print(f"[bold]{i}[/] {prompt} -> {new}")
    compile_s = engine.steps.compile_seconds
    console.print(
        f"prefill: {result.prompt_tokens} tokens in {result.prefill_seconds:.3f} s "
        f"({result.prefill_tokens_per_second:.1f} tokens/s, incl. {compile_s.get('prefill', 0):.2f} s compile)\n"
        f"decode:  {result.new_tokens} tokens in {result.decode_seconds:.3f} s "
        f"({result.decode_tokens_per_second:.1f} tokens/s, incl. {compile_s.get('decode_step', 0):.2f} s compile)"
    )
    return 0
