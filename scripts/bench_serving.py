#!/usr/bin/env python
"""Serving benchmark: continuous batching vs static batching on one engine, same requests.

A Poisson stream of mixed-length requests (prompt and output lengths drawn per request)
is served twice by the same engine and strategy:

* **continuous**: :class:`jaxpar.engine.ContinuousBatcher` (slots refilled between steps);
* **static**: whenever the engine is idle, the requests that have arrived (up to
  ``max_batch``) run as one ``generate`` call to the longest ``max_tokens`` among them;
  each request keeps its own ``max_tokens`` tokens.

Reported per system: requests/s and output tokens/s over the run (first arrival to last
completion), time to first token and inter-token latency (p50, p99). Two loads: a heavy
one (arrivals faster than either system serves: throughput) and a moderate one
(latency). The TTFT goal compares a short prompt's p50 TTFT under the moderate load with
its prefill time plus two decode steps, both measured alone in the same run.

    python scripts/bench_serving.py [--quick] [--strategy dp=2,tp=2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Workload:
    """``n`` requests: arrival offsets (s), prompts, max_tokens."""

    arrivals: np.ndarray
    prompts: list[list[int]]
    max_tokens: list[int]

    @classmethod
    def poisson(cls, n: int, rate: float, vocab: int, max_prompt: int, max_out: int, seed=0):
        rng = np.random.default_rng(seed)
        arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
        arrivals -= arrivals[0]
        lengths = rng.integers(4, max_prompt + 1, n)
        # Mixed outputs: most short, a quarter long (the shape that idles static batches).
        long = rng.random(n) < 0.25
        outs = np.where(long, rng.integers(max_out // 2, max_out + 1, n), rng.integers(2, 17, n))
        prompts = [rng.integers(1, vocab, int(t)).tolist() for t in lengths]
        return cls(arrivals, prompts, [int(o) for o in outs])


@dataclasses.dataclass
class Served:
    """When each request arrived, got its first token, and each later token (perf_counter)."""

    arrival: list[float]
    token_times: list[list[float]]
    tokens: list[list[int]]

    def summary(self) -> dict[str, float]:
        first = min(self.arrival)
        end = max(t[-1] for t in self.token_times)
        n_out = sum(len(t) for t in self.tokens)
        ttft = [t[0] - a for a, t in zip(self.arrival, self.token_times, strict=True)]
        itl = [b - a for t in self.token_times for a, b in zip(t, t[1:], strict=False)]
        return {
            "requests_per_s": len(self.tokens) / (end - first),
            "output_tokens_per_s": n_out / (end - first),
            "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
            "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
            "itl_p50_ms": 1e3 * float(np.percentile(itl, 50)) if itl else float("nan"),
            "itl_p99_ms": 1e3 * float(np.percentile(itl, 99)) if itl else float("nan"),
            "output_tokens": n_out,
            "seconds": end - first,
        }


def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_continuous(batcher, work: Workload) -> Served:
    start = time.perf_counter() + 0.05
    streams, arrival = [], []
    for offset, prompt, n in zip(work.arrivals, work.prompts, work.max_tokens, strict=True):
        _sleep_until(start + offset)
        arrival.append(time.perf_counter())
        streams.append(batcher.submit(prompt, max_tokens=n))
    tokens = [s.result(timeout=600) for s in streams]
    return Served(arrival, [list(s.token_times) for s in streams], tokens)


def run_static(engine, work: Workload) -> Served:
    """``generate`` on whatever has arrived whenever the engine is idle (up to max_batch)."""
    n = len(work.prompts)
    start = time.perf_counter() + 0.05
    arrival = [start + float(a) for a in work.arrivals]
    token_times: list[list[float]] = [[] for _ in range(n)]
    tokens: list[list[int]] = [[] for _ in range(n)]
    done = 0
    while done < n:
        _sleep_until(arrival[done])
        now = time.perf_counter()
        batch = [i for i in range(done, n) if arrival[i] <= now][: engine.max_batch]
        began = time.perf_counter()
        gen = engine.generate(
            [work.prompts[i] for i in batch], max(work.max_tokens[i] for i in batch)
        )
        ended = time.perf_counter()
        # Tokens leave the compiled decode loop together; the first one exists after prefill.
        steps = max(len(t) for t in gen.tokens)
        per_step = gen.decode_seconds / max(steps - 1, 1)
        for row, i in enumerate(batch):
            kept = gen.tokens[row][: work.max_tokens[i]]
            tokens[i] = kept
            first = began + gen.prefill_seconds
            token_times[i] = [first] + [
                ended - per_step * (len(kept) - 1 - j) for j in range(1, len(kept))
            ]
        done += len(batch)
    return Served(arrival, token_times, tokens)


def _alone(batcher, prompt: list[int], repeats: int = 5) -> dict[str, float]:
    """A short prompt's prefill time and the decode step time, each with the engine idle."""
    ttfts, itls = [], []
    for _ in range(repeats):
        stream = batcher.submit(prompt, max_tokens=9)
        stream.result(timeout=60)
        ttfts.append(stream.token_times[0] - stream.submitted_at)
        itls += list(np.diff(stream.token_times))
    return {"prefill_ms": 1e3 * float(np.median(ttfts)), "step_ms": 1e3 * float(np.median(itls))}


def serving_section(quick: bool = False, strategy: str = "", devices: list | None = None) -> dict:
    """Both systems under a heavy and a moderate Poisson load, and the TTFT goal."""
    import jax

    from jaxpar.engine import ContinuousBatcher, InferenceEngine
    from jaxpar.models import init_params, preset
    from jaxpar.spec import ParallelConfig, make_mesh

    config = dataclasses.replace(
        preset("tiny-gqa"), d_model=256, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=768,
        vocab_size=2048, max_position_embeddings=512,
    )  # fmt: skip
    parallel = ParallelConfig.parse(strategy) if strategy else ParallelConfig()
    devices = devices or jax.devices()[: parallel.size]
    slots, max_seq_len, max_prompt, max_out = 16, 256, 64, 128
    engine = InferenceEngine(
        config,
        init_params(config),
        parallel,
        mesh=make_mesh(parallel, devices),
        max_batch=slots,
        max_seq_len=max_seq_len,
    )
    n = 48 if quick else 128
    batcher = ContinuousBatcher(engine).start()
    try:
        batcher.warmup(range(1, max_prompt + 1))
        alone = _alone(batcher, [1, 2, 3, 4, 5, 6, 7, 8])
        # Static warm-up: every prompt bucket once (its compiles are not part of the run).
        for length in (8, 16, 32, 64):
            engine.generate([[1] * length], 2)
        # Heavy: arrivals at ~3x what the engine serves with every slot busy.
        step_s = alone["step_ms"] / 1e3
        capacity = slots / (step_s * 40.0)  # requests/s at ~40 tokens each
        results: dict[str, Any] = {"alone": alone, "loads": {}}
        for load, rate in (("heavy", 3 * capacity), ("moderate", 0.5 * capacity)):
            work = Workload.poisson(n, rate, config.vocab_size, max_prompt, max_out, seed=1)
            before = dataclasses.asdict(batcher.stats)
            served = run_continuous(batcher, work)
            after = dataclasses.asdict(batcher.stats)
            static = run_static(engine, work)
            # Same engine, same greedy requests: both systems must produce the same tokens.
            if served.tokens != static.tokens:
                bad = [
                    i
                    for i, (a, b) in enumerate(zip(served.tokens, static.tokens, strict=True))
                    if a != b
                ]
                raise AssertionError(f"continuous and static tokens differ for requests {bad}")
            cont, stat = served.summary(), static.summary()
            cont["engine"] = {k: after[k] - before[k] for k in after}
            short = [i for i, p in enumerate(work.prompts) if len(p) <= 8]
            results["loads"][load] = {
                "rate_per_s": rate,
                "requests": n,
                "continuous": cont,
                "static": stat,
                "speedup_tokens_per_s": cont["output_tokens_per_s"] / stat["output_tokens_per_s"],
                "short_prompts": len(short),
            }
        short_ttft = _short_ttft(batcher, config.vocab_size, rate=0.5 * capacity, n=n)
        results["ttft_goal"] = {
            "short_prompt_ttft_p50_ms": short_ttft,
            "bound_ms": alone["prefill_ms"] + 2 * alone["step_ms"],
        }
    finally:
        batcher.close()
    results["setup"] = {
        "model": "tiny-gqa widened: d_model 256, 8 heads (4 kv), d_ff 768, vocab 2048, 4 layers",
        "strategy": str(parallel),
        "slots": slots,
        "max_seq_len": max_seq_len,
        "prompt_len": f"4..{max_prompt}",
        "max_tokens": f"75%: 2..16, 25%: {max_out // 2}..{max_out}",
        "platform": devices[0].platform,
    }
    return results


def _short_ttft(batcher, vocab: int, rate: float, n: int) -> float:
    """p50 TTFT of 8-token prompts mixed into a moderate load of long requests."""
    rng = np.random.default_rng(2)
    work = Workload.poisson(n, rate, vocab, 64, 128, seed=3)
    prompts = [
        rng.integers(1, vocab, 8).tolist() if i % 4 == 0 else p for i, p in enumerate(work.prompts)
    ]
    served = run_continuous(batcher, dataclasses.replace(work, prompts=prompts))
    ttft = [
        t[0] - a
        for i, (a, t) in enumerate(zip(served.arrival, served.token_times, strict=True))
        if i % 4 == 0
    ]
    return 1e3 * float(np.median(ttft))


def markdown(res: dict) -> str:
    s = res["setup"]
    lines = [
        f"Model: {s['model']}; strategy {s['strategy']} on {s['platform']}; {s['slots']} slots, "
        f"max_seq_len {s['max_seq_len']}; prompts {s['prompt_len']} tokens, max_tokens "
        f"{s['max_tokens']}.",
        "",
        "| load | system | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for load, r in res["loads"].items():
        for system in ("continuous", "static"):
            m = r[system]
            lines.append(
                f"| {load} ({r['rate_per_s']:.1f}/s) | {system} | {m['requests_per_s']:.1f} | "
                f"{m['output_tokens_per_s']:.0f} | {m['ttft_p50_ms']:.1f} | {m['ttft_p99_ms']:.1f} | "
                f"{m['itl_p50_ms']:.2f} | {m['itl_p99_ms']:.2f} |"
            )
    lines.append("")
    for load, r in res["loads"].items():
        goal = (
            "goal >= 1.8x" if load == "heavy" else "arrival-limited; the goal is the heavy load's"
        )
        lines.append(
            f"- {load}: continuous / static output tokens/s = **{r['speedup_tokens_per_s']:.2f}x** ({goal})"
        )
    g, a = res["ttft_goal"], res["alone"]
    lines.append(
        f"- short-prompt TTFT p50 under the moderate load: **{g['short_prompt_ttft_p50_ms']:.1f} ms** "
        f"vs its prefill alone + 2 decode steps = {a['prefill_ms']:.1f} + 2 x {a['step_ms']:.2f} = "
        f"{g['bound_ms']:.1f} ms (goal: at most that)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--strategy", default="", help="e.g. dp=2,tp=2 (default: one device)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/serving.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    res = serving_section(args.quick, args.strategy)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
