"""Build an engine straight from a Hugging Face checkpoint, reading each shard in place."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from jaxpar.engine._engine import InferenceEngine
from jaxpar.engine._text import Tokenizer, generation_defaults, load_tokenizer
from jaxpar.engine._vocab import padded_config, unsplit_vocab
from jaxpar.errors import CheckpointError
from jaxpar.models import config_from_hf, load_hf_checkpoint
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
    """The dtype a checkpoint runs in: ``dtype`` when given; on CPU (``platform``, default
    JAX's default backend) a half-precision checkpoint runs in float32, since XLA:CPU has no
    fast bfloat16 or float16 path; else None (the checkpoint's own)."""
    if dtype is not None:
        return dtype
    stored = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if (platform or jax.default_backend()) == "cpu" and stored in _HALF_PRECISION:
        return "float32"
    return None


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
) -> InferenceEngine:
    """Validates the strategy against the checkpoint's config, then loads every tensor
    directly into its sharding: each device reads only its own slice from the
    safetensors files, so no device ever holds a full copy of a split weight.

    ``on_tensor(name)`` is called before each parameter tensor is read (for progress).
    ``dtype`` None: the checkpoint's own, except that a half-precision checkpoint runs in
    float32 on CPU (:func:`compute_dtype`). ``quantize`` ("int8", "fp8", "int4"):
    weight-only quantization of the loaded weights, where they lie (see
    :class:`InferenceEngine`), each kernel as soon as it is read (one float tensor alive
    at a time: a model that fits only quantized loads). ``kv_cache_dtype`` ("int8",
    "fp8"): the KV cache's storage (see :class:`InferenceEngine`).

    Raises:
        IllegalStrategyError: before any tensor is read.
        CheckpointError: unsupported, incomplete, mis-shaped or corrupt checkpoint.
    """
    source = Path(path) / "config.json"
    try:
        hf = json.loads(source.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{source}: cannot read the model config: {e}") from e
    parallel = parallel_config or ParallelConfig()
    platform = mesh.devices.flat[0].platform if mesh is not None else None
    dtype = compute_dtype(hf, dtype, platform)
    # Pipelined engines run stacked layers (one block per stage): load them stacked.
    layer_loop = "scan" if parallel.pp > 1 else "unrolled"
    config = config_from_hf(hf, dtype=dtype, source=str(source), layer_loop=layer_loop)
    devices = mesh.devices.size if mesh is not None else parallel.size
    padded = padded_config(config, parallel.tp)
    validate(padded, parallel, n_devices=devices, batch=max_batch, max_seq_len=max_seq_len)
    mesh = canonical_mesh(mesh) if mesh is not None else default_mesh(parallel)

    def sharding(path_: tuple[str, ...], axes: tuple[str | None, ...]) -> NamedSharding:
        if on_tensor is not None:
            on_tensor(".".join(map(str, path_)))
        spec = param_partition_spec(axes, parallel, dims=padded)
        if padded is not config:  # tp does not divide the vocabulary: the engine pads it
            spec = unsplit_vocab(spec, axes)
        return NamedSharding(mesh, spec)

    config, params = load_hf_checkpoint(
        path, dtype=dtype, shardings=sharding, layer_loop=layer_loop, quantize=quantize
    )
    engine = InferenceEngine(
        config,
        params,
        parallel,
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        mesh=mesh,
        kv_cache_dtype=kv_cache_dtype,
    )
    # generate stops at the checkpoint's EOS ids and samples as it says, as the CLI does.
    engine.generation_defaults = generation_defaults(path)
    if load_tokenizer(path) is not None:
        engine.tokenizer = Tokenizer.from_dir(path)
    return engine
