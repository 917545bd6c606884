"""Options and set-up shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from jaxpar.errors import ConfigError
from jaxpar.spec import ParallelConfig, slice_order

#: Simulated devices when JAX runs on the CPU and ``--cpu-devices`` is not given.
DEFAULT_CPU_DEVICES = 8
DTYPES = ("float32", "bfloat16", "float16")
DEGREES = ("dp", "pp", "sp", "ep", "tp")
_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")

#: ``jaxpar demo`` without degrees: the first of these that is legal for the model and fits
#: the devices. A dense model has no ep (rule ep-needs-moe).
DEMO_STRATEGIES = {
    "moe": (ParallelConfig(sp=2, ep=2, tp=2), ParallelConfig(ep=2, tp=2), ParallelConfig(tp=2)),
    "dense": (ParallelConfig(dp=2, sp=2, tp=2), ParallelConfig(sp=2, tp=2), ParallelConfig(tp=2)),
}


def setup_devices(cpu_devices: int | None) -> None:
    """Before JAX starts its backends: simulate CPU devices only where the CPU is used.

    ``cpu_devices`` given (``--cpu-devices N``): run on the CPU (unless ``JAX_PLATFORMS``
    says otherwise) with ``N`` simulated devices. Not given: JAX picks its platform as
    usual (a GPU or TPU when one is there); only the CPU platform reads the device-count
    flag, so the CPU gets :data:`DEFAULT_CPU_DEVICES` simulated devices when it is what
    JAX falls back to, and an accelerator host runs on its accelerators.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if cpu_devices is not None:
        if cpu_devices < 1:
            raise ConfigError(f"--cpu-devices must be >= 1, got {cpu_devices}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = _COUNT_FLAG.sub("", flags)
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
        )
    elif not _COUNT_FLAG.search(flags):
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={DEFAULT_CPU_DEVICES}".strip()
        )


def describe_devices() -> str:
    """``8 cpu devices (simulated: no accelerator found ...)`` or ``4 gpu devices``."""
    import jax

    n, platform = jax.device_count(), jax.devices()[0].platform
    text = f"{n} {platform} device{'s' if n != 1 else ''}"
    if platform == "cpu":
        text += " (simulated on the CPU; no accelerator in use; --cpu-devices N sets how many)"
    return text


def select_devices(parallel: ParallelConfig, console=None) -> list:
    """The first ``parallel.size`` devices, saying so when more are available.

    Raises:
        ConfigError: too few devices, or a multi-process job that would leave some idle.
    """
    import jax

    available = jax.device_count()
    if parallel.size > available:
        raise ConfigError(
            f"strategy {parallel} needs {parallel.size} devices but {available} are available; "
            "lower the degrees (their product is the device count used), or on the CPU "
            f"simulate more with --cpu-devices {parallel.size}"
        )
    if parallel.size < available:
        if jax.process_count() > 1:
            raise ConfigError(
                f"strategy {parallel} uses {parallel.size} of the job's {available} devices; "
                "a multi-process job must use all of them (degrees whose product is "
                f"{available})"
            )
        if console is not None:
            console.print(
                f"[dim]using the first {parallel.size} of {available} devices for {parallel}[/]"
            )
    return slice_order(jax.devices())[: parallel.size]  # TPU: a box of the slice


def add_model_args(parser: argparse.ArgumentParser, default_model: str) -> None:
    from jaxpar.models import PRESETS

    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        default=None,
        choices=list(PRESETS),
        metavar="PRESET",
        help=f"model preset: {', '.join(PRESETS)} (default {default_model})",
    )
    source.add_argument("--hf", type=Path, default=None, help="Hugging Face checkpoint directory")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="compute and parameter dtype (default: the model's own)",
    )
    parser.add_argument(
        "--moe-capacity-factor",
        type=float,
        default=None,
        help="MoE: rows per expert peer = ceil(factor x tokens x top_k / ep); assignments "
        "past it are dropped and counted (default: dropless, as transformers)",
    )
    add_quantize_arg(parser)
    add_kv_cache_arg(parser)
    parser.set_defaults(default_model=default_model)


def add_quantize_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quantize",
        choices=("int8", "fp8", "int4"),
        default=None,
        help="weight-only quantization of the attention, FFN and MoE expert kernels at load "
        "time: int8 and fp8 per output channel, int4 per group of 128 (embedding, LM head "
        "and MoE router stay in --dtype unless --quantize-embeddings)",
    )
    parser.add_argument(
        "--quantize-embeddings",
        action="store_true",
        help="with --quantize, the token embedding and the LM head too (per vocabulary row)",
    )


def add_kv_cache_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("int8", "fp8"),
        default=None,
        help="store the KV cache quantized: int8 or fp8 (e4m3) values with one float32 "
        "scale per token per kv head (about half a bf16 cache: twice the tokens fit; "
        "default: --dtype)",
    )


def add_speculative_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s keys: e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (prompt lookup; also prompt_lookup_min/max, '
        "disable_by_batch_size, and jaxpar's adaptive: the cost model chooses each "
        "step's K, 0 under load, default true), or "
        '\'{"method": "draft_model", "model": "DIR", "num_speculative_tokens": 4}\' '
        '(a smaller checkpoint with the same tokenizer); "eagle3" with "model": an '
        "EAGLE-3 head's directory; \"mtp\": DeepSeek-V3's MTP layers (in --hf's "
        "checkpoint). Greedy output is unchanged, sampled output keeps its distribution",
    )


def speculative_config(args: argparse.Namespace):
    """``--speculative-config`` checked (:class:`ConfigError` naming the key), or None."""
    from jaxpar.engine import SpeculativeConfig

    return SpeculativeConfig.parse(getattr(args, "speculative_config", None))


def weights_note(params) -> str:
    """What the start line says about the weights: bytes per device, and their dtypes."""
    import jax
    import numpy as np

    from jaxpar.models import element_bytes

    per_device = 0.0
    dtypes: dict[str, float] = {}
    for x in jax.tree.leaves(params):
        shard = x.sharding.shard_shape(x.shape) if hasattr(x, "sharding") else x.shape
        nbytes = float(np.prod(shard)) * element_bytes(x.dtype)
        per_device += nbytes
        dtypes[str(x.dtype)] = dtypes.get(str(x.dtype), 0.0) + nbytes
    parts = ", ".join(f"{k} {_size(v)}" for k, v in sorted(dtypes.items(), key=lambda kv: -kv[1]))
    return f"weights {_size(per_device)} per device ({parts})"


def _size(nbytes: float) -> str:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def add_degree_args(parser: argparse.ArgumentParser, defaults_text: str = "1") -> None:
    """``--dp ... --tp``: default None (not given); :func:`parallel_config` fills in 1."""
    for axis in DEGREES:
        parser.add_argument(
            f"--{axis}", type=int, default=None, help=f"{axis} degree (default {defaults_text})"
        )
    parser.add_argument(
        "--microbatches", type=int, default=1, help="prefill pipeline microbatches (pp > 1)"
    )
    parser.add_argument(
        "--decode-groups", type=int, default=1, help="decode pipeline groups (pp > 1)"
    )


def degrees_given(args: argparse.Namespace) -> bool:
    return any(getattr(args, axis) is not None for axis in DEGREES)


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    """The degrees on the command line; those not given are 1."""
    given = {axis: getattr(args, axis) for axis in DEGREES}
    return ParallelConfig(
        **{axis: 1 if value is None else value for axis, value in given.items()},
        microbatches=args.microbatches,
        decode_groups=args.decode_groups,
    )


def model_config(args: argparse.Namespace):
    """The model as the command line runs it, a :class:`~jaxpar.models.ModelRun`: the
    config of ``--model`` or ``--hf`` (config.json only) under the options of the flags
    (``--dtype``, ``--moe-capacity-factor``, ``--quantize``)."""
    from jaxpar.engine import compute_dtype
    from jaxpar.models import ModelRun, config_from_hf, preset, stored_quantization

    if args.hf is None:
        return ModelRun(preset(args.model or args.default_model), _options(args, args.dtype))
    path = Path(args.hf) / "config.json"
    if not path.is_file():
        hint = ""
        if not Path(args.hf).exists() and str(args.hf).count("/") == 1:
            hint = (
                f"; {args.hf} looks like a Hugging Face hub id: download it first, e.g. "
                f"`huggingface-cli download {args.hf} --local-dir {Path(str(args.hf)).name}`, "
                "and pass that directory"
            )
        raise ConfigError(f"{path}: missing (--hf needs a Hugging Face checkpoint directory){hint}")
    try:
        hf = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from e
    # Commands that run the model here take its dtype for this host (float32 on CPU for a
    # half-precision checkpoint); plan and explain keep the checkpoint's, for the target.
    runs_here = getattr(args, "command", None) in RUNS_HERE
    dtype = compute_dtype(hf, args.dtype) if runs_here else args.dtype
    options = _options(args, dtype)
    stored = stored_quantization(hf, source=str(path))  # a pre-quantized one runs as stored
    if stored is not None and options.quantize is None:
        options = options.merged(quantize=stored)
    return ModelRun(config_from_hf(hf, source=str(path)), options)


#: Commands that run the model on this host's devices.
RUNS_HERE = ("run", "serve", "demo")


def dtype_note(args: argparse.Namespace) -> str:
    """What the start line says when a half-precision checkpoint runs in float32 on CPU
    (empty otherwise)."""
    from jaxpar.engine import compute_dtype

    if args.hf is None or args.dtype is not None:
        return ""
    hf = json.loads((Path(args.hf) / "config.json").read_text())
    if compute_dtype(hf, None) is None:
        return ""
    stored = hf.get("dtype") or hf.get("torch_dtype")
    return (
        f"; its {stored} weights compute in float32 on CPU (XLA:CPU has no fast {stored} "
        f"path; --dtype {stored} keeps them)"
    )


def _options(args: argparse.Namespace, dtype):
    """The execution options the flags ask for."""
    from jaxpar.models import ExecutionOptions

    return ExecutionOptions(
        dtype=dtype,
        moe_capacity_factor=getattr(args, "moe_capacity_factor", None),
        quantize=getattr(args, "quantize", None),
        quantize_embeddings=getattr(args, "quantize_embeddings", False),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", None),
    )


def load_model(args: argparse.Namespace, console, *, seed: int = 0):
    """(run, params) from ``--model`` (initialised) or ``--hf`` (read), with progress:
    ``run`` is :func:`model_config`'s, the parameters in its options' form."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from jaxpar.cli._progress import stage, tensor_count
    from jaxpar.models import init_params, load_hf_checkpoint

    config = model_config(args)
    if args.hf is None:
        with stage(console, f"initialise {args.model or args.default_model} parameters"):
            params = init_params(config, seed)  # quantized when --quantize
            jax.block_until_ready(params)
        return config, params
    device = SingleDeviceSharding(jax.devices()[0])
    with stage(console, f"load {args.hf}", total=tensor_count(config)) as advance:

        def on_device(_path, _axes):
            advance()
            return device

        # Quantized (--quantize) each kernel as it is read.
        _, params = load_hf_checkpoint(args.hf, shardings=on_device, options=config.options)
    return config, params


def join_option_values(argv: list[str], options: tuple[str, ...] = ("--prompt",)) -> list[str]:
    """``--prompt -5,2`` -> ``--prompt=-5,2``: argparse takes a value that starts with ``-``
    for an option (and fails with "expected one argument") unless it is attached by ``=``."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in options and i + 1 < len(argv) and re.match(r"-\d", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def add_context_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-long-max-seq-len",
        action="store_true",
        help="accept --max-seq-len beyond the checkpoint's max_position_embeddings with "
        "unscaled RoPE (positions it was never trained on)",
    )


def check_context(args: argparse.Namespace, config, max_seq_len: int) -> None:
    """Refuses, before loading, a ``--max-seq-len`` past a checkpoint's trained positions
    when its RoPE is not scaled (``--allow-long-max-seq-len`` overrides)."""
    if args.hf is None or getattr(args, "allow_long_max_seq_len", False):
        return
    trained = config.max_position_embeddings
    if config.positional == "rope" and config.rope.scaling is None and max_seq_len > trained:
        raise ConfigError(
            f"--max-seq-len {max_seq_len} exceeds the {trained} positions {args.hf} was "
            f"trained on (max_position_embeddings, unscaled RoPE): use --max-seq-len {trained} "
            "or less, or --allow-long-max-seq-len to run past them anyway"
        )
