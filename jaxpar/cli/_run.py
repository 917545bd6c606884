"""``jaxpar run``: generate from a preset or a Hugging Face checkpoint directory."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxpar.cli._common import (
    check_context,
    describe_devices,
    dtype_note,
    load_model,
    model_config,
    parallel_config,
    select_devices,
    speculative_config,
    weights_note,
)
from jaxpar.cli._progress import stage, tensor_count
from jaxpar.engine import (
    Admission,
    Generation,
    GenerationDefaults,
    InferenceEngine,
    Sampling,
    chat_template,
    encode,
    engine_from_hf,
    generate_speculative,
    generation_defaults,
    load_tokenizer,
    merge_sampling,
)
from jaxpar.errors import ConfigError
from jaxpar.spec import batch_multiple, make_mesh, validate

_IDS = re.compile(r"\s*-?\d+(\s*[,\s]\s*-?\d+)*\s*")


def prompt_ids(text: str) -> list[int] | None:
    """``"1,2,3"`` (or ``"1 2 3"``) as ids; None when ``text`` is not a list of integers."""
    if not _IDS.fullmatch(text):
        return None
    return [int(t) for t in text.replace(",", " ").split()]


def encode_prompts(
    args: argparse.Namespace, tokenizer, defaults: GenerationDefaults, console: Console | None
) -> list[list[int]]:
    """Token ids of every ``--prompt``: ids as given, text through the tokenizer (or the
    chat template with ``--chat``), warning about text the tokenizer does not know."""
    console = console or Console(quiet=True)
    template = None
    if args.chat:
        if tokenizer is None:
            raise ConfigError("--chat needs a checkpoint directory with tokenizer.json (--hf DIR)")
        template = chat_template(args.hf, tokenizer, defaults)
    prompts = []
    for i, text in enumerate(args.prompt):
        ids = prompt_ids(text)
        if ids is not None:
            if args.chat:
                raise ConfigError(f"prompt {i} ({text!r}) is token ids; --chat needs text")
            prompts.append(ids)
            continue
        if tokenizer is None:
            raise ConfigError(
                f"prompt {text!r} is text but the model has no tokenizer.json; give token ids "
                "like '1,2,3'"
            )
        if template is not None:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            rendered = template.render([*messages, {"role": "user", "content": text}])
            encoded = encode(tokenizer, rendered, add_special_tokens=False)  # template has them
        else:
            encoded = encode(tokenizer, text)
            bos = defaults.bos_token_id
            if bos is not None and encoded.ids[:1] != [bos] and i == 0:
                console.print(
                    f"[dim]note: the tokenizer's post-processor adds no BOS (id {bos}); "
                    "prompts are used as they encode[/]",
                    soft_wrap=True,
                )
        if encoded.unknown:
            pieces = ", ".join(repr(p) for p in encoded.unknown[:8])
            console.print(
                f"[yellow]warning[/]: prompt {i}: {len(encoded.unknown)} of {len(encoded.ids)} "
                f"tokens are unknown to the tokenizer (each became the unknown token): "
                f"{escape(pieces)}",
                soft_wrap=True,
            )
        prompts.append(encoded.ids)
    return prompts


def choose_sampling(args: argparse.Namespace, defaults: GenerationDefaults) -> tuple[Sampling, str]:
    """Command-line sampling over the checkpoint's defaults; and where it came from."""
    base = defaults.sampling
    if args.temperature is None and args.top_k is None and args.top_p is None:
        where = (
            "generation_config.json" if "generation_config.json" in defaults.sources else "default"
        )
        return base, where
    fields = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    return merge_sampling(base, **fields), "command line"  # the server's rule too


def _describe(sampling: Sampling) -> str:
    if sampling.greedy:
        return "greedy"
    parts = [f"temperature {sampling.temperature:g}"]
    parts += [f"top_k {sampling.top_k}"] if sampling.top_k is not None else []
    parts += [f"top_p {sampling.top_p:g}"] if sampling.top_p is not None else []
    return ", ".join(parts)


def warm_up(
    engine: InferenceEngine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling,
    seed: int,
    console: Console | None = None,
) -> dict[str, float]:
    """Compiles every program a streamed generation of ``prompts`` runs, before it is timed.

    A streamed run of ``min(2, max_new_tokens)`` tokens compiles the prefill for this
    prompt length and what follows it (unpipelined: first tokens, insert into pages and the
    decode step; pipelined: handoff and decode step), and the decode steps of longer rows
    are compiled too; the streamed generation that follows (same prompts, sampling and
    engine) compiles nothing, so its timings are steady state. Returns the seconds each
    program took to compile.
    """
    before = dict(engine.steps.compile_seconds)
    with stage(console or Console(quiet=True), "compile prefill and decode steps"):
        engine.generate(
            prompts,
            min(2, max_new_tokens),
            sampling=sampling,
            seed=seed,
            callback=lambda step, tokens_B: None,
        )
        engine.compile_generate(max(map(len, prompts)), max_new_tokens)
    return {k: v for k, v in engine.steps.compile_seconds.items() if before.get(k) != v}


def _padded_batch(n_prompts: int, multiple: int) -> int:
    return -(-n_prompts // multiple) * multiple


def run_generate(args: argparse.Namespace, console: Console) -> int:
    config = model_config(args)
    parallel = parallel_config(args)
    multiple = batch_multiple(config, parallel)
    batch = args.batch or _padded_batch(len(args.prompt), multiple)
    # Refuses an illegal strategy before anything is read, initialised or compiled.
    validate(config, parallel, n_devices=parallel.size, batch=batch, max_seq_len=args.max_seq_len)
    check_context(args, config, args.max_seq_len)
    speculative = speculative_config(args)  # a bad one refused before anything loads
    console.print(
        f"[bold]jaxpar run[/]: {args.hf or args.model or args.default_model} "
        f"({config.arch}, {config.dtype}{dtype_note(args)}) on {describe_devices()}, "
        f"strategy {parallel}",
        soft_wrap=True,
    )
    devices = select_devices(parallel, console)
    if args.batch is None and batch != len(args.prompt):
        console.print(
            f"[dim]batch: {len(args.prompt)} prompt(s) padded to {batch} rows (the "
            f"batch divides over the axes that carry it: a multiple of {multiple}); "
            "padding rows are never returned[/]",
            soft_wrap=True,
        )

    tokenizer = load_tokenizer(args.hf) if args.hf is not None else None
    defaults = generation_defaults(args.hf) if args.hf is not None else GenerationDefaults()
    prompts = encode_prompts(args, tokenizer, defaults, console)
    admission = Admission(config.vocab_size, args.max_seq_len)  # the engine's own rule
    for i, prompt in enumerate(prompts):  # before loading or compiling anything
        admission.check(
            prompt, args.max_new_tokens, name=f"prompt {i}", tokens_name="--max-new-tokens"
        )
    sampling, sampling_source = choose_sampling(args, defaults)
    eos = () if args.ignore_eos else defaults.eos_token_ids
    stop_tokens = list(dict.fromkeys([*args.stop, *eos]))
    console.print(
        f"[dim]sampling: {_describe(sampling)} ({sampling_source}); "
        f"stop at: {stop_tokens or 'nothing'}"
        f"{f' (EOS {list(eos)} from {defaults.eos_source})' if eos else ''}[/]",
        soft_wrap=True,
    )

    mesh = make_mesh(parallel, devices)
    if args.hf is not None:  # each device reads only its shards of the checkpoint
        with stage(console, f"load {args.hf}", total=tensor_count(config)) as advance:
            engine = engine_from_hf(
                args.hf,
                parallel,
                max_batch=batch,
                max_seq_len=args.max_seq_len,
                mesh=mesh,
                options=config.options,  # --dtype (or float32 on CPU), --quantize, --kv-cache-dtype, capacity
                on_tensor=lambda name: advance(),
            )
    else:
        config, params = load_model(args, console)
        with stage(console, f"place parameters on {parallel.size} device(s)"):
            engine = InferenceEngine(
                config, params, parallel, max_batch=batch, max_seq_len=args.max_seq_len, mesh=mesh
            )

    console.print(f"[dim]{weights_note(engine.params)}[/]", soft_wrap=True)
    if speculative is not None:
        return _run_speculative(args, console, engine, prompts, sampling, stop_tokens, tokenizer)
    compiled = warm_up(
        engine, prompts, args.max_new_tokens, sampling=sampling, seed=args.seed, console=console
    )
    with Progress(
        TextColumn("decode"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("decode", total=args.max_new_tokens)
        result = engine.generate(
            prompts,
            args.max_new_tokens,
            sampling=sampling,
            seed=args.seed,
            stop_tokens=stop_tokens,
            callback=lambda step, tokens_B: progress.update(task, completed=step + 1),
        )
    _show(console, prompts, result, stop_tokens, tokenizer)
    console.print(report(compiled, result), soft_wrap=True, highlight=False)
    return 0


def _show(console: Console, prompts, result: Generation, stop_tokens, tokenizer) -> None:
    for i, (prompt, new) in enumerate(zip(prompts, result.tokens, strict=True)):
        end = " [dim](stop token)[/]" if new and new[-1] in stop_tokens else ""
        if tokenizer is not None:
            shown = (
                f"{tokenizer.decode(prompt, skip_special_tokens=False)!r} -> "
                f"{tokenizer.decode(new, skip_special_tokens=True)!r}"
            )
        else:
            shown = f"{prompt} -> {new}"
        console.print(f"[bold]{i}[/] {escape(shown)}{end}", soft_wrap=True, highlight=False)


def _run_speculative(args, console, engine, prompts, sampling, stop_tokens, tokenizer) -> int:
    """``--speculative-config``: the prompts served by a continuous batcher that
    speculates (:func:`~jaxpar.engine._spec_offline.generate_speculative`)."""
    speculative = speculative_config(args)
    result, spec = generate_speculative(
        engine, prompts, args.max_new_tokens, speculative,
        sampling=sampling, seed=args.seed, stop_tokens=stop_tokens,
    )  # fmt: skip
    _show(console, prompts, result, stop_tokens, tokenizer)
    console.print(
        f"speculative ({speculative.method}, K={speculative.num_speculative_tokens}): "
        f"{result.new_tokens} tokens in {result.prefill_seconds + result.decode_seconds:.3f} s "
        f"(compiles included); {spec.verify_steps} verification steps, "
        f"{spec.num_accepted_tokens}/{spec.num_draft_tokens} drafted tokens accepted, "
        f"mean acceptance length {spec.mean_acceptance_length:.2f}",
        soft_wrap=True,
        highlight=False,
    )
    return 0


def report(compiled: dict[str, float], result: Generation) -> str:
    """Compile time, then steady-state throughput (which excludes it), on separate lines."""
    parts = ", ".join(f"{name.replace('_', ' ')} {s:.2f} s" for name, s in compiled.items())
    total = sum(compiled.values())
    text = (
        f"compile: {parts or 'nothing new'} ({total:.2f} s in all; before the timed run)\n"
        f"prefill: {result.prompt_tokens} tokens in {result.prefill_seconds:.3f} s "
        f"({result.prefill_tokens_per_second:.1f} tokens/s)\n"
        f"decode:  {result.new_tokens} tokens in {result.decode_seconds:.3f} s "
        f"({result.decode_tokens_per_second:.1f} tokens/s, steady state, one dispatch per token)"
    )
    if result.moe_dropped is not None:  # capacity mode: drops are reported, never silent
        per_step = ", ".join(map(str, result.moe_dropped))
        text += (
            f"\nMoE dropped (token, expert) assignments: {result.moe_dropped_total} "
            f"(per step, prefill first: {per_step})"
        )
    return text
