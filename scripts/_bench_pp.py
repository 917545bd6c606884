"""``pp``: pipelined continuous batching against tensor and data parallelism, same devices.

The bench model (``bench_serving.MODEL``, 4 layers) served in process by a
:class:`~jaxpar.engine.ContinuousBatcher` on the same 4 of the 8 simulated CPU devices,
four ways: pp2·tp2 with the default decode groups (``2 P = 4``), pp2·tp2 with 8,
tp4 and dp2·tp2. Each gets the same saturating burst: every request submitted at once,
more than the rows hold, greedy, fixed prompt and output lengths. Reported per system:
output tokens/s over the run (prefill included), the mean decode step, and for the
pipelines the bubble fraction the steps paid (stage-iterations idle: fill and drain, or a
group with no live row) against the goal of <= 15% with 4 groups; and whether every
system drew the same tokens as the first.

On a CPU the simulated devices share the host's cores, so a pipeline's stages do not run
in parallel as chips would: the throughput column says what the step costs here, the
bubble column what a pipeline of real chips would idle.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

ROWS = 32
REQUESTS = 48
PROMPT = 16
OUTPUT = 24
MAX_SEQ_LEN = 64
GOAL = 0.15


def _systems():
    from jaxpar.spec import ParallelConfig

    return [
        ("pp2.tp2, 4 groups (default)", ParallelConfig(pp=2, tp=2)),
        ("pp2.tp2, 8 groups", ParallelConfig(pp=2, tp=2, decode_groups=8)),
        ("tp4", ParallelConfig(tp=4)),
        ("dp2.tp2", ParallelConfig(dp=2, tp=2)),
    ]


def _serve(config, params, parallel, prompts: list[list[int]]) -> dict[str, Any]:
    import jax

    from jaxpar.engine import ContinuousBatcher, InferenceEngine, KVBudget
    from jaxpar.spec import make_mesh

    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    engine = InferenceEngine(
        config, params, parallel, mesh=mesh, max_batch=ROWS, max_seq_len=MAX_SEQ_LEN
    )
    budget = KVBudget(page_size=16, tokens=ROWS * MAX_SEQ_LEN)
    with ContinuousBatcher(engine, prefill_batch=4 * parallel.dp, kv_budget=budget) as batcher:
        batcher.warmup([PROMPT])
        batcher.submit(prompts[0], max_tokens=OUTPUT).result(timeout=600)  # first runs
        before = dict(vars(batcher.stats))
        start = time.perf_counter()
        streams = [batcher.submit(p, max_tokens=OUTPUT) for p in prompts]
        tokens = [s.result(timeout=1200) for s in streams]
        seconds = time.perf_counter() - start
        stats = {k: v - before[k] for k, v in vars(batcher.stats).items()}
    steps = max(stats["decode_steps"], 1)
    idle, total = stats["idle_stage_iterations"], stats["stage_iterations"]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "output_tokens_per_s": sum(map(len, tokens)) / seconds,
        "decode_steps": stats["decode_steps"],
        "step_ms": 1e3 * stats["decode_seconds"] / steps,
        "bubble": idle / total if total else None,
        "groups": getattr(batcher.slot_steps.pipeline, "groups", None),
    }


def pp_section(config, params, quick: bool = False) -> dict[str, Any]:
    """Each system's figures over the same burst, and the requests that differ."""
    rng = np.random.default_rng(39)
    n = REQUESTS // 2 if quick else REQUESTS
    prompts = [rng.integers(1, config.vocab_size, PROMPT).tolist() for _ in range(n)]
    results: dict[str, Any] = {"systems": {}, "differing_requests": {}}
    base = None
    for name, parallel in _systems():
        served = _serve(config, params, parallel, prompts)
        tokens = served.pop("tokens")
        base = base or tokens
        results["systems"][name] = served
        results["differing_requests"][name] = sum(a != b for a, b in zip(base, tokens, strict=True))
    results["setup"] = {"rows": ROWS, "requests": n, "prompt": PROMPT, "output": OUTPUT}
    return results


def markdown(res: dict) -> str:
    s = res["setup"]
    lines = [
        f"{s['requests']} requests at once ({s['prompt']}-token prompts, {s['output']} "
        f"tokens each, greedy) over {s['rows']} rows, 4 simulated CPU devices each:",
        "",
        "| strategy | output tok/s | decode step | bubble paid | same tokens |",
        "|---|---:|---:|---:|---|",
    ]
    for name, r in res["systems"].items():
        bubble = "-" if r["bubble"] is None else f"{100 * r['bubble']:.1f}%"
        same = "yes" if res["differing_requests"][name] == 0 else "NO"
        lines.append(
            f"| {name} | {r['output_tokens_per_s']:.0f} | {r['step_ms']:.1f} ms | {bubble} "
            f"| {same} |"
        )
    four = next(r for name, r in res["systems"].items() if "4 groups" in name)
    verdict = "pass" if four["bubble"] <= GOAL else "FAIL"
    lines += [
        "",
        f"Bubble with 4 groups: {100 * four['bubble']:.1f}% (goal <= {100 * GOAL:.0f}%: "
        f"**{verdict}**).",
    ]
    return "\n".join(lines)
