"""``jaxpar serve``: an OpenAI-compatible HTTP server for a checkpoint directory.

Decode runs on the first devices with the strategy flags; ``--prefill STRATEGY`` moves
prefill to the devices after them, with its own strategy (disaggregated). SIGTERM or
Ctrl-C: uvicorn stops accepting connections and lets open ones finish (up to
``--shutdown-timeout`` seconds), then the batcher drains what is left for as long again
and cancels the rest; the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from pathlib import Path
from typing import Any

from rich.console import Console

from jaxpar.cli._common import (
    add_context_arg,
    check_context,
    describe_devices,
    dtype_note,
    model_config,
    parallel_config,
    weights_note,
)
from jaxpar.cli._groups import DeviceGroup, check_devices, device_groups
from jaxpar.cli._progress import stage, tensor_count
from jaxpar.engine import (
    CPU_KV_TOKENS,
    KV_MEMORY_FRACTION,
    KV_PAGE_SIZE,
    ContinuousBatcher,
    InferenceEngine,
    KVBudget,
    chat_template,
    engine_from_hf,
    generation_defaults,
    load_tokenizer,
)
from jaxpar.errors import ConfigError
from jaxpar.spec import Phase, batch_multiple, validate

#: Sequences decoded together when ``--max-num-seqs`` is not given (rounded up to what the
#: strategy divides). Rows cost little: the paged KV cache, not the rows, bounds memory.
DEFAULT_MAX_NUM_SEQS = 64


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--prefill",
        default=None,
        metavar="STRATEGY",
        help="disaggregated prefill on the devices after decode's, with this strategy "
        "(e.g. 'sp=4'); default: prefill on the decode devices, between decode steps",
    )
    serve.add_argument("--host", default="127.0.0.1", help="(default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="(default 8000)")
    serve.add_argument(
        "--max-num-seqs",
        "--slots",
        dest="max_num_seqs",
        type=int,
        default=None,
        help=f"the most sequences decoded together (default {DEFAULT_MAX_NUM_SEQS}, rounded up "
        "to a multiple the strategy divides); they share the KV cache's pages",
    )
    serve.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="the longest request, prompt + max_tokens - 1 (default: the model's context "
        "length, capped by what one batch shard's KV pages hold)",
    )
    cache = serve.add_mutually_exclusive_group()
    cache.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=None,
        help=f"fraction of each device's free memory (after the weights and the decode "
        f"step's temporaries) the KV cache takes (default {KV_MEMORY_FRACTION}; on CPU the "
        f"default is {CPU_KV_TOKENS} tokens)",
    )
    cache.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="KV cache size in tokens, all batch shards together (instead of a memory fraction)",
    )
    add_context_arg(serve)
    serve.add_argument(
        "--page-size",
        type=int,
        default=KV_PAGE_SIZE,
        help=f"tokens per KV cache page (default {KV_PAGE_SIZE})",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests waiting beyond this get 429 with Retry-After (default 256)",
    )
    serve.add_argument(
        "--prefill-batch",
        type=int,
        default=None,
        help="most prompts prefilled together (default: 4 per dp shard; with --prefill, the "
        "prefill strategy's smallest batch)",
    )
    serve.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="prefill every prompt in full (default: a prompt that starts as an earlier one "
        "did reuses the K/V pages of that prefix still cached and prefills only the rest; "
        "with --prefill, in the prefill devices' own pages)",
    )
    serve.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the most prefill tokens (padded) run between two decode steps while requests "
        "decode: a longer prompt is prefilled in chunks, so running requests keep streaming "
        "(default: about two decode steps' worth, the start line says how many)",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the 'model' clients name (default: the checkpoint directory's name)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM (default 30)",
    )
    serve.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _max_seq_len(args, config) -> int:
    """``--max-seq-len``, or the model's context length."""
    return args.max_seq_len or config.max_position_embeddings


def _engine(args, group: DeviceGroup, batch: int, console, what: str) -> InferenceEngine:
    config, parallel = model_config(args), group.parallel
    with stage(console, f"load {args.hf} ({what}: {parallel})", total=tensor_count(config)) as adv:
        return engine_from_hf(
            args.hf,
            parallel,
            max_batch=batch,
            max_seq_len=_max_seq_len(args, config),
            mesh=group.mesh(),
            dtype=args.dtype,
            quantize=getattr(args, "quantize", None),
            on_tensor=lambda name: adv(),
        )


def build_batcher(args: argparse.Namespace, console: Console) -> ContinuousBatcher:
    """The engines (decode, and prefill when disaggregated) and their batcher."""
    config = model_config(args)
    groups = device_groups(parallel_config(args), args.prefill)
    decode = groups[Phase.DECODE].parallel
    prefill = groups[Phase.PREFILL].parallel if args.prefill else None
    if decode.pp > 1 or (prefill is not None and prefill.pp > 1):
        raise ConfigError(
            "jaxpar serve runs unpipelined strategies (continuous batching has no pipeline "
            "schedule): use pp=1, with dp, sp, ep or tp instead"
        )
    for flag in ("max_num_seqs", "max_prefill_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    slots = args.max_num_seqs or _round_up(DEFAULT_MAX_NUM_SEQS, batch_multiple(config, decode))
    max_seq_len = _max_seq_len(args, config)
    check_context(args, config, max_seq_len)
    # Refuses illegal strategies before anything is read or compiled.
    validate(config, decode, n_devices=decode.size, batch=slots, max_seq_len=max_seq_len)
    budget = KVBudget(
        page_size=args.page_size,
        tokens=args.kv_cache_tokens,
        memory_fraction=args.kv_cache_memory_fraction,
    )
    prefill_batch = None
    if prefill is not None:
        prefill_batch = args.prefill_batch or batch_multiple(config, prefill)
        validate(
            config,
            prefill,
            n_devices=prefill.size,
            batch=prefill_batch,
            max_seq_len=max_seq_len,
        )
    check_devices(groups)
    engine = _engine(args, groups[Phase.DECODE], slots, console, "decode")
    scheduling = _scheduling(args, budget)
    if prefill is None:
        return ContinuousBatcher(engine, prefill_batch=args.prefill_batch, **scheduling)
    prefill_engine = _engine(args, groups[Phase.PREFILL], prefill_batch, console, "prefill")
    return ContinuousBatcher(engine, prefill_engine=prefill_engine, **scheduling)


def _scheduling(args: argparse.Namespace, budget: KVBudget) -> dict[str, Any]:
    """The batcher's keyword arguments that do not depend on disaggregation."""
    return {
        "max_queue": args.max_queue,
        "kv_budget": budget,
        "prefix_caching": args.prefix_caching,
        "max_prefill_tokens": args.max_prefill_tokens,
    }


def served_model(args: argparse.Namespace):
    """The :class:`~jaxpar.server.ServedModel` of ``--hf``: name, tokenizer, chat
    template, EOS and default sampling."""
    from jaxpar.server import ServedModel  # FastAPI: imported only when serving

    tokenizer = load_tokenizer(args.hf)
    defaults = generation_defaults(args.hf)
    try:
        render = chat_template(args.hf, tokenizer, defaults).render
    except ConfigError:  # no template: /v1/chat/completions answers 400
        render = None
    return ServedModel(
        name=args.served_model_name or Path(args.hf).resolve().name,
        tokenizer=tokenizer,
        render_chat=render,
        stop_token_ids=defaults.eos_token_ids,
        sampling=defaults.sampling,
    )


def _warmup(batcher: ContinuousBatcher):
    """The batcher's warm-up, logging each bucket, then how many programs the persistent
    compile cache served and how many were compiled."""
    import logging
    import time

    from jaxpar.engine import CompileCount

    log = logging.getLogger("uvicorn.error")

    def run() -> None:
        start, count = time.perf_counter(), CompileCount().start()

        def progress(done: int, total: int, what: str) -> None:
            log.info("warm-up %d/%d: %s", done, total, what)

        batcher.warmup(progress=progress)
        log.info(
            "warm-up done in %.1f s: %d program(s) from the compile cache, %d compiled",
            time.perf_counter() - start,
            count.hits,
            count.misses,
        )

    return run


def _devices(batcher: ContinuousBatcher) -> str:
    """``device 0 of 8`` / ``devices 0-3 of 8``: what decode (and prefill) run on."""
    import jax

    used = sorted(d.id for d in batcher.engine.devices)
    if batcher.disaggregated:
        used = sorted({*used, *(d.id for d in batcher.prefill_engine.devices)})
    span = f"device {used[0]}" if len(used) == 1 else f"devices {used[0]}-{used[-1]}"
    return f"{span} of {jax.device_count()}"


def _prefill_note(batcher: ContinuousBatcher) -> str:
    """``prefill <= N tokens at a time, prefix caching on``: the start line's say on
    how prompts are prefilled."""
    caching = "on" if batcher.prefix_caching else "off"
    return f"prefill <= {batcher.max_prefill_tokens} tokens at a time, prefix caching {caching}"


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a SIGTERM it shut down for is not re-raised
        afterwards (uvicorn does, so the process would die of it instead of exiting 0)."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def run_serve(args: argparse.Namespace, console: Console) -> int:
    import uvicorn

    from jaxpar.server import Service, create_app

    if args.hf is None:
        raise ConfigError("jaxpar serve needs a checkpoint directory: --hf DIR")
    model = served_model(args)
    console.print(
        f"[bold]jaxpar serve[/]: {args.hf} as {model.name!r} ({model_config(args).dtype}"
        f"{f', {args.quantize} weights' if getattr(args, 'quantize', None) else ''}"
        f"{dtype_note(args)}) on {describe_devices()}",
        soft_wrap=True,
    )
    batcher = build_batcher(args, console)
    where = f"prefill {batcher.prefill_engine.parallel_config}, " if batcher.disaggregated else ""
    quantized = f" ({args.quantize} kernels)" if getattr(args, "quantize", None) else ""
    console.print(f"{weights_note(batcher.engine.params)}{quantized}", soft_wrap=True)
    console.print(batcher.describe_cache(), soft_wrap=True)
    console.print(
        f"{where}decode {batcher.engine.parallel_config} on {_devices(batcher)}, up to "
        f"{batcher.slots} sequences, "
        f"max_seq_len {batcher.max_seq_len}, queue {args.max_queue}, {_prefill_note(batcher)}; "
        f"http://{args.host}:{args.port} (GET /health is 200 once warmed up)",
        soft_wrap=True,
    )
    app = create_app(
        Service(batcher, model), warmup=_warmup(batcher), drain_timeout=args.shutdown_timeout
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    _server_class()(config).run()
    return 0
