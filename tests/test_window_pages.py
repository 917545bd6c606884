"""Sliding-window layers give back their pages: the page table's rule, the batcher's tokens
and logprobs against a whole-sequence prefill, and the sizing figures.

The model is the ``mistral`` fixture (every layer slides) with its window shortened to 4
tokens, far below the 11- to 22-token prompts and the 40-token rows: a row then holds at
most 2 pages of 4 tokens while it decodes. The reference is one prefill of the whole
sequence (no cache at all), which masks the same window.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar import ParallelConfig
from jaxpar.cli._explain import tensor_rows
from jaxpar.engine import (
    ContinuousBatcher,
    InferenceEngine,
    cache_fraction,
    kv_cache_tokens_for,
    sequence_pages,
)
from jaxpar.engine._kv_budget import KVBudget, describe
from jaxpar.engine._pages import PagePool, PageTable
from jaxpar.engine._prefix import cache_salt, page_keys
from jaxpar.models import (
    SCRATCH_PAGE,
    PagedKVCache,
    WindowConfig,
    config_from_hf,
    kv_groups,
    kv_positions,
    kv_windows,
    load_hf_checkpoint,
)
from jaxpar.plan import Workload, load_hardware, predict, serve_flags
from jaxpar.plan._memory import memory
from jaxpar.spec import Phase, make_mesh
from tests._tiers import sweep

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FIXTURE = FIXTURES / "mistral"
HUB = Path(__file__).parent / "fixtures" / "configs"
Z = 4  # page size
WINDOW = 4
SALT = cache_salt("test_window_pages")


def _hub_config(name: str) -> dict:
    return json.loads((HUB / name / "config.json").read_text())


# -- the page table's rule ---------------------------------------------------------------


def _table(window: int | None = WINDOW, pages: int = 12) -> PageTable:
    return PageTable(PagePool(Z, pages, 1, 2, 40, (window,)))


def test_pages_leave_when_they_leave_every_querys_window():
    """A query at position p attends from p - W + 1: page c goes exactly when its last
    position 4c + 3 falls below that, i.e. at p = 4c + 3 + W; never without a window."""
    table = _table()
    table.grow(0, 40)
    for query in range(41):
        table.trim(0, query)
        first = int(table.first_B[0])
        # Every released page is wholly before the window; the first kept one is not.
        assert all(4 * c + 3 < query - WINDOW + 1 for c in range(first))
        assert first == 10 or 4 * first + 3 >= query - WINDOW + 1
        assert (table.tables_BN[0, :first] == SCRATCH_PAGE).all()
        table.check()
    assert first == 9  # query 40 (past the row) reaches back to position 37: page 9
    assert table.free_pages(0) == 11 - 1  # one page still held
    no_window = _table(None)
    no_window.grow(0, 40)
    assert no_window.trim(0, 40) == 0 and no_window.first_B[0] == 0


def test_a_released_page_the_prefix_cache_holds_survives_and_serves_a_hit():
    table = _table()
    tokens = list(range(100, 116))  # four full pages
    keys = page_keys(tokens, Z, SALT)
    table.grow(0, 17)
    table.register(0, keys)
    held = table.tables_BN[0, :4].tolist()
    assert table.trim(0, 16) == 3  # the query at 16 reads from 13: page 3 on
    assert table.cached_pages == 3  # indexed: cached, not freed
    table.check()
    # Another row's prompt starts with the same 16 tokens and one more: its first computed
    # query sits at 16, whose window needs page 3 only; pages 0-2 are not shared.
    hit = table.lookup(0, keys)
    assert hit == [None, None, None, held[3]]
    table.share(1, hit)
    assert table.first_B[1] == 3 and table.held_B[1] == 4
    assert table.refs[0, held[3]] == 2
    table.check()
    ids = table.global_ids(1, 4)
    assert ids[:3].tolist() == [table.pool.pages] * 3  # released columns read zeros
    table.release(0)
    table.release(1)
    table.check()
    assert table.used_pages == 0


def test_a_hit_whose_window_reaches_an_evicted_page_is_shortened():
    table = _table(pages=6)  # five usable pages
    tokens = list(range(100, 116))
    keys = page_keys(tokens, Z, SALT)
    table.grow(0, 16)
    table.register(0, keys)
    pages = table.tables_BN[0, :4].tolist()
    table.release(0)  # all four cached; the last is least recently used
    table.grow(1, 8)  # takes the free page, then evicts page 3 (the prefix's tail)
    assert table.evictions == 1
    hit = table.lookup(0, keys)
    # Four pages would need page 3 (gone); three need page 2 only (query 12 reads from 9).
    assert hit == [None, None, pages[2]]
    table.release(1)
    table.check()


# -- sizing --------------------------------------------------------------------------------


def test_pool_figures_count_the_window():
    pool = PagePool(Z, 41, 1, 8, 128, (WINDOW,))
    assert pool.row_pages == 2  # the window's page and the new token's
    assert pool.seq_pages(64) == 2 and pool.seq_pages(3) == 1
    assert PagePool(Z, 41, 1, 8, 128, (9,)).row_pages == 3  # 9 positions span up to 3 pages
    assert PagePool(Z, 41, 1, 8, 128, (10,)).row_pages == 4
    assert PagePool(Z, 41, 1, 8, 128).seq_pages(64) == 16
    line = describe(pool, 1 << 20)
    assert "8 sequences of 64 tokens fit" in line  # 40 pages / 2 per row, at most 8 rows
    assert "4-token window are released (at most 2 per decoding row)" in line
    assert "2 sequences of 64 tokens" in describe(PagePool(Z, 41, 1, 8, 128), 1 << 20)
    grouped = PagePool(Z, 49, 1, 4, 40, (None, WINDOW))  # 10 + 2 pages per 37-token row
    assert grouped.row_pages == 12 and grouped.seq_pages(20) == 5 + 2
    line = describe(grouped, 1 << 20)
    assert "48 pages x 4 tokens of 2 KV groups" in line and "(at most 12 per decoding row)" in line


# -- served over pages ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def windowed():
    config, params = load_hf_checkpoint(FIXTURE)
    config = dataclasses.replace(config, window=WindowConfig(size=WINDOW))
    assert kv_windows(config) == (WINDOW,)
    return config, params


def _requests(vocab: int, n: int = 3) -> list[dict]:
    """A 9-token prefix shared by every prompt (two full pages cached for later ones), one
    prompt longer than an 8-token chunk; all greedy, with logprobs."""
    rng = np.random.default_rng(7)
    system = rng.integers(3, vocab, 9).tolist()
    return [
        dict(prompt=system + rng.integers(3, vocab, n).tolist(), max_tokens=m, logprobs=0)
        for n, m in [(2, 24), (13, 16), (6, 20), (4, 22)][:n]
    ]


def _serve_and_check(
    engine: InferenceEngine,
    prefill: InferenceEngine | None = None,
    tokens: int = 96,
    together: bool = False,
):
    """Serves the requests (the first alone, its pages cached, unless ``together``: four
    at once) on a pool of ``tokens`` tokens; checks the pages each decoding row holds per
    group, and every token and logprob against one whole-sequence prefill."""
    budget = KVBudget(page_size=Z, tokens=tokens)
    batcher = ContinuousBatcher(
        engine, prefill_engine=prefill, prefill_batch=2, kv_budget=budget, max_prefill_tokens=8
    )
    pool = batcher.pool
    assert pool.window == WINDOW
    scheduler = batcher.scheduler
    reserve, owners = scheduler.reserve, scheduler.owners
    held = {g: [] for g in range(pool.groups)}

    def spy():  # pages each decoding row holds per group once its next token has one
        ok = reserve()
        pages = batcher.pages
        for g in held:
            held[g] += [
                int(pages.held_GB[g, i] - pages.first_GB[g, i]) for i, s in enumerate(owners) if s
            ]
        pages.check()
        return ok

    scheduler.reserve = spy
    requests = _requests(engine.model_config.vocab_size, 4 if together else 3)
    with batcher:
        streams = []
        if not together:
            streams.append(batcher.submit(**requests[0]))
            streams[0].result(timeout=120)
        streams += [batcher.submit(**r) for r in requests[len(streams) :]]
        got = [s.result(timeout=120) for s in streams]
    assert batcher.stats.prompt_tokens_cached > 0  # later prompts continued cached pages
    assert batcher.stats.prefill_chunks >= 1  # the 22-token prompt came in chunks
    for g, window in enumerate(pool.windows):  # rows of up to 37 tokens: 10 pages
        assert max(held[g]) == (10 if window is None else 2), f"group {g}"
    batcher.pages.check()
    assert batcher.pages.used_pages == 0
    padded, lengths = engine.pad_prompts(
        [r["prompt"] + t[:-1] for r, t in zip(requests, got, strict=True)]
    )
    logits = np.asarray(engine.prefill_logits(padded, lengths), np.float32)
    for row, (request, tokens, stream) in enumerate(zip(requests, got, streams, strict=True)):
        start = len(request["prompt"]) - 1
        want = logits[row, start : start + len(tokens)]
        assert want.argmax(-1).tolist() == tokens, f"row {row}"
        logprob = jax.nn.log_softmax(want, -1)[np.arange(len(tokens)), tokens]
        served = [lp.logprob for lp in stream.logprobs]
        np.testing.assert_allclose(served, logprob, atol=1e-4, rtol=0, err_msg=f"row {row}")
    return batcher


def test_served_with_released_pages_equals_whole_prefill(windowed):
    """Chunked prefill, prefix hits (whose head pages were released: the hit serves from
    the window on) and decode over released pages give every greedy token and its logprob
    of one whole-sequence prefill (one table; the sharded pool: Gemma 2's test below)."""
    config, params = windowed
    engine = InferenceEngine(config, params, ParallelConfig(), max_batch=4, max_seq_len=40)
    _serve_and_check(engine)


# -- KV groups: sliding layers mixed with full ones -----------------------------------------


def test_layers_fall_into_groups_of_the_rarer_kinds_count():
    """Gemma 3 1B's 26 layers (every sixth global): 4 global ones make the width; the 22
    sliding ones fill 6 window groups, the last with 2 of its 4 positions."""
    config = config_from_hf(_hub_config("gemma-3-1b"), source="gemma-3-1b")
    groups = kv_groups(config)
    assert groups.width == 4 and groups.windows == (None,) + (512,) * 6
    for g in range(groups.n_groups):
        layers = [i for i in range(26) if groups.group_of[i] == g]
        assert all(config.layer_slides(i) == (groups.windows[g] is not None) for i in layers)
        assert sorted(groups.position_of[i] for i in layers) == list(range(len(layers)))
    assert [groups.group_of.count(g) for g in range(7)] == [4, 4, 4, 4, 4, 4, 2]
    assert kv_positions(config) == 4 and kv_windows(config) == groups.windows
    every = dataclasses.replace(config, window=WindowConfig(size=config.window.size))  # all slide
    assert kv_groups(every) is None and kv_windows(every) == (512,)


def _grouped(pages: int = 16) -> PageTable:
    return PageTable(PagePool(Z, pages, 1, 2, 40, (None, WINDOW)))


def test_only_the_window_group_gives_pages_back():
    table = _grouped()
    assert table.grow(0, 21)  # 6 pages per group from one free list
    assert table.free_pages(0) == 15 - 12
    assert not table.can_grow(0, 29)  # two more per group: 4 > 3
    assert table.trim(0, 20) == 4  # the window group keeps pages 4 and 5 (query 20 reads 17)
    assert table.first_GB[:, 0].tolist() == [0, 4]
    assert table.free_pages(0) == 7 and table.grow(0, 29)
    ids = table.global_ids(0, 8)
    assert ids.shape == (2, 8) and (ids[1, :4] == table.pool.pages).all()
    assert (ids[0] < table.pool.pages).all()
    steps = table.step_tables(8)
    assert steps.shape == (2, 2, 8) and (steps[1, 0, :4] == SCRATCH_PAGE).all()
    table.check()
    table.release(0)
    table.check()
    assert table.used_pages == 0 and table.free_pages(0) == 15


def test_a_grouped_hit_is_what_every_group_can_serve():
    """The full group needs every page of a hit, the window group the pages its window
    reaches; each group's pages are keyed apart. Window pages released while the row ran
    are cached (evicted first: released first); losing those before the hit's window
    costs nothing, losing a full-group page the hit needs shortens it."""
    table = _grouped(pages=15)  # 14 usable
    keys = page_keys(list(range(100, 124)), Z, SALT)  # six full pages
    table.grow(0, 24)
    table.register(0, keys)
    full, window = (table.tables_GBN[g, 0, :6].tolist() for g in range(2))
    assert table.trim(0, 24) == 5  # window pages 0-4 released, still cached
    assert table.cached_pages == 5
    hit = table.lookup(0, keys)
    assert hit == [(full[c], None) for c in range(5)] + [(full[5], window[5])]
    table.release(0)  # LRU: window 4, 3, 2, 1, 0, then full 5, ..., 0, then window 5
    assert table.grow(1, 12)  # 6 pages: the 2 free ones, and window pages 4, 3, 2, 1
    assert table.evictions == 4
    assert table.lookup(0, keys) == hit  # none of them in the window of position 24
    table.release(1)  # not indexed: freed
    assert table.grow(1, 20)  # 10 pages: 6 free, then window page 0, full pages 5, 4, 3
    assert table.evictions == 8
    # Every hit needs a full page now gone or a window page gone before: none is left
    # (3 pages: full 0-2 are cached, but the window of position 12 needs window page 2).
    assert table.lookup(0, keys) == []
    table.check()
    table.release(1)
    table.check()


@pytest.fixture(scope="module")
def gemma2():
    return load_hf_checkpoint(FIXTURES / "gemma2", layer_loop="scan")


@pytest.mark.parametrize(
    "parallel",
    sweep([ParallelConfig(), ParallelConfig(dp=2, tp=2)], lambda p: p.size > 1),
    ids=["single", "dp2-tp2"],
)
def test_gemma2_served_with_released_window_pages_equals_whole_prefill(gemma2, parallel):
    """Gemma 2 (sliding layers 0 and 2, soft caps, stacked layers): two block tables per
    row; the window group's rows hold at most 2 pages, the full group's all 10; tokens and
    logprobs as one whole-sequence prefill gives them. On one device four requests at once
    on 22 pages (12 per row at 37 tokens): rows are preempted and recomputed."""
    config, params = gemma2
    assert kv_windows(config) == (None, WINDOW)
    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    engine = InferenceEngine(config, params, parallel, max_batch=4, max_seq_len=40, mesh=mesh)
    if parallel.size == 1:
        batcher = _serve_and_check(engine, tokens=44, together=True)
        assert batcher.stats.preemptions > 0
    else:
        _serve_and_check(engine)


def test_gemma2_disaggregated_decode_releases_what_the_prefill_group_sent(gemma2):
    """Prefill tp=2 on devices 0-1 keeps every page of its own pool (whole prompts move
    on, read back through both groups' tables); decode tp=2 on devices 2-3 releases."""
    config, params = gemma2

    def engine(parallel, first, rows):
        mesh = make_mesh(parallel, jax.devices()[first : first + parallel.size])
        return InferenceEngine(config, params, parallel, max_batch=rows, max_seq_len=40, mesh=mesh)

    prefill = engine(ParallelConfig(tp=2), 0, 2)
    batcher = _serve_and_check(engine(ParallelConfig(tp=2), 2, 4), prefill)
    assert batcher.prefill_cache.pages.pool.windows == (None, None)
    batcher.prefill_cache.pages.check()


def test_a_model_without_windows_keeps_one_table_and_its_layers():
    config = config_from_hf(_hub_config("llama-3-8b"), source="llama-3-8b")
    assert kv_groups(config) is None and kv_windows(config) == (None,)
    assert kv_positions(config) == config.n_layers
    axes = PagedKVCache.logical_axes(config)
    assert axes.block_tables_BN == ("batch", None) and axes.groups is None


# -- what plan and explain count -------------------------------------------------------------


def test_sequence_pages_and_budget_of_hub_shapes():
    """Gemma 2 9B at 8,192 tokens in pages of 16: the 21 global layers hold 512 pages, the
    21 sliding ones (4,096-token window) 257; GPT-OSS 20B's 128-token window 9 of 2,048.
    A served plan counts that share of the full cache, and its ``--kv-cache-tokens``."""
    gemma = config_from_hf(_hub_config("gemma-2-9b"), source="gemma-2-9b")
    need = sequence_pages(gemma, 8192, 16)
    assert [(g.layers, g.window, g.pages) for g in need] == [(21, None, 512), (21, 4096, 257)]
    assert cache_fraction(gemma, 8192, 16) == (512 + 257) / (2 * 512)
    oss = config_from_hf(_hub_config("gpt-oss-20b"), source="gpt-oss-20b")
    assert [g.pages for g in sequence_pages(oss, 32768, 16)] == [2048, 9]
    # 8 rows: 8 x (512 + 257) pages of 21 layers, as tokens of every layer.
    assert kv_cache_tokens_for(gemma, 8, 8192, 16) == 8 * (512 + 257) * 16 // 2
    llama = config_from_hf(_hub_config("llama-3-8b"), source="llama-3-8b")
    assert kv_cache_tokens_for(llama, 8, 8192, 16) == 8 * 8192
    served = memory(gemma, ParallelConfig(tp=8), batch=8, prompt_len=512, max_seq_len=8192)
    windowed = memory(
        gemma, ParallelConfig(tp=8), batch=8, prompt_len=512, max_seq_len=8192, release_windows=True
    )
    assert windowed.kv_cache == math.ceil(served.kv_cache * (512 + 257) / 1024)
    pred = predict(
        gemma,
        ParallelConfig(tp=8),
        Workload(batch=8, prompt_len=512, gen_len=7680, prefill_batch=8),
        load_hardware("h100"),
    )
    assert pred.memory.kv_cache == windowed.kv_cache
    assert f"--kv-cache-tokens {8 * (512 + 257) * 8}" in serve_flags(pred, "--hf DIR")


def test_explain_counts_the_groups_pages(gemma2):
    """The gemma2 fixture (2 sliding and 2 full layers) for 4 rows of 40 tokens in pages of
    4: a row holds 10 + 2 pages of 2 layers, so the pool is 48 pages (+ scratch) of 2
    positions, not 40 of 4 layers; one block table per group."""
    config, _ = gemma2
    rows = tensor_rows(
        config, ParallelConfig(), Phase.DECODE, batch=4, prompt_len=8, max_seq_len=40, page_size=4
    )
    pool, tables = rows[0], rows[1]
    assert list(pool["shape"]) == [2, 2, 49, 4, 12]
    assert "holds 10 + 2 (4-token window) pages" in pool["tensor"]
    assert list(tables["shape"]) == [2, 4, 10]
    assert kv_cache_tokens_for(config, 4, 40, 4) == 96  # 48 pages of half the layers
