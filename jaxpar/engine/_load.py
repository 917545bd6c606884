"""Build an engine straight from a Hugging Face checkpoint, reading each shard in place."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from jaxpar.engine._abstract import run_form
from jaxpar.engine._engine import InferenceEngine
from jaxpar.engine._speculative import SpeculativeConfig
from jaxpar.engine._text import Tokenizer, generation_defaults, load_tokenizer
from jaxpar.engine._vocab import unsplit_vocab
from jaxpar.errors import CheckpointError
from jaxpar.models import ExecutionOptions, config_from_hf, load_hf_checkpoint
from jaxpar.spec import (
    ParallelConfig,
    canonical_mesh,
    default_mesh,
    param_partition_spec,
    validate,
)

#: Checkpoint dtypes that run in float32 on CPU unless a dtype is given.
_HALF_PRECISION = ("bfloat16", "float16")


def compute_dtype(hf: Mapping[str, Any], dtype: Any = None, platform: str | None = None) -> Any:
    """The dtype a checkpoint runs in (``ExecutionOptions.dtype``): ``dtype`` when given; on
    CPU (``platform``: the devices it runs on, default those of :func:`run_platform`) a
    half-precision checkpoint runs in float32, since XLA:CPU has no fast bfloat16 or
    float16 path; else None (the checkpoint's own)."""
    if dtype is not None:
        return dtype
    stored = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if (platform or run_platform()) == "cpu" and stored in _HALF_PRECISION:
        return "float32"
    return None


def run_platform(mesh: Mesh | None = None) -> str:
    """The platform an engine on ``mesh`` runs on: its devices'; without a mesh, the
    devices a default mesh takes (JAX's first devices)."""
    devices = mesh.devices.flat if mesh is not None else jax.devices()
    return devices[0].platform


def engine_from_hf(
    path: str | Path,
    parallel_config: ParallelConfig | None = None,
    *,
    max_batch: int,
    max_seq_len: int,
    mesh: Mesh | None = None,
    dtype: Any = None,
    on_tensor: Callable[[str], None] | None = None,
    quantize: str | None = None,
    kv_cache_dtype: str | None = None,
    options: ExecutionOptions | None = None,
    speculative: Any = None,
) -> InferenceEngine:
    """Validates the strategy against the checkpoint's config, then loads every tensor
    directly into its sharding: each device reads only its own slice from the
    safetensors files, so no device ever holds a full copy of a split weight.

    ``on_tensor(name)`` is called before each parameter tensor is read (for progress).
    ``options``: how the engine runs it (:class:`~jaxpar.models.ExecutionOptions`);
    ``dtype`` and ``quantize`` are the same as its fields of those names. ``dtype`` None:
    the checkpoint's own, except that a half-precision checkpoint runs in float32 on a CPU
    mesh (:func:`compute_dtype`, for the mesh's devices). ``quantize`` ("int8", "fp8",
    "int4"): weight-only quantization of the loaded weights, where they lie (see
    :class:`InferenceEngine`), each kernel as soon as it is read (one float tensor alive
    at a time: a model that fits only quantized loads). ``kv_cache_dtype`` ("int8",
    "fp8"): the KV cache's storage (the field of that name). The engine's
    ``model_config`` is the checkpoint's ``config.json``, whatever the options.

    ``speculative``: speculative decoding for the batchers serving it (vLLM's
    ``--speculative-config`` keys; :class:`InferenceEngine`).

    Raises:
        IllegalStrategyError: before any tensor is read.
        CheckpointError: unsupported, incomplete, mis-shaped or corrupt checkpoint.
    """
    speculative = SpeculativeConfig.parse(speculative)  # a bad one before any tensor
    if speculative is not None and speculative.method == "mtp" and speculative.model is None:
        speculative = dataclasses.replace(speculative, model=str(path))  # its own MTP layers
    source = Path(path) / "config.json"
    try:
        hf = json.loads(source.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{source}: cannot read the model config: {e}") from e
    parallel = parallel_config or ParallelConfig()
    options = (options or ExecutionOptions()).merged(
        quantize=quantize, kv_cache_dtype=kv_cache_dtype
    )
    options = options.merged(dtype=compute_dtype(hf, dtype or options.dtype, run_platform(mesh)))
    config = config_from_hf(hf, source=str(source))
    # The run form (stacked layers when pipelined, the padded vocabulary, the K/V heads of
    # rule kv-head-replicas): each device reads the parameters in the form it holds them,
    # and the engine takes this run as it is.
    run = run_form(config, parallel, options)
    devices = mesh.devices.size if mesh is not None else parallel.size
    validate(run, parallel, n_devices=devices, batch=max_batch, max_seq_len=max_seq_len)
    mesh = canonical_mesh(mesh) if mesh is not None else default_mesh(parallel)

    def sharding(path_: tuple[str, ...], axes: tuple[str | None, ...]) -> NamedSharding:
        if on_tensor is not None:
            on_tensor(".".join(map(str, path_)))
        spec = param_partition_spec(axes, parallel, dims=run)
        if run.padded_vocab is not None:  # tp does not divide it: the engine pads it
            spec = unsplit_vocab(spec, axes)
        return NamedSharding(mesh, spec)

    # Its config is config_from_hf of the same config.json: run.config.
    _, params = load_hf_checkpoint(
        path, shardings=sharding, options=run.options, kv_head_replicas=run.kv_head_replicas
    )
    engine = InferenceEngine(
        run,
        params,
        parallel,
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        mesh=mesh,
        speculative=speculative,
    )
    # generate stops at the checkpoint's EOS ids and samples as it says, as the CLI does.
    engine.generation_defaults = generation_defaults(path)
    if load_tokenizer(path) is not None:
        engine.tokenizer = Tokenizer.from_dir(path)
    return engine
