#!/usr/bin/env python
"""Ring attention against the K/V all-gather in sp prefill: memory and time.

Two sections, each a Markdown table on stdout (``--json`` writes the rows too):

* ``cpu``: 8 simulated CPU devices, sp=8, one prompt of each length: compiled bytes per
  device of the prefill step (``memory_analysis``: temporaries, and arguments + outputs +
  temporaries - aliased) and the median wall time of 3 runs, for
  ``sp_attention="gather"`` and ``"ring"`` (the engine holds ``sp`` rows, as decode
  splits them over sp; the prefill step is compiled for one row). The model is small (``--layers`` layers at
  width 512, 8 query heads and 2 KV heads of 64, f32) so the attention dominates.
* ``tpu``: compile-only (libtpu, no chip) prefill of Llama-3-8B's shape (bf16, its
  ``config.json`` with a 128k context) on a v5e-8 slice, one 128k-token prompt: compiled
  bytes per device beside the chip's 16 GiB, for both modes.

::

    python scripts/bench_ring.py --section cpu --tokens 2048 8192
    python scripts/bench_ring.py --section tpu --strategy sp=4,tp=2 --tokens 131072
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _bytes(compiled) -> dict:
    mem = compiled.memory_analysis()
    return {
        "temp_bytes": mem.temp_size_in_bytes,
        "total_bytes": mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes,
    }


def cpu_rows(tokens: list[int], layers: int, strategy: str, modes: list[str]) -> list[dict]:
    import jax
    import numpy as np

    from jaxpar.engine import InferenceEngine
    from jaxpar.models import ExecutionOptions, init_params, preset
    from jaxpar.spec import ParallelConfig, make_mesh

    config = dataclasses.replace(
        preset("tiny-gqa"),
        n_layers=layers,
        d_model=512,
        n_heads=8,
        n_kv_heads=2,
        head_dim=64,
        d_ff=1024,
        max_position_embeddings=max(tokens),
    )
    params = init_params(config, seed=0)
    parallel = ParallelConfig.parse(strategy)
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    rows = []
    for t in tokens:
        for mode in modes:
            eng = InferenceEngine(
                config, params, parallel, mesh=mesh, max_batch=parallel.sp, max_seq_len=t,
                options=ExecutionOptions(sp_attention=mode),
            )  # fmt: skip
            row = {"tokens": t, "mode": mode, "strategy": strategy, "layers": layers}
            row.update(_bytes(eng.steps.compiled_prefill(eng.params, 1, t)))
            ids = np.arange(t, dtype=np.int32)[None] % config.vocab_size
            lengths = np.array([t], np.int32)
            jax.block_until_ready(eng.steps.prefill(eng.params, ids, lengths))  # compile
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                jax.block_until_ready(eng.steps.prefill(eng.params, ids, lengths))
                times.append(time.perf_counter() - t0)
            row["seconds"] = statistics.median(times)
            print(row, file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def tpu_rows(tokens: list[int], strategy: str, layers: int | None, modes: list[str]) -> list[dict]:
    from jaxpar.engine import AbstractEngine
    from jaxpar.inspect import tpu_devices
    from jaxpar.models import ExecutionOptions, config_from_hf
    from jaxpar.spec import ParallelConfig, make_mesh

    src = ROOT / "tests" / "fixtures" / "configs" / "llama-3-8b"
    hf = json.loads((src / "config.json").read_text())
    # Llama-3.1-8B: the same shapes, a 128k context by llama3 RoPE scaling.
    hf.update(
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
    )  # fmt: skip
    config = config_from_hf(hf, source=str(src))
    config = dataclasses.replace(config, dtype="bfloat16", param_dtype="bfloat16")
    if layers is not None:
        config = dataclasses.replace(config, n_layers=layers)
    parallel = ParallelConfig.parse(strategy)
    devices = tpu_devices("v5e:2x4")
    mesh = make_mesh(parallel, devices=devices[: parallel.size])
    rows = []
    for t in tokens:
        for mode in modes:
            eng = AbstractEngine.build(
                config, parallel, max_batch=parallel.sp, max_seq_len=t, mesh=mesh,
                options=ExecutionOptions(sp_attention=mode),
            )  # fmt: skip
            t0 = time.perf_counter()
            row = {"tokens": t, "mode": mode, "strategy": strategy, "layers": config.n_layers}
            try:
                row.update(_bytes(eng.steps.compiled_prefill(eng.params, 1, t)))
            except Exception as e:  # a program that does not fit fails to compile
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            print(row, file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    gib = 2**30
    out = [
        "| strategy | tokens | mode | temporaries GiB | total GiB/device | time s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['strategy']} | {r['tokens']} | {r['mode']} | - | {r['error']} | - |")
            continue
        sec = f"{r['seconds']:.3f}" if "seconds" in r else "compile only"
        out.append(
            f"| {r['strategy']} | {r['tokens']} | {r['mode']} | {r['temp_bytes'] / gib:.3f} "
            f"| {r['total_bytes'] / gib:.3f} | {sec} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--section", choices=("cpu", "tpu"), default="cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--strategy", default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--modes", nargs="+", default=["gather", "ring"], choices=("gather", "ring"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # libtpu compiles for a topology without starting a TPU backend: JAX runs on CPU.
    os.environ["JAX_PLATFORMS"] = "cpu"
    if args.section == "cpu":
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
        rows = cpu_rows(
            args.tokens or [2048, 8192], args.layers or 2, args.strategy or "sp=8", args.modes
        )
    else:
        rows = tpu_rows(
            args.tokens or [131072], args.strategy or "sp=4,tp=2", args.layers, args.modes
        )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
