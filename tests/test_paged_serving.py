"""Serving over the paged KV cache: admission by pages, growth, preemption, release.

Every served request must still equal its own offline ``generate`` token for token
(greedy and seeded sampling), whatever the page size and however often it is preempted;
and the host's page book must balance: every page free or held by one running row, all
free once the requests end.
"""

from __future__ import annotations

import time

import pytest

from jaxpar import ConfigError, ParallelConfig
from jaxpar.engine import ContinuousBatcher
from jaxpar.engine._kv_budget import KVBudget, describe, size_pool
from jaxpar.engine._pages import PagePool, PageTable
from jaxpar.models import SCRATCH_PAGE
from tests._tiers import sweep
from tests.test_batching import MAX_SEQ_LEN, SLOTS, _check_served, _engine


def _serve(parallel: ParallelConfig, budget: KVBudget, prefill_rows: int = 2, **kw):
    """An engine and its batcher prefilling up to ``prefill_rows`` prompts per dp shard."""
    engine = _engine(parallel, **kw)
    batcher = ContinuousBatcher(engine, prefill_batch=prefill_rows * parallel.dp, kv_budget=budget)
    return engine, batcher


def _balanced(batcher: ContinuousBatcher) -> None:
    """Every page is back on a free list, the book is consistent, usage reads 0."""
    batcher.pages.check()
    assert batcher.pages.used_pages == 0
    assert batcher.kv_cache_usage == 0
    assert (batcher.pages.tables_BN == SCRATCH_PAGE).all()


# The fast tier's paged serving is the tiny pool's single-device case below (pages of 4 over
# prompts they mostly do not divide) and the in-order wait.
@pytest.mark.parametrize("page_size", sweep([4, 5], lambda _: False), ids=["page4", "page5"])
def test_page_sizes_that_do_and_do_not_divide_the_prompts(page_size):
    engine, batcher = _serve(ParallelConfig(), KVBudget(page_size=page_size, tokens=512))
    with batcher:
        batcher.warmup(range(1, 17))
        _check_served(batcher, engine)
    assert batcher.stats.preemptions == 0
    _balanced(batcher)


@pytest.mark.parametrize(
    "parallel,shard_tokens",
    sweep(
        [
            (ParallelConfig(), 40),
            (ParallelConfig(dp=2, tp=2), 28),
            (ParallelConfig(pp=2, tp=2), 28),
        ],
        lambda p: p[0].size == 1,
    ),
    ids=["single", "dp2-tp2", "pp2-tp2"],
)
def test_a_tiny_pool_preempts_and_every_request_still_equals_offline(parallel, shard_tokens):
    """A few dozen tokens per batch shard for its rows' requests of up to 25 tokens each:
    rows run out of pages mid-decode, the latest admitted is preempted and recomputed.
    Pipelined (pp2-tp2): decode groups through the stages, drawn on the last one."""
    shards = parallel.dp  # one prompt per shard at a time: few prefill programs to warm up
    budget = KVBudget(page_size=4, tokens=shard_tokens * shards)
    engine, batcher = _serve(parallel, budget, prefill_rows=1)
    assert batcher.pool.pages_per_shard == shard_tokens // 4 + 1  # + the scratch page
    # Offline pipelined generate has no logprobs or penalties: one device is the reference.
    reference = engine if parallel.pp == 1 else _engine(ParallelConfig())
    with batcher:
        batcher.warmup(range(1, 33))
        _check_served(batcher, reference)
        assert batcher.stats.preemptions > 0
    _balanced(batcher)


def test_requests_wait_for_pages_in_order():
    """A request whose pages do not fit waits (no preemption for admission), then runs."""
    engine, batcher = _serve(ParallelConfig(), KVBudget(page_size=4, tokens=32))
    with batcher:
        batcher.warmup(range(1, 33))
        big = batcher.submit(list(range(1, 21)), max_tokens=8)  # 27 tokens: 7 of 8 pages
        small = batcher.submit([3, 4, 5], max_tokens=4)
        offline = [
            engine.generate([p], n).tokens[0] for p, n in [(list(range(1, 21)), 8), ([3, 4, 5], 4)]
        ]
        assert [big.result(timeout=60), small.result(timeout=60)] == offline
        assert small.token_times[0] > big.token_times[0]
    _balanced(batcher)


def test_page_table_refuses_double_frees_and_finds_leaks():
    table = PageTable(PagePool(page_size=4, pages_per_shard=5, shards=2, rows=4, max_seq_len=16))
    assert table.grow(0, 9) and table.held_B[0] == 3  # ceil(9 / 4)
    assert not table.grow(1, 5)  # rows 0 and 1 share shard 0: one page left, two needed
    assert table.grow(2, 16)  # shard 1 has its own four
    assert table.used_pages == 7 and table.usage == 7 / 8
    table.check()
    assert table.global_ids(2, 5).tolist() == [
        *(table.tables_BN[2, :4] + 5).tolist(),
        table.pool.pages,  # past what it holds: out of range, dropped by the insert
    ]
    assert table.release(0) == 3
    table.tables_BN[0, :3] = table.tables_BN[2, :3] - 0  # a corrupted book ...
    table.held_B[0] = 1
    with pytest.raises(RuntimeError, match="held by 1 row"):
        table.check()
    table.held_B[0] = 0
    table.tables_BN[0] = SCRATCH_PAGE
    table.held_B[1] = 1  # row 1 claims a free page
    table.tables_BN[1, 0] = table._free[0][-1]
    with pytest.raises(RuntimeError, match="already free"):
        table.release(1)


def test_pool_sizing_from_tokens_and_its_errors():
    engine = _engine(ParallelConfig(dp=2, tp=2))

    def size(budget: KVBudget) -> PagePool:
        return size_pool(
            budget,
            config=engine.parallel_config,
            mesh=engine.mesh,
            dims=engine.program.run,
            rows=SLOTS,
            max_seq_len=MAX_SEQ_LEN,
        )

    pool = size(KVBudget(page_size=8, tokens=100))
    # 13 pages over two batch shards: 7 each, plus a scratch page each.
    assert (pool.shards, pool.pages_per_shard, pool.max_seq_len) == (2, 8, MAX_SEQ_LEN)
    assert "112 tokens" in describe(pool, 0)
    small = size(KVBudget(page_size=8, tokens=16))
    assert small.max_seq_len == 8  # one page per shard: the longest request is capped
    with pytest.raises(ConfigError, match="not both"):
        KVBudget(tokens=10, memory_fraction=0.5)
    with pytest.raises(ConfigError, match="devices that report their memory"):
        size(KVBudget(memory_fraction=0.5))


@pytest.mark.sweep  # a variant: row buckets are also checked in tests/test_warmup.py
def test_a_step_computes_only_the_rows_that_cover_the_live_requests():
    """32 rows, 8 requests: steps compute the first 8 rows (the live ones lie there), yet
    every request equals its offline run; a free row past them stays untouched."""
    engine, batcher = _serve(ParallelConfig(), KVBudget(page_size=4, tokens=512), max_batch=32)
    assert batcher.slot_steps.row_buckets() == [1, 4, 8, 16, 32]  # CPU: one row, then 4+
    shapes = []
    step = batcher.slot_steps.step

    def spy(params, slots, release_B, tables, *masks):
        shapes.append(tables.shape)
        return step(params, slots, release_B, tables, *masks)

    with batcher:
        batcher.warmup(range(1, 17))
        # The idle loop runs each compiled step once first (every row released): spy after.
        plan = batcher.warmup_plan(range(1, 17)).buckets
        decode = sum(b.kind == "decode" for b in plan)
        deadline = time.monotonic() + 120
        while len(batcher.primed) < decode and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(batcher.primed) == decode
        batcher.slot_steps.step = spy
        _check_served(batcher, engine)
    assert shapes and max(rows for rows, _ in shapes) == 8  # fewer as the last rows end
    _balanced(batcher)
