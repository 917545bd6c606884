"""Compile-only proof for TPU: a prefill chunk over a long cached context on one v5e chip,
the ragged paged-attention kernel against the XLA path (temporaries from the compiled
program's ``memory_analysis``). One attention layer of Llama-3-8B (32 query heads, 8 kv
heads, head_dim 128, bf16); no TPU needed (libtpu's compile-only topology).

Usage: python -m tests._context_memory [--context 32768] [--chunk 512] (from the repository
root; a module of tests/ because it reads the attention path's private module).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxpar.inspect import tpu_devices
from jaxpar.models._context_attention import prefill_over_context


def _libtpu() -> str | None:
    """The running venv's libtpu (scripts/_accelerators.sh installs it), else None."""
    so = Path(sys.prefix) / "accel" / "tpu" / "libtpu" / "libtpu.so"
    return str(so) if so.is_file() else None


def compiled_memory(impl: str, device, *, context: int, chunk: int, rows: int = 1) -> dict:
    """The compiled program's memory figures (bytes) and its TPU custom calls."""
    n, k, h = 32, 8, 128
    sharding = jax.sharding.SingleDeviceSharding(device)

    def arg(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    args = (
        arg((rows, chunk, n, h)),
        arg((rows, chunk, k, h)),
        arg((rows, chunk, k, h)),
        arg((rows, context, k, h)),
        arg((rows, context, k, h)),
        arg((rows,), jnp.int32),
        arg((rows,), jnp.int32),
    )

    def attend(q, k_new, v_new, k_ctx, v_ctx, start, lengths):
        return prefill_over_context(
            q, k_new, v_new, k_ctx, v_ctx, start_B=start, lengths_B=lengths, window=None, impl=impl
        )

    # A mesh of the TPU device: Mosaic reads the target chip from the current mesh (the
    # process's default device is a CPU).
    with jax.set_mesh(jax.sharding.Mesh([device], ("x",))):
        compiled = jax.jit(attend).trace(*args).lower().compile()
    mem = compiled.memory_analysis()
    calls = [line for line in compiled.as_text().splitlines() if "tpu_custom_call" in line]
    return {
        "temp": mem.temp_size_in_bytes,
        "argument": mem.argument_size_in_bytes,
        "output": mem.output_size_in_bytes,
        "kernel_calls": len(calls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=512)
    a = parser.parse_args()
    device = tpu_devices("v5e:2x4", library_path=_libtpu())[0]
    gib = 2**30
    print(f"jax {jax.__version__}; v5e, Llama-3-8B attention, {a.chunk} new after {a.context}")
    for impl in ("pallas_tpu", "xla"):
        m = compiled_memory(impl, device, context=a.context, chunk=a.chunk)
        print(
            f"{impl:>10}: temporaries {m['temp'] / gib:.3f} GiB, arguments "
            f"{m['argument'] / gib:.3f} GiB, output {m['output'] / gib:.4f} GiB, "
            f"TPU kernel calls {m['kernel_calls']}"
        )


if __name__ == "__main__":
    main()
