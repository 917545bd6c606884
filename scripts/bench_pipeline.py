#!/usr/bin/env python
"""Pipeline bubble and decode-group benchmark on simulated CPU devices.

    python scripts/bench_pipeline.py [--pp 4] [--microbatches 1,2,4,8] [--groups 1,4]

Prefill: the GPipe bubble, measured against ``(P - 1) / (M + P - 1)``. The ideal time is
one pass of every stage's layers over the whole batch, all stages at once (the work a
pipeline without bubbles would do, timed as its own program); the measured bubble is
``1 - ideal / T(M)``. In SPMD a bubble is not idle time: every stage runs every iteration
on a placeholder, so the bubble shows up as extra work, which simulated devices sharing a
few cores measure just as well as idle time on real ones.

Decode: per-step time and tokens/s of the fused decode loop for each ``decode_groups``,
next to the unpipelined model on one device. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any


def _cpu_env(devices: int) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"


def bench_config(layers: int = 8):
    """A model big enough that layer compute dominates per-iteration overheads on CPU."""
    from jaxpar.models import preset

    return dataclasses.replace(
        preset("tiny-dense"),
        d_model=128,
        n_layers=layers,
        n_heads=8,
        n_kv_heads=8,
        head_dim=16,
        d_ff=512,
        vocab_size=512,
    )


def _interleaved(programs: dict[str, Any], rounds: int) -> dict[str, float]:
    """Median seconds of each program, timed in rounds that visit every program once.

    Interleaving spreads the drift of a shared machine's load over all programs alike. A
    program that returns a float reports its own seconds (e.g. the decode part of a run).
    """
    for fn in programs.values():
        fn()  # compile and warm up
    times: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(rounds):
        for name, fn in programs.items():
            start = time.perf_counter()
            result = fn()
            elapsed = time.perf_counter() - start
            times[name].append(result if isinstance(result, float) else elapsed)
    return {name: statistics.median(t) for name, t in times.items()}


def _engine(config, params, parallel, batch: int, max_seq_len: int):
    import jax

    from jaxpar.engine import InferenceEngine
    from jaxpar.spec import make_mesh

    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    return InferenceEngine(
        config, params, parallel, max_batch=batch, max_seq_len=max_seq_len, mesh=mesh
    )


def _stage_pass(eng, tokens, lengths):
    """A program running each stage's layers once over the whole batch, all stages at once."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpar.engine import pipeline
    from jaxpar.spec import Module, Phase, sharding_context

    steps, lay = eng.steps, eng.layouts
    stages, prefill = steps.schedule.stages, Phase.PREFILL

    def run(params, tokens_BT, lengths_B):
        with sharding_context(eng.mesh, prefill, steps.config, steps.dims):
            model = nnx.merge(steps.graphdef, params)
            b, t = tokens_BT.shape
            pos_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            graphdef, state_P = stages.split_layers(model)
            x_BTD = model.embed(tokens_BT, pos_BT)
            x_PBTD = stages.constrain(
                jnp.broadcast_to(x_BTD, (stages.count, *x_BTD.shape)),
                pipeline.BTD,
                Module.ATTENTION,
                prefill,
            )

            def stage(_, state_Lp, x_BTD):
                def layer(j, x_BTD):
                    merged = nnx.merge(graphdef, pipeline.stage_layer(state_Lp, j))
                    return merged.prefill(x_BTD, pos_BT, lengths_B)[0]

                return jax.lax.fori_loop(0, steps.dims.n_layers // stages.count, layer, x_BTD)

            return stages.map(stage)(state_P, x_PBTD)

    jitted = jax.jit(run, in_shardings=(lay.params, lay.tokens_BT, lay.lengths_prefill_B))
    return jitted.lower(eng.params, tokens, lengths).compile()


def prefill_bubble(
    pp: int, microbatches: list[int], batch: int, prompt_len: int, repeats: int
) -> list[dict[str, Any]]:
    """Measured vs predicted GPipe bubble of the pipelined prefill, one row per M."""
    import numpy as np

    from jaxpar.engine import pipeline, put_global
    from jaxpar.models import init_params
    from jaxpar.spec import ParallelConfig

    config = bench_config()
    params = init_params(config)
    rng = np.random.default_rng(0)
    tokens_np = rng.integers(0, config.vocab_size, (batch, prompt_len)).astype(np.int32)
    lengths_np = np.full(batch, prompt_len, np.int32)
    programs = {}
    for m in microbatches:
        eng = _engine(config, params, ParallelConfig(pp=pp, microbatches=m), batch, prompt_len)
        tokens = put_global(tokens_np, eng.layouts.tokens_BT)
        lengths = put_global(lengths_np, eng.layouts.lengths_prefill_B)
        if not programs:
            once = _stage_pass(eng, tokens, lengths)
            programs["ideal"] = lambda o=once, e=eng, t=tokens, n=lengths: o(
                e.params, t, n
            ).block_until_ready()
        programs[m] = lambda e=eng, t=tokens, n=lengths: e.steps.prefill(e.params, t, n)[
            0
        ].block_until_ready()
    seconds = _interleaved(programs, repeats)
    rows = []
    for m in microbatches:
        grid = pipeline.schedule(pp, m)
        idle = sum(x is None for row in grid for x in row) / (len(grid) * pp)
        rows.append(
            {
                "pp": pp,
                "microbatches": m,
                "iterations": len(grid),
                "predicted": pipeline.bubble_fraction(pp, m),
                "schedule_idle": idle,
                "prefill_ms": 1e3 * seconds[m],
                "ideal_ms": 1e3 * seconds["ideal"],
                "measured": 1 - seconds["ideal"] / seconds[m],
            }
        )
    return rows


def decode_groups(
    pp: int, groups: list[int], batch: int, prompt_len: int, new_tokens: int, repeats: int
) -> list[dict[str, Any]]:
    """Fused-loop decode speed per ``decode_groups``, and the unpipelined one-device run."""
    import numpy as np

    from jaxpar.models import init_params
    from jaxpar.spec import ParallelConfig

    config = bench_config()
    params = init_params(config)
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, config.vocab_size, (batch, prompt_len)).tolist()
    engines = {}
    for parallel in [ParallelConfig(), *(ParallelConfig(pp=pp, decode_groups=g) for g in groups)]:
        engines[parallel] = _engine(config, params, parallel, batch, prompt_len + new_tokens)
    seconds = _interleaved(
        {p: lambda e=e: e.generate(prompts, new_tokens).decode_seconds for p, e in engines.items()},
        repeats,
    )
    rows = []
    for parallel in engines:
        # generate's decode time covers new_tokens - 1 steps (the first token is prefill's).
        step = seconds[parallel] / (new_tokens - 1)
        g = parallel.decode_groups
        rows.append(
            {
                "strategy": str(parallel),
                "devices": parallel.size,
                "iterations_per_step": g + parallel.pp - 1 if parallel.pp > 1 else 1,
                "busy": g / (g + parallel.pp - 1),
                "step_ms": 1e3 * step,
                "tokens_per_s": batch / step,
            }
        )
    return rows


def markdown(prefill: list[dict], decode: list[dict]) -> str:
    out = [
        "| pp | M | iterations | predicted (P-1)/(M+P-1) | idle stage-iterations | "
        "prefill ms | ideal ms | measured 1 - ideal/T |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in prefill:
        out.append(
            f"| {r['pp']} | {r['microbatches']} | {r['iterations']} | {r['predicted']:.3f} | "
            f"{r['schedule_idle']:.3f} | {r['prefill_ms']:.1f} | {r['ideal_ms']:.1f} | "
            f"{r['measured']:.3f} |"
        )
    out += [
        "",
        "| strategy | devices | iterations/step | busy stage share | ms/step | tokens/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in decode:
        out.append(
            f"| {r['strategy']} | {r['devices']} | {r['iterations_per_step']} | "
            f"{r['busy']:.2f} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", default="1,2,4,8")
    parser.add_argument("--groups", default="1,4")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sections", default="prefill,decode")
    args = parser.parse_args(argv)
    _cpu_env(args.pp)
    microbatches = [int(m) for m in args.microbatches.split(",")]
    groups = [int(g) for g in args.groups.split(",")]
    sections = args.sections.split(",")
    prefill, decode = [], []
    if "prefill" in sections:
        prefill = prefill_bubble(args.pp, microbatches, args.batch, args.prompt_len, args.repeats)
    if "decode" in sections:
        decode = decode_groups(
            args.pp, groups, args.batch, args.prompt_len, args.new_tokens, args.repeats
        )
    print(markdown(prefill, decode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
