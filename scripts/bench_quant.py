"""Quantized weights (and KV cache) against bf16: decode step bytes and CPU step time,
batch 1 and 16.

One CPU device, a dense model whose weights do not fit in the CPU's caches, as a real
model's do not (2 layers of D 2048, 16 heads of 128 over 4 kv heads, F 8192: 232 MB of bf16
kernels against this machine's 32 MiB L3; bf16 weights and compute; its bf16 embedding
and LM head stay unquantized), so decode reads its weights from memory every step, the
regime quantization is for. The engines run XLA:CPU's default ``matmul="rows"`` form
(:func:`jaxpar.models._quant.qmatmul`); rows ``· dot`` run the same weights with
``matmul="dot"`` (GPU/TPU's form, and what CPU ran before), for comparison. Per weight
format and batch:
the compiled decode step's argument bytes (weights, scales, KV cache, tokens:
``memory_analysis``) and its median wall time, the formats interleaved in one loop so
they share the machine's load. Ratios are against bf16 at the same batch; the issue's
goal: int8 reads <= 0.55x the bytes and takes <= 0.7x the time at batch 1. Rows ``+ int8
KV`` also store the KV cache in int8 (``kv_cache_dtype``: values plus a float32 scale per
token per kv head). Rows ``MoE ...`` run a MoE of the same width (4 layers of D 512, 8
experts of F 512, top-2, bf16; XLA:CPU's masked expert matmuls) with float, int8 and int4
experts (and attention), against ``MoE bf16``.

    python scripts/bench_quant.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MAX_SEQ_LEN, PROMPT_LEN = 128, 32


def _formats() -> list[tuple[str, str | None, str | None, str]]:
    """(row name, weight format, KV cache format, matmul form) of each engine measured."""
    import jax

    major, minor = (int(x) for x in jax.__version__.split(".")[:2])
    # int4 arrays need jax >= 0.11 to run (jaxpar refuses int4 engines below).
    weights = [None, "int8", "int4"] if (major, minor) >= (0, 11) else [None, "int8"]
    rows = [(fmt or "bf16", fmt, None, "auto") for fmt in weights]
    dots = [("bf16 · dot", None, None, "dot"), ("int8 · dot", "int8", None, "dot")]
    kv = [("bf16 + int8 KV", None, "int8", "auto"), ("int8 + int8 KV", "int8", "int8", "auto")]
    moe = [(f"MoE {fmt or 'bf16'}", fmt, None, "auto") for fmt in weights]
    return [*rows, *dots, *kv, *moe]


def _engines(batch: int):
    import jax

    from jaxpar.engine import InferenceEngine
    from jaxpar.models import ExecutionOptions, init_params, preset
    from jaxpar.spec import ParallelConfig, make_mesh

    config = dataclasses.replace(
        preset("tiny-gqa"),
        n_layers=2,
        d_model=2048,
        n_heads=16,
        n_kv_heads=4,
        head_dim=128,
        d_ff=8192,
        dtype="bfloat16",
        param_dtype="bfloat16",
    )
    moe = dataclasses.replace(
        preset("tiny-moe"),
        d_model=512,
        head_dim=64,
        n_heads=8,
        n_kv_heads=2,
        d_ff=512,
        dtype="bfloat16",
        param_dtype="bfloat16",
    )
    params = init_params(config, seed=0)
    moe_params = init_params(moe, seed=0)
    mesh = make_mesh(ParallelConfig(), jax.devices()[:1])
    return {
        name: InferenceEngine(
            moe if name.startswith("MoE") else config,
            moe_params if name.startswith("MoE") else params,
            ParallelConfig(),
            max_batch=batch,
            max_seq_len=MAX_SEQ_LEN,
            mesh=mesh,
            options=ExecutionOptions(quantize=fmt, kv_cache_dtype=kv, matmul=matmul),
        )
        for name, fmt, kv, matmul in _formats()
    }


def measure(batch: int, steps: int, repeats: int) -> dict[str, dict[str, float]]:
    """Per format: argument bytes and median seconds of the decode step at ``batch``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    engines = _engines(batch)
    rng = np.random.default_rng(0)
    tokens_BT = rng.integers(0, 256, (batch, PROMPT_LEN)).astype(np.int32)
    lengths_B = np.full(batch, PROMPT_LEN, np.int32)
    starts, first, out = {}, {}, {}
    for name, eng in engines.items():
        _, cache, first[name] = eng.prefill(tokens_BT, lengths_B)
        starts[name] = cache
        lowered = eng.steps.lower_decode(eng.params, cache, first[name])
        out[name] = {"bytes": lowered.compile().memory_analysis().argument_size_in_bytes}
        jax.block_until_ready(
            eng.steps.decode(eng.params, jax.tree.map(jnp.copy, cache), first[name])
        )
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, eng in engines.items():
            cache, tokens = jax.tree.map(jnp.copy, starts[name]), first[name]
            jax.block_until_ready(cache)
            start = time.perf_counter()
            for _ in range(steps):
                logits, cache = eng.steps.decode(eng.params, cache, tokens)
            jax.block_until_ready(logits)
            times[name].append((time.perf_counter() - start) / steps)
    for name in engines:
        out[name]["step_s"] = statistics.median(times[name])
    return out


def quant_section(quick: bool = False) -> dict:
    steps, repeats = (4, 3) if quick else (8, 7)
    return {str(batch): measure(batch, steps, repeats) for batch in (1, 16)}


def markdown(result: dict) -> str:
    lines = [
        "| batch | weights (+ KV cache) | decode argument bytes | vs bf16 | step ms | vs bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for batch, rows in result.items():
        for name, row in rows.items():
            ref = (
                "MoE bf16" if name.startswith("MoE") else "bf16 · dot" if " · " in name else "bf16"
            )
            base = rows[ref]
            lines.append(
                f"| {batch} | {name} | {row['bytes']:,} | {row['bytes'] / base['bytes']:.3f} | "
                f"{row['step_s'] * 1e3:.2f} | {row['step_s'] / base['step_s']:.2f} |"
            )
    int8 = result["1"]["int8"]
    bf16 = result["1"]["bf16"]
    bytes_ok = int8["bytes"] / bf16["bytes"] <= 0.55
    time_ok = int8["step_s"] / bf16["step_s"] <= 0.7
    lines.append("")
    lines.append(
        f"int8 at batch 1: bytes {int8['bytes'] / bf16['bytes']:.3f} of bf16 (goal <= 0.55: "
        f"{'met' if bytes_ok else 'MISSED'}), time {int8['step_s'] / bf16['step_s']:.2f} "
        f"(goal <= 0.7: {'met' if time_ok else 'MISSED'})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(markdown(quant_section(args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
