"""``offload``: the prefix cache's host tier (``kv_offload_gb``) on a shared-prefix workload.

SmolLM2-135M's shape (``_bench_workloads.SMOLLM2``, random weights, float32) on one CPU
device, in process (a :class:`~jaxpar.engine.ContinuousBatcher`, no HTTP): a device pool
of ``POOL_TOKENS`` tokens and ``PREFIXES`` prefixes of ``PREFIX_TOKENS`` tokens, together
four times the pool. Round one asks each prefix once (each with its own question: misses
that fill the prefix cache, and evict); round two asks each again with a new question,
one request at a time. Served twice, with a host tier and without. Reported: round two's
TTFT with the host tier (hits: the prefix's pages copied back, the question prefilled)
against its TTFT without (misses: the whole prompt prefilled), the goal <= 0.3, and the
prefix-cache hit rate (tokens found cached / tokens looked up) of round two either way,
with the bytes the tier moved. A warm-up pass over other prefixes compiles every program
first (prefill pieces, prefills with context, the tier's copies), so no timing includes a
compile.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PAGE = 16
POOL_TOKENS = 512
PREFIXES = 8
PREFIX_TOKENS = 256  # eight of them: 2,048 tokens, four times the pool
QUESTION_TOKENS = 16
NEW_TOKENS = 4
OFFLOAD_GB = 1.0
GOAL = 0.3


def _rounds(rng: np.random.Generator, vocab: int, prefixes: int) -> list[list[list[int]]]:
    """Two rounds of ``prefixes`` prompts: each prefix with its own question per round."""
    heads = [rng.integers(1, vocab, PREFIX_TOKENS).tolist() for _ in range(prefixes)]
    return [[h + rng.integers(1, vocab, QUESTION_TOKENS).tolist() for h in heads] for _ in range(2)]


def _serve(batcher, prompts: list[list[int]]) -> dict[str, Any]:
    """Serves ``prompts`` one at a time; TTFTs (ms) and the prefix cache's counts."""
    stats = batcher.stats
    queries, hits, ttfts, tokens = stats.prefix_queries, stats.prefix_hits, [], []
    for prompt in prompts:
        stream = batcher.submit(prompt, max_tokens=NEW_TOKENS)
        tokens.append(stream.result(timeout=600))
        ttfts.append(1e3 * (stream.token_times[0] - stream.submitted_at))
    return {
        "ttft_ms": ttfts,
        "ttft_p50_ms": float(np.median(ttfts)),
        "queried": stats.prefix_queries - queries,
        "hits": stats.prefix_hits - hits,
        "tokens": tokens,
    }


def offload_section(quick: bool = False) -> dict:
    """Round two's TTFT and hit rate, with the host tier and without."""
    import jax
    from _bench_workloads import SMOLLM2

    from jaxpar.engine import ContinuousBatcher, InferenceEngine, KVBudget
    from jaxpar.models import init_params
    from jaxpar.spec import ParallelConfig, make_mesh

    config = SMOLLM2.config
    parallel = ParallelConfig()
    engine = InferenceEngine(
        config, init_params(config), parallel, mesh=make_mesh(parallel, jax.devices()[:1]),
        max_batch=4, max_seq_len=POOL_TOKENS,
    )  # fmt: skip
    prefixes = 4 if quick else PREFIXES
    rng = np.random.default_rng(0)
    warm, measured = (
        _rounds(rng, config.vocab_size, prefixes),
        _rounds(rng, config.vocab_size, prefixes),
    )
    out: dict[str, Any] = {}
    for name, gb in (("host tier", OFFLOAD_GB), ("device only", None)):
        budget = KVBudget(page_size=PAGE, tokens=POOL_TOKENS)
        batcher = ContinuousBatcher(engine, kv_budget=budget, kv_offload_gb=gb).start()
        try:
            for prompts in warm:  # compiles every program the measured rounds run
                _serve(batcher, prompts)
            first = _serve(batcher, measured[0])
            second = _serve(batcher, measured[1])
            tier = batcher.host_tier
            out[name] = {
                "round_one": first,
                "round_two": second,
                "hit_rate": second["hits"] / second["queried"],
                "pool_pages": batcher.pool.usable_pages,
                "host": None
                if tier is None
                else {
                    "capacity_pages": tier.capacity,
                    "restored_pages": tier.restored,
                    "offloaded_pages": tier.offloaded,
                    "to_host_mb": tier.offloaded_bytes / 2**20,
                    "from_host_mb": tier.restored_bytes / 2**20,
                    "page_bytes": tier.page_bytes,
                },
            }
        finally:
            batcher.close()
    with_tier, without = out["host tier"], out["device only"]
    if with_tier["round_two"]["tokens"] != without["round_two"]["tokens"]:
        raise AssertionError("requests served from host pages differ from their plain runs")
    ratio = with_tier["round_two"]["ttft_p50_ms"] / without["round_two"]["ttft_p50_ms"]
    out["ttft_ratio"] = ratio
    out["setup"] = {
        "model": f"{SMOLLM2.name} (random weights), float32",
        "platform": jax.devices()[0].platform,
        "pool_tokens": POOL_TOKENS,
        "page_size": PAGE,
        "prefixes": f"{prefixes} x {PREFIX_TOKENS} tokens",
        "pools": prefixes * PREFIX_TOKENS / POOL_TOKENS,
        "question_tokens": QUESTION_TOKENS,
        "offload_gb": OFFLOAD_GB,
    }
    for system in ("host tier", "device only"):
        for rnd in ("round_one", "round_two"):
            out[system][rnd].pop("tokens")
    return out


def markdown(res: dict) -> str:
    setup = res["setup"]
    with_tier, without = res["host tier"], res["device only"]
    host = with_tier["host"]
    verdict = "met" if res["ttft_ratio"] <= GOAL else "missed"
    lines = [
        f"{setup['model']}, {setup['platform']}, one device; device pool {setup['pool_tokens']} "
        f"tokens ({with_tier['pool_pages']} pages of {setup['page_size']}); prefixes "
        f"{setup['prefixes']} ({setup['pools']:g}x the pool), each asked twice with its own "
        f"{setup['question_tokens']}-token question, one request at a time.",
        "",
        "| round two (prefixes asked again) | host tier | device only |",
        "| --- | ---: | ---: |",
        f"| TTFT p50 | {with_tier['round_two']['ttft_p50_ms']:.0f} ms (hits) "
        f"| {without['round_two']['ttft_p50_ms']:.0f} ms (misses) |",
        f"| prefix-cache hit rate (tokens) | {with_tier['hit_rate']:.1%} "
        f"| {without['hit_rate']:.1%} |",
        f"| round one TTFT p50 (misses both) | {with_tier['round_one']['ttft_p50_ms']:.0f} ms "
        f"| {without['round_one']['ttft_p50_ms']:.0f} ms |",
        "",
        f"TTFT on host hits / on misses: **{res['ttft_ratio']:.2f}** (goal <= {GOAL}: {verdict}). "
        f"The host tier copied {host['offloaded_pages']} pages out ({host['to_host_mb']:.0f} MiB) "
        f"and {host['restored_pages']} back ({host['from_host_mb']:.0f} MiB), "
        f"{host['page_bytes'] / 1024:.0f} KiB a page; the tokens equal the device-only run's.",
    ]
    return "\n".join(lines)
