"""Prefix caching and chunked prefill: every request still equals its own offline run.

A request whose prompt starts with pages another request cached prefills only the rest
(attending to the cached K/V), and a prompt longer than a chunk is prefilled chunk by
chunk with decode steps in between; either way its tokens must be those of
``engine.generate([prompt], ...)`` alone, greedy and seeded, token for token.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpar import ParallelConfig
from jaxpar.engine import ContinuousBatcher, Sampling
from jaxpar.engine._kv_budget import KVBudget
from jaxpar.inspect import parse_collectives
from tests._tiers import sweep
from tests.test_batching import CONFIG, SAMPLED, _engine, _offline
from tests.test_paged_serving import _balanced

PAGE = 4


def _shared_prefix_requests() -> list[dict]:
    """Prompts over one 10-token system prefix (two full pages and half of one), then
    diverging; one repeats a prompt whole; plus long prompts for the chunks."""
    rng = np.random.default_rng(3)
    system = rng.integers(1, CONFIG.vocab_size, 10).tolist()
    out = []
    for i, (suffix, n) in enumerate([(3, 6), (7, 4), (1, 5), (12, 3), (0, 4), (5, 1)]):
        prompt = system + rng.integers(1, CONFIG.vocab_size, suffix).tolist()
        sampling = SAMPLED if i % 2 else Sampling()
        out.append(dict(prompt=prompt, max_tokens=n, sampling=sampling, seed=i))
    out.append(dict(out[0], seed=9))  # the same prompt again: all but its last page cached
    for length, n in [(24, 4), (27, 3)]:  # 8-token chunks that do and do not divide it
        prompt = rng.integers(1, CONFIG.vocab_size, length).tolist()
        out.append(dict(prompt=prompt, max_tokens=n, sampling=Sampling(), seed=0))
    return out


def _serve_and_check(batcher: ContinuousBatcher, expected, requests, sequential: int = 2):
    """Submits the first ``sequential`` requests one by one (so later ones find their pages
    cached), then the rest at once; every result must equal its offline run (``expected``)."""
    streams = []
    for r in requests[:sequential]:
        streams.append(batcher.submit(**r))
        streams[-1].result(timeout=120)
    streams += [batcher.submit(**r) for r in requests[sequential:]]
    got = [s.result(timeout=120) for s in streams]
    assert got == expected
    return streams


@pytest.mark.parametrize(
    "parallel,layer_loop",
    sweep(
        [
            (ParallelConfig(), "unrolled"),
            (ParallelConfig(dp=2, tp=2), "scan"),
            (ParallelConfig(sp=2), "unrolled"),
        ],
        lambda p: p[0].size == 1,
    ),
    ids=["single", "dp2-tp2-scan", "sp2"],
)
def test_prefix_hits_and_chunks_equal_offline(parallel, layer_loop):
    engine = _engine(parallel, layer_loop=layer_loop)
    budget = KVBudget(page_size=PAGE, tokens=256 * parallel.dp)
    batcher = ContinuousBatcher(
        engine, prefill_batch=2 * parallel.dp, kv_budget=budget, max_prefill_tokens=8
    )
    assert batcher.chunk_tokens == max(8 // parallel.dp // PAGE, 1) * PAGE
    requests = _shared_prefix_requests()
    expected = [_offline(engine, r) for r in requests]
    with batcher:
        batcher.warmup(range(1, 28))
        compiled = set(engine.steps._compiled)
        streams = _serve_and_check(batcher, expected, requests)
        assert set(engine.steps._compiled) == compiled  # hits and chunks: all warmed up
        stats = batcher.stats
        # The second request found the first's two full prefix pages; the repeat found
        # every full page of its prompt but the one holding its last token.
        assert streams[0].cached_tokens == 0
        assert streams[1].cached_tokens == 2 * PAGE
        whole = (len(requests[6]["prompt"]) - 1) // PAGE * PAGE
        if batcher.pool.shards == 1:
            assert streams[6].cached_tokens == whole
        else:  # its pages may be in a shard with no free row then: the other has the prefix
            assert 2 * PAGE <= streams[6].cached_tokens <= whole
        assert stats.prefix_hits >= stats.prompt_tokens_cached > 0
        assert stats.prefill_chunks >= 2  # the two long prompts, in chunks
    _balanced(batcher)
    assert batcher.pages.cached_pages > 0  # prompts' pages stay cached for later requests


# A variant: the fast tier's disaggregation is tests/test_window_pages.py's gemma2 case.
@pytest.mark.sweep
def test_disaggregated_chunks_and_hits_on_the_prefill_group():
    """Prefill sp=2 on devices 0-1 with its own pages (prefix cache, chunks); decode tp=2
    on devices 2-3 gets each finished prompt whole: its K/V moves once per prefill batch."""
    prefill = _engine(ParallelConfig(sp=2), 0, max_batch=2)
    decode = _engine(ParallelConfig(tp=2), 2)
    batcher = ContinuousBatcher(
        decode,
        prefill_engine=prefill,
        kv_budget=KVBudget(page_size=PAGE, tokens=256),
        max_prefill_tokens=8,
    )
    requests = _shared_prefix_requests()
    expected = [_offline(decode, r) for r in requests]
    with batcher:
        batcher.warmup(range(1, 28))
        compiled = set(prefill.steps._compiled), set(decode.steps._compiled)
        streams = _serve_and_check(batcher, expected, requests)
        assert (set(prefill.steps._compiled), set(decode.steps._compiled)) == compiled
        stats = batcher.stats
    assert streams[1].cached_tokens == 2 * PAGE
    assert stats.prefix_hits > 0 and stats.prefill_chunks >= 2
    assert stats.transfers == stats.prefill_batches > 0
    # K and V of every layer for each moved prompt token at least (f32).
    kv_token = 2 * CONFIG.n_layers * CONFIG.n_kv_heads * CONFIG.head_dim * 4
    assert stats.transfer_bytes >= kv_token * sum(len(r["prompt"]) for r in requests[:1])
    _balanced(batcher)
    batcher.prefill_cache.pages.check()
    assert batcher.prefill_cache.pages.used_pages == 0  # the prefill group holds no row after


def test_no_prefix_caching_computes_every_token():
    engine = _engine(ParallelConfig())
    batcher = ContinuousBatcher(
        engine, kv_budget=KVBudget(page_size=PAGE, tokens=256), prefix_caching=False
    )
    requests = _shared_prefix_requests()[:3]
    expected = [_offline(engine, r) for r in requests]
    with batcher:
        streams = _serve_and_check(batcher, expected, requests)
    assert [s.cached_tokens for s in streams] == [0, 0, 0]
    assert batcher.stats.prefix_hits == batcher.stats.prefix_queries == 0
    assert batcher.pages.cached_pages == 0


def test_eviction_under_a_tiny_pool_keeps_requests_exact():
    """Eleven usable pages: cached prefixes are evicted (least recently used first) to
    admit new prompts, and preempted requests come back through the cache."""
    engine = _engine(ParallelConfig())
    batcher = ContinuousBatcher(
        engine,
        prefill_batch=2,
        kv_budget=KVBudget(page_size=PAGE, tokens=44),
        max_prefill_tokens=8,
    )
    requests = _shared_prefix_requests()
    expected = [_offline(engine, r) for r in requests]
    with batcher:
        _serve_and_check(batcher, expected, requests, sequential=4)
        assert batcher.pages.evictions > 0
    _balanced(batcher)


@pytest.mark.parametrize(
    "parallel",
    [ParallelConfig(dp=2, tp=2), ParallelConfig(sp=2), ParallelConfig(dp=4)],
    ids=["dp2-tp2", "sp2", "dp4"],
)
def test_reading_cached_pages_moves_the_context_not_the_pool(parallel):
    """The pool's pages split over decode's batch shards; reading a prefill's context from
    them moves those pages once (a gather on the shard that holds each page), never the
    pool: the compiled read's collectives carry about the context's bytes."""
    engine = _engine(parallel)
    batcher = ContinuousBatcher(engine, kv_budget=KVBudget(page_size=PAGE, tokens=4096))
    steps, rows, n_pages = batcher.slot_steps, batcher.row_buckets()[0], 4
    pages = jax.ShapeDtypeStruct((rows, n_pages), np.int32, sharding=engine.layouts.replicated)
    program = steps._context_program(steps.abstract(), pages, engine.layouts.kv_prefill, None)
    moved = sum(c.bytes for c in parse_collectives(program))
    c = engine.model_config
    context = 2 * c.n_layers * rows * n_pages * PAGE * c.n_kv_heads * c.head_dim * 4  # f32 K, V
    pool = steps.pool_bytes_per_device()
    assert 0 < moved <= 1.1 * context < pool / 10
