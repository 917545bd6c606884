"""``jaxpar serve``: an OpenAI-compatible HTTP server for a checkpoint directory.

Decode runs on the first devices with the strategy flags; ``--prefill STRATEGY`` moves
prefill to the devices after them, with its own strategy (disaggregated). Warm-up
compiles the batcher's buckets on a few threads (``--warmup full``: all before GET
/health is 200; ``lazy``: the smallest first, the rest in the background). SIGTERM or
Ctrl-C at any time stops the server, warm-up included; with requests in flight, uvicorn
stops accepting connections and the batcher drains them for up to
``--shutdown-timeout`` seconds, then ends the rest with finish reason "shutdown" (every
stream gets its final chunk and ``[DONE]``); the process exits 0.
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
    speculative_config,
    weights_note,
)
from jaxpar.cli._groups import DeviceGroup, check_across, check_devices, device_groups
from jaxpar.cli._progress import stage, tensor_count
from jaxpar.engine import (
    CPU_KV_TOKENS,
    DEFAULT_STALL_S,
    KV_MEMORY_FRACTION,
    KV_PAGE_SIZE,
    PEER_LOST_EXIT_STATUS,
    ContinuousBatcher,
    InferenceEngine,
    KVBudget,
    chat_template,
    engine_from_hf,
    generation_defaults,
    load_tokenizer,
)
from jaxpar.errors import ConfigError, PeerLostError
from jaxpar.spec import Phase, batch_multiple, validate

#: Sequences decoded together when ``--max-num-seqs`` is not given, on an accelerator
#: (rounded up to what the strategy divides). Rows cost little there: a decode step reads
#: every weight once whatever its rows, and the paged KV cache, not the rows, bounds memory.
DEFAULT_MAX_NUM_SEQS = 64
#: The same on CPU, where a decode step is compute-bound: its time grows with its rows, so
#: past some row count more rows buy no throughput, only longer steps (time per output
#: token). Measured (one decode step, SmolLM2-135M shapes, f32, 2 shared cores at load 5,
#: medians of 10 rounds; tokens/s at 1, 2, 4, 8, 16, 32, 64 rows): rows of 1,024 tokens
#: 16, 24, 42, 56, 86, 83, 88; rows of 256 tokens 22, 27, 52, 85, 125, 141, 152. Past 16
#: rows, four times the rows buy 3% (long rows) to 21% (short rows) more tokens for steps
#: 3.3-3.9 times as long (187 ms at 16 rows of 1,024 tokens, 726 ms at 64).
CPU_MAX_NUM_SEQS = 16


def default_max_num_seqs(platform: str) -> int:
    """Sequences decoded together by default on ``platform`` (a JAX platform name)."""
    return CPU_MAX_NUM_SEQS if platform == "cpu" else DEFAULT_MAX_NUM_SEQS


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
        help=f"the most sequences decoded together (default {DEFAULT_MAX_NUM_SEQS}, on CPU "
        f"{CPU_MAX_NUM_SEQS}: there a step's time grows with its rows; rounded up to a multiple "
        "the strategy divides); they share the KV cache's pages",
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
        "--kv-offload-gb",
        type=float,
        default=None,
        metavar="N",
        help="a host-memory tier for the prefix cache of N GiB per process: pages the "
        "device pool evicts are kept in (pinned) host memory and copied back for a later "
        "prompt with that prefix (default: evicted pages are dropped)",
    )
    serve.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the most prefill tokens (padded) run between two decode steps, whether or not "
        "requests decode: a longer prompt is prefilled in chunks and a long queue over several "
        "steps, so running requests keep streaming (default: about two decode steps' worth, "
        "the start line says how many)",
    )
    serve.add_argument(
        "--hardware",
        default=None,
        metavar="NAME",
        help="the hardware whose peaks /metrics divides achieved bandwidth and FLOP/s by: "
        "a planner kind (e.g. h100, tpu-v5e, cpu) or a .toml file (default: from the "
        "device kind; none reported if it is unknown)",
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
        "--warmup",
        choices=("full", "lazy"),
        default="full",
        help="full: compile every program (in parallel) before GET /health is 200; lazy: "
        "serve once the smallest prefill and decode step are compiled, compile the rest in "
        "the background (a request that needs one not compiled yet waits for it). Several "
        "processes (--coordinator) always warm up in full (default full)",
    )
    serve.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish the prefix cache's KV events over ZMQ in vLLM's format, for routers "
        "that place requests by prefix (vLLM's keys, e.g. '{\"enable_kv_cache_events\": true, "
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}\'; default off)',
    )
    serve.add_argument(
        "--stall-timeout",
        type=float,
        default=DEFAULT_STALL_S,
        metavar="S",
        help="GET /live (and /health) answer 503 once the decode loop has had work this many "
        f"seconds without finishing a step (default {DEFAULT_STALL_S:g})",
    )
    serve.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    add_tool_args(serve)


#: ``--tool-call-parser`` names (the formats of :mod:`jaxpar.server._tool_parsers`).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "deepseek_v3", "openai")
#: ``--reasoning-parser`` names (:mod:`jaxpar.server._reasoning`).
REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai")


def add_tool_args(serve: argparse.ArgumentParser) -> None:
    """Tool calling and reasoning, with vLLM's flags."""
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model choose whether to call a tool (tool_choice "auto", the default '
        "when a request offers tools); needs a tool-call format: --tool-call-parser, or the "
        'one the chat template writes. "required" and named functions work without it',
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        metavar="NAME",
        help="the format the model writes tool calls in, one of: "
        f"{', '.join(TOOL_CALL_PARSERS)} (hermes: Qwen2.5/Qwen3/Hermes; llama3_json: Llama "
        "3.x; openai: GPT-OSS harmony); default: the one the chat template writes (openai "
        "for GPT-OSS, which openai-harmony renders and parses), else "
        '"required" and named functions answer in JSON',
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        metavar="NAME",
        help=f"split the model's reasoning into reasoning_content, one of: "
        f"{', '.join(REASONING_PARSERS)} (default: none, reasoning stays in the content)",
    )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _max_seq_len(args, config) -> int:
    """``--max-seq-len``, or the model's context length."""
    return args.max_seq_len or config.max_position_embeddings


def _engine(args, config, group: DeviceGroup, batch: int, console, what: str) -> InferenceEngine:
    parallel = group.parallel
    with stage(console, f"load {args.hf} ({what}: {parallel})", total=tensor_count(config)) as adv:
        return engine_from_hf(
            args.hf,
            parallel,
            max_batch=batch,
            max_seq_len=_max_seq_len(args, config),
            mesh=group.mesh(),
            options=config.options,  # --dtype (or float32 on CPU), --quantize, --kv-cache-dtype, capacity
            on_tensor=lambda name: adv(),
        )


def build_batcher(args: argparse.Namespace, console: Console, config=None) -> ContinuousBatcher:
    """The engines (decode, and prefill when disaggregated) and their batcher; ``config``:
    the model as ``model_config(args)`` derives it (derived here if not given)."""
    import jax

    config = config or model_config(args)
    groups = device_groups(parallel_config(args), args.prefill)
    decode = groups[Phase.DECODE].parallel
    prefill = groups[Phase.PREFILL].parallel if args.prefill else None
    speculative = speculative_config(args)  # a bad one refused before anything loads
    check_pipeline(config, decode, prefill, speculative)
    for flag in ("max_num_seqs", "max_prefill_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    default_slots = default_max_num_seqs(jax.default_backend())
    slots = args.max_num_seqs or _round_up(default_slots, batch_multiple(config, decode))
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
    if prefill is not None:
        check_across(groups)
    engine = _engine(args, config, groups[Phase.DECODE], slots, console, "decode")
    scheduling = {**_scheduling(args, budget), "speculative": speculative}
    if prefill is None:
        return ContinuousBatcher(engine, prefill_batch=args.prefill_batch, **scheduling)
    prefill_engine = _engine(args, config, groups[Phase.PREFILL], prefill_batch, console, "prefill")
    return ContinuousBatcher(engine, prefill_engine=prefill_engine, **scheduling)


def check_pipeline(config, decode, prefill, speculative) -> None:
    """Refuses, before anything loads, what pipelined serving (``pp > 1``) does not run
    yet: speculative decoding, a pipelined or pipeline-fed disaggregated prefill, and
    models with KV groups (sliding-window layers mixed with full ones)."""
    from jaxpar.models import kv_groups

    if decode.pp == 1 and (prefill is None or prefill.pp == 1):
        return
    if prefill is not None:
        raise ConfigError(
            f"jaxpar serve --prefill (disaggregated) runs unpipelined groups; decode "
            f"{decode} and prefill {prefill} (pp > 1 on one): serve the pipeline colocated "
            "(drop --prefill) or fold pp into tp or dp"
        )
    if speculative is not None:
        raise ConfigError(
            f"speculative decoding does not compose with pipeline stages yet ({decode} has "
            f"pp={decode.pp}): drop --speculative-config, or serve with pp=1"
        )
    if kv_groups(config) is not None:
        raise ConfigError(
            f"serving with pp={decode.pp} runs models whose layers share one block table; "
            f"{getattr(config, 'name', 'this model')} mixes sliding-window and full layers "
            "(KV groups): serve it with pp=1 (fold pp into tp or dp)"
        )


def _scheduling(args: argparse.Namespace, budget: KVBudget) -> dict[str, Any]:
    """The batcher's keyword arguments that do not depend on disaggregation."""
    return {
        "max_queue": args.max_queue,
        "kv_budget": budget,
        "prefix_caching": args.prefix_caching,
        "max_prefill_tokens": args.max_prefill_tokens,
        "kv_offload_gb": args.kv_offload_gb,
    }


def served_model(args: argparse.Namespace):
    """The :class:`~jaxpar.server.ServedModel` of ``--hf``: name, tokenizer, chat
    template, EOS and default sampling."""
    from jaxpar.server import (  # FastAPI: imported only when serving
        ServedModel,
        tool_settings,
        uses_harmony,
    )

    tokenizer = load_tokenizer(args.hf)
    defaults = generation_defaults(args.hf)
    try:
        template = chat_template(args.hf, tokenizer, defaults)
    except ConfigError:  # no template: /v1/chat/completions answers 400
        template = None
    tools = tool_settings(
        parser=getattr(args, "tool_call_parser", None),
        auto=getattr(args, "enable_auto_tool_choice", False),
        reasoning=getattr(args, "reasoning_parser", None),
        template=template.template if template is not None else None,
        tokenizer=tokenizer,
        harmony=uses_harmony(args.hf, tokenizer),
    )
    return ServedModel(
        name=args.served_model_name or Path(args.hf).resolve().name,
        tokenizer=tokenizer,
        render_chat=template.render if template is not None else None,
        stop_token_ids=defaults.eos_token_ids,
        sampling=defaults.sampling,
        tools=tools,
    )


def warmup_mode(args: argparse.Namespace) -> str:
    """``--warmup``, except that a multi-process job warms up in full: every process must
    run the same programs in the same order, and a program one process compiled lazily
    while the others wait in its collectives could outlast their collective timeout."""
    import jax

    return "full" if jax.process_count() > 1 else getattr(args, "warmup", "full")


def _warmup(batcher: ContinuousBatcher, log=None, efficiency=None, lazy: bool = False):
    """The batcher's warm-up, logging each bucket, then how many programs the persistent
    compile cache served and how many were compiled; then ``efficiency`` profiles the
    compiled programs (for /metrics). ``lazy``: returns once the first buckets are
    compiled, and logs (and profiles) the rest when they are. Process 0 of a
    multi-process job then waits for the others to finish theirs."""
    import logging
    import time

    import jax

    from jaxpar.engine import CompileCount, wait_ready

    log = log or logging.getLogger("uvicorn.error")

    def run() -> None:
        start, count = time.perf_counter(), CompileCount().start()

        def progress(done: int, total: int, what: str) -> None:
            log.info("warm-up %d/%d: %s", done, total, what)

        def finished() -> None:
            log.info(
                "warm-up done in %.1f s: %d program(s) from the compile cache, %d compiled",
                time.perf_counter() - start,
                count.hits,
                count.misses,
            )
            if efficiency is not None:
                _profile(batcher, efficiency, log)

        batcher.warmup(progress=progress, lazy=lazy)
        warming = batcher.warming
        if lazy and warming is not None and not warming.finished:
            log.info(
                "serving after %.1f s; %d of %d warm-up buckets compile in the background "
                "(a request that needs one first waits for it)",
                time.perf_counter() - start,
                warming.total - warming.done,
                warming.total,
            )

            def rest() -> None:
                if warming.wait() and not batcher.closing:
                    finished()

            threading.Thread(target=rest, name="warmup-rest", daemon=True).start()
        else:
            finished()
        if jax.process_count() > 1 and jax.process_index() == 0:
            log.info("waiting for processes 1-%d to finish their warm-up", jax.process_count() - 1)
            wait_ready()

    return run


def _profile(batcher: ContinuousBatcher, efficiency, log) -> None:
    """Profiles the compiled steps for /metrics' efficiency metrics, and logs their
    collective bytes; a failure is logged, and the server serves without them."""
    try:
        efficiency.measure(batcher)
    except Exception:  # noqa: BLE001 - metrics must not keep the server from serving
        log.exception("profiling the compiled steps failed: /metrics has no efficiency")
        return
    for phase, profile in efficiency.profiles.items():
        branch = profile.collective_branch_bytes
        log.info(
            "%s: %s, collectives %d bytes per device (analytic minimum %d)%s",
            phase,
            profile.program,
            profile.collective_bytes,
            profile.collective_min_bytes,
            f"; {branch} of them only in steps where a row samples (the sampling filters)"
            if branch
            else "",
        )


def _kv_events(config, batcher: ContinuousBatcher, console):
    """The KV events publisher ``--kv-events-config`` asks for (its parsed ``config``, or
    None), attached to the batcher's prefix cache (None: off)."""
    from jaxpar.server import KVEventPublisher

    if config is None or not config.publishes:
        return None
    if not batcher.prefix_caching:
        raise ConfigError(
            "--kv-events-config: KV events describe the prefix cache's pages; drop "
            "--no-prefix-caching"
        )
    publisher = KVEventPublisher(config)
    batcher.publish_kv_events(publisher)
    where = config.endpoint + (f", topic {config.topic!r}" if config.topic else "")
    console.print(f"KV events: {where} ({config.encoding} encoding)", soft_wrap=True)
    return publisher


def _devices(batcher: ContinuousBatcher) -> str:
    """``device 0 of 8`` / ``devices 0-3 of 8``: what decode (and prefill) run on."""
    import jax

    if jax.process_count() > 1:  # device ids are not contiguous across processes
        return f"{jax.device_count()} devices of {jax.process_count()} processes"
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


def _server_class(on_stop=None):
    """uvicorn's server class; ``on_stop`` runs in a thread at the first SIGTERM/SIGINT."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a SIGTERM it shut down for is not re-raised
        afterwards (uvicorn does, so the process would die of it instead of exiting 0),
        and that the first signal also starts ``on_stop``: the batcher's drain, so that
        requests in flight finish (or end with finish reason "shutdown", every stream
        with its final chunk and [DONE]) while uvicorn waits for their connections."""

        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first and on_stop is not None:
                threading.Thread(target=on_stop, name="drain", daemon=True).start()

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
    import jax
    import uvicorn

    from jaxpar.server import (
        Efficiency,
        Service,
        create_app,
        parse_kv_events_config,
        resolve_hardware,
    )

    if args.hf is None:
        raise ConfigError("jaxpar serve needs a checkpoint directory: --hf DIR")
    if args.stall_timeout <= 0:
        raise ConfigError(f"--stall-timeout must be > 0 seconds, got {args.stall_timeout}")
    kv_events = None  # a bad --kv-events-config is refused before anything loads
    if args.kv_events_config is not None:
        kv_events = parse_kv_events_config(args.kv_events_config)
    _exit_on_signal()  # loading and building: nothing to drain yet
    efficiency = Efficiency(resolve_hardware(args.hardware))
    if jax.process_index() != 0:
        return _replay(args, console)
    model, config = served_model(args), model_config(args)  # derived once
    console.print(
        f"[bold]jaxpar serve[/]: {args.hf} as {model.name!r} ({config.dtype}"
        f"{f', {args.quantize} weights' if getattr(args, 'quantize', None) else ''}"
        f"{dtype_note(args)}) on {describe_devices()}",
        soft_wrap=True,
    )
    batcher = build_batcher(args, console, config)
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
    mode = warmup_mode(args)
    console.print(f"warm-up ({mode}): {batcher.warmup_plan().describe()}", soft_wrap=True)
    hardware = efficiency.hardware
    console.print(
        f"/metrics divides by the peaks of {hardware.name} ({hardware.source})"
        if hardware is not None
        else "/metrics reports no fraction of peak: unknown device kind (give --hardware)",
        soft_wrap=True,
    )
    events = _kv_events(kv_events, batcher, console)
    service = Service(batcher, model, efficiency=efficiency)
    app = create_app(
        service,
        warmup=_warmup(batcher, efficiency=efficiency, lazy=mode == "lazy"),
        drain_timeout=args.shutdown_timeout,
        stall_timeout=args.stall_timeout,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # A backstop only: the drain ends every request within --shutdown-timeout, and
        # their streams then end (final chunk, [DONE]) and close their connections.
        timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_GRACE_S,
    )

    def drain() -> None:
        service.closing = True
        batcher.close(drain=True, timeout=args.shutdown_timeout)

    server = _server_class(drain)(config)
    threading.Thread(target=_stop_on_lost_process, args=(batcher, server), daemon=True).start()
    server.run()
    if events is not None:
        events.close()
    status = 0
    if isinstance(batcher.failure, PeerLostError):
        console.print(f"[bold red]error[/]: {batcher.failure}", highlight=False, soft_wrap=True)
        status = PEER_LOST_EXIT_STATUS
    if batcher.busy_after_close:
        _exit_now(status)  # a program still compiling in a daemon thread: do not wait
    return status


#: Seconds past ``--shutdown-timeout`` uvicorn waits for connections after a SIGTERM: the
#: drained streams' last chunks to go out.
SHUTDOWN_GRACE_S = 5.0


def _exit_now(status: int = 0) -> None:
    """Exits at once (``os._exit``, after flushing output): XLA compiles in daemon
    threads cannot be interrupted, and the interpreter's exit would wait on them."""
    import logging
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


def _exit_on_signal() -> None:
    """SIGTERM/SIGINT before the HTTP server runs (loading, warm-up of a process that
    replays): exit 0 at once; nothing is being served."""

    def stop(sig, frame) -> None:
        print(f"jaxpar serve: {signal.Signals(sig).name} before serving; exiting", flush=True)
        _exit_now(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


#: Seconds a server that lost a process keeps answering 503 (naming it) before it exits.
LOST_PROCESS_GRACE_S = 3.0


def _stop_on_lost_process(batcher: ContinuousBatcher, server) -> None:
    """Process 0 of a multi-process job: once a process is lost, every request gets 503
    naming it (the service does that) for :data:`LOST_PROCESS_GRACE_S`, then the server
    stops and the process exits with :data:`PEER_LOST_EXIT_STATUS`."""
    import time

    while not isinstance(batcher.failure, PeerLostError):
        if server.should_exit:
            return
        time.sleep(0.2)
    time.sleep(LOST_PROCESS_GRACE_S)
    server.should_exit = True


def _replay(args: argparse.Namespace, console: Console) -> int:
    """A process other than 0: the same engines and warm-up, then it dispatches what
    process 0's batcher dispatches until process 0 stops (SIGTERM there drains, then
    stops every process)."""
    import logging

    import jax

    from jaxpar.engine import announce_ready

    batcher = build_batcher(args, console)
    log = logging.getLogger("jaxpar.serve")
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    _warmup(batcher, log)()  # in full: every process compiles every program before serving
    announce_ready()
    me = jax.process_index()
    console.print(f"process {me}: warmed up; dispatching process 0's schedule", soft_wrap=True)
    replayed = batcher.follow()
    console.print(f"process {me}: process 0 stopped serving ({replayed} commands replayed)")
    return 0
