"""Lowers the accelerator cases for CUDA and partitions them (run by
tests/test_accelerator_compile.py in a subprocess whose path has the CUDA plugin and cuDNN).

Prints one JSON line: per case, the kernel calls of each lowered step and the error XLA:CPU
gave when compiling it (partitioning runs first, then the GPU custom calls stop it).
"""

from __future__ import annotations

import json
import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402

from jaxpar.engine import AbstractEngine  # noqa: E402
from jaxpar.inspect import kernel_calls  # noqa: E402
from jaxpar.spec import ParallelConfig, make_mesh  # noqa: E402
from tests._accelerator_cases import CUDA_CASES, model_config  # noqa: E402

_GPU_CALL_ERRORS = ("No registered implementation for", "No FFI handler registered for")


def _step(engine: AbstractEngine, phase: str) -> dict:
    try:
        lowered = engine.lower(phase, prompt_len=256)
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


def main() -> None:
    results = {}
    for name, strategy, overrides in CUDA_CASES:
        parallel = ParallelConfig.parse(strategy)
        engine = AbstractEngine.build(
            model_config(name, **overrides),
            parallel,
            max_batch=8,
            max_seq_len=256,
            mesh=make_mesh(parallel, devices=jax.devices()[: parallel.size]),
            platform="cuda",
        )
        key = f"{name}|{strategy}|{json.dumps(overrides, sort_keys=True)}"
        results[key] = {
            "layers": engine.model_config.n_layers,
            "layer_loop": engine.model_config.layer_loop,
            "prefill": _step(engine, "prefill"),
            "decode": _step(engine, "decode"),
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
