"""Lowers the accelerator cases for CUDA and partitions them (run by
tests/test_accelerator_compile.py in a subprocess whose path has the CUDA plugin and cuDNN).

Prints one JSON line: per case, the kernel calls of each lowered step and the error XLA:CPU
gave when compiling it (partitioning runs first, then the GPU custom calls stop it).

``python -m tests._cuda_lowering paged`` does the same for bf16 decode attention over a
paged KV cache (the attention op alone, ``impl="auto"``, per strategy of
:data:`PAGED_STRATEGIES`): the engine has no paged cache yet.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxpar.engine import AbstractEngine  # noqa: E402
from jaxpar.inspect import kernel_calls  # noqa: E402
from jaxpar.models._paged import PagedLayer  # noqa: E402
from jaxpar.models._paged_attention import paged_decode_attention  # noqa: E402
from jaxpar.spec import ParallelConfig, make_mesh, sharding_context  # noqa: E402
from tests._accelerator_cases import CUDA_CASES, model_config  # noqa: E402

_GPU_CALL_ERRORS = ("No registered implementation for", "No FFI handler registered for")
#: Strategies of the paged decode: one device, kv heads split over tp, batch (and pages)
#: over dp too, and tiny-gqa's 2 kv heads at tp=4 (one per device, each held twice).
PAGED_STRATEGIES = ("", "tp=2", "dp=2,tp=2", "tp=4")


def _step(engine: AbstractEngine, phase: str) -> dict:
    return _lowered(lambda: engine.lower(phase, prompt_len=256))


def _lowered(lower) -> dict:
    try:
        lowered = lower()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"lower_error": f"{type(e).__name__}: {e}"[:2000]}
    error = None
    try:
        lowered.compile()
    except Exception as e:  # noqa: BLE001 - the error is the result
        error = f"{type(e).__name__}: {e}"
    return {
        "lower_error": None,
        "calls": kernel_calls(lowered),
        "compile_error": error and error[:2000],
        "stopped_at_gpu_call": bool(error) and any(m in error for m in _GPU_CALL_ERRORS),
    }


def _paged_decode(strategy: str) -> dict:
    """bf16 paged decode attention, ``impl="auto"``, lowered for cuda on ``strategy``'s mesh:
    8 rows of 8 pages of 16 positions (head_dim 128)."""
    config = model_config("tiny-gqa")
    parallel = ParallelConfig.parse(strategy)
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    b, n_pages, page_size = 8, 8, 16
    # One layer's pool [K, A, Z, H]: 8 pages per row, plus room.
    pool = jax.ShapeDtypeStruct(
        (config.n_kv_heads, 2 * n_pages * b, page_size, config.head_dim), config.dtype
    )

    def attend(q_BNH, k_KAZH, v_KAZH, tables_BN, lengths_B):
        with sharding_context(mesh, "decode", parallel, config, platform="cuda"):
            kv = PagedLayer(k_KAZH, v_KAZH, tables_BN)
            return paged_decode_attention(q_BNH, kv, lengths_B=lengths_B, window=None)

    args = (
        jax.ShapeDtypeStruct((b, config.n_heads, config.head_dim), config.dtype),
        pool,
        pool,
        jax.ShapeDtypeStruct((b, n_pages), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
    )
    return _lowered(lambda: jax.jit(attend).trace(*args).lower(lowering_platforms=("cuda",)))


def main() -> None:
    if sys.argv[1:] == ["paged"]:
        print(json.dumps({s: _paged_decode(s) for s in PAGED_STRATEGIES}))
        return
    wanted = set(sys.argv[1:])  # case keys (preset|strategy|overrides); none: every case
    results = {}
    for name, strategy, overrides in CUDA_CASES:
        key = f"{name}|{strategy}|{json.dumps(overrides, sort_keys=True)}"
        if wanted and key not in wanted:
            continue
        parallel = ParallelConfig.parse(strategy)
        engine = AbstractEngine.build(
            model_config(name, **overrides),
            parallel,
            max_batch=8,
            max_seq_len=256,
            mesh=make_mesh(parallel, devices=jax.devices()[: parallel.size]),
            platform="cuda",
        )
        results[key] = {
            "layers": engine.model_config.n_layers,
            "layer_loop": engine.options.layer_loop,
            "prefill": _step(engine, "prefill"),
            "decode": _step(engine, "decode"),
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
