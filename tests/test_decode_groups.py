"""Decode rows grouped by block-table width (:mod:`jaxpar.engine._decode_groups`).

The policy, without devices: a step splits into a short and a long dispatch exactly when
the cost model says two cost less than one, and each row lands in the group whose width
holds it; a split waits until both its programs are ready, and the warm-up lists them.
Then served requests of very different lengths, their steps split by default once the
warm-up compiled and the idle loop ran the groups' programs, equal their own offline
``generate`` token for token (one device and dp2.tp2).
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np
import pytest

from jaxpar import InferenceEngine, ParallelConfig
from jaxpar.engine import ContinuousBatcher, Sampling
from jaxpar.engine._cache import CacheManager
from jaxpar.engine._decode_groups import DecodeGrouping, StepCost, group_rows, group_tables
from jaxpar.engine._kv_budget import KVBudget
from jaxpar.engine._pages import PagePool, PageTable
from jaxpar.engine._scheduler import Scheduler, SchedulerConfig
from jaxpar.errors import ConfigError
from jaxpar.models import ExecutionOptions, ModelRun, init_params, preset
from jaxpar.spec import make_mesh
from tests._tiers import sweep

Z = 4  # tokens per page


def _bucket(need: int) -> int:
    """Rows per shard a step computes (the step's buckets: 1, then powers of two >= 4)."""
    return 1 if need == 1 else max(4, 1 << (need - 1).bit_length())


def _width(tokens: int) -> int:
    return 1 << (-(-tokens // Z) - 1).bit_length()


def _grouping(
    cost: StepCost, rows: int = 8, shards: int = 1, min_saving: float | None = None
) -> DecodeGrouping:
    return DecodeGrouping(
        cost, rows=rows, shards=shards, page_size=Z, width=_width, bucket=_bucket,
        min_saving=min_saving,
    )  # fmt: skip


POSITIONS = StepCost(dispatch_ms=1.0, row_ms=0.0, position_us=1000.0)  # reading dominates


def test_one_long_row_among_short_ones_is_split_off():
    live = [True] * 8
    lengths = [5, 6, 3, 120, 7, 2, 4, 6]  # row 3: 121 tokens -> 32 pages; others <= 2
    groups = _grouping(POSITIONS).groups(live, lengths)
    assert groups is not None
    short, long = groups
    assert long.rows == (3,) and long.width == _width(121) and long.computed == 1
    assert short.rows == (0, 1, 2, 4, 5, 6, 7) and short.width == 2 and short.computed == 8
    # Each row's group is wide enough for it, and the split reads fewer positions.
    for g in groups:
        assert all(_width(lengths[r] + 1) <= g.width for r in g.rows)
    one = 8 * _width(121)
    assert sum(len(g.rows) * g.width for g in groups) < one


def test_no_split_when_rows_share_a_width_or_a_dispatch_costs_more_than_it_saves():
    same = [20, 21, 22, 23, 20, 21, 22, 23]  # all 6 pages -> width 8
    assert _grouping(POSITIONS).groups([True] * 8, same) is None
    lengths = [5, 6, 3, 120, 7, 2, 4, 6]
    # One dispatch reads 8 rows x 32 pages; the split 8 (7 rows' bucket) x 2 and 1 x 32.
    saved_ms = 1e-3 * POSITIONS.position_us * (8 * 32 - 8 * 2 - 1 * 32) * Z
    dear = StepCost(dispatch_ms=saved_ms + 1, row_ms=0.0, position_us=POSITIONS.position_us)
    assert _grouping(dear, min_saving=0.0).groups([True] * 8, lengths) is None
    cheap = StepCost(dispatch_ms=saved_ms - 1, row_ms=0.0, position_us=POSITIONS.position_us)
    assert _grouping(cheap, min_saving=0.0).groups([True] * 8, lengths) is not None
    # By default a split must save a fifth of the step: this one saves less than 1 ms.
    assert _grouping(cheap).groups([True] * 8, lengths) is None
    with pytest.raises(ConfigError, match="min_saving"):
        _grouping(cheap, min_saving=1.0)
    # Rows the split would compute again (their bucket padding) count too.
    rows_dear = StepCost(dispatch_ms=0.0, row_ms=1e6, position_us=POSITIONS.position_us)
    assert _grouping(rows_dear, min_saving=0.0).groups([True] * 8, lengths) is None
    with pytest.raises(ConfigError, match="position_us"):
        StepCost(position_us=-1)


def test_a_split_waits_for_both_group_programs_and_warm_up_lists_them():
    lengths = [5, 6, 3, 120, 7, 2, 4, 6]
    ready: set[tuple[int, int]] = set()
    grouping = DecodeGrouping(
        POSITIONS, rows=8, shards=1, page_size=Z, width=_width, bucket=_bucket,
        ready=lambda rows, width: (rows, width) in ready,
    )  # fmt: skip
    assert grouping.groups([True] * 8, lengths) is None  # nothing compiled: one dispatch
    listed = grouping.programs([_width(n) for n in range(1, 129, Z)])
    short, long = _grouping(POSITIONS).groups([True] * 8, lengths)
    wanted = {(short.computed, short.width), (long.computed, long.width)}
    assert wanted <= set(listed)  # the warm-up compiles what this split runs
    ready |= {(long.computed, long.width)}
    assert grouping.groups([True] * 8, lengths) is None  # one of two is not enough
    ready |= wanted
    assert grouping.groups([True] * 8, lengths) == (short, long)
    # None if a dispatch costs more than any split saves.
    dear = StepCost(dispatch_ms=1e9, row_ms=0.0, position_us=1.0)
    assert _grouping(dear).programs([1, 2, 4, 8, 16, 32]) == []


def test_groups_keep_each_shards_rows_in_its_own_span():
    grouping = _grouping(POSITIONS, rows=8, shards=2)  # rows 0-3 shard 0, 4-7 shard 1
    live = [True, True, False, True, True, False, True, False]
    lengths = [3, 100, 0, 2, 90, 0, 5, 0]
    short, long = grouping.groups(live, lengths)
    assert long.rows == (1, 4) and short.rows == (0, 3, 6)
    rows_R = group_rows(short, 8, 2)
    assert rows_R.tolist() == [0, 3, -1, -1, 6, -1, -1, -1]  # 2 per shard -> bucket 4
    tables_BN = np.arange(8 * 4).reshape(8, 4)
    tables_RN = group_tables(tables_BN, rows_R)
    assert tables_RN[0].tolist() == tables_BN[0].tolist()
    assert tables_RN[4].tolist() == tables_BN[6].tolist()
    assert not tables_RN[rows_R < 0].any()  # padding rows read page 0


def test_the_scheduler_plans_split_steps_and_counts_every_row():
    pool = PagePool(Z, 80, 1, 4, 128)
    cache = CacheManager(PageTable(pool), b"test", caching=False)
    config = SchedulerConfig(2, (1, 2), 8, 16)
    sched = Scheduler(config, cache, bucket=lambda n: max(8, 1 << (n - 1).bit_length()))
    sched.grouping = _grouping(POSITIONS, rows=4)
    for row, length in enumerate([3, 100, 5, 2]):
        cache.admit(row, cache.computed(0, [], 0), length + 1)
        sched.start_decoding(row, object(), length)
    assert sched.reserve()
    plan = sched.decode_plan()
    assert plan.groups is not None
    assert sorted(r for g in plan.groups for r in g.rows) == [0, 1, 2, 3]
    assert plan.groups[1].rows == (1,)
    assert sched.lengths == [4, 101, 6, 3]  # every row counted its token once


# --- served tokens -------------------------------------------------------------------------

CONFIG = preset("tiny-gqa")
MAX_SEQ_LEN = 256


@functools.cache
def _params(layer_loop: str):
    config = ModelRun(CONFIG, ExecutionOptions(layer_loop=layer_loop))
    return config, init_params(config)


def _engine(parallel: ParallelConfig, layer_loop: str) -> InferenceEngine:
    config, params = _params(layer_loop)
    devices = jax.devices()[: parallel.size]
    return InferenceEngine(
        config,
        params,
        parallel,
        mesh=make_mesh(parallel, devices),
        max_batch=4,
        max_seq_len=MAX_SEQ_LEN,
    )


@pytest.mark.parametrize(
    "parallel,layer_loop",
    sweep(
        [(ParallelConfig(), "unrolled"), (ParallelConfig(dp=2, tp=2), "scan")],
        lambda p: p[0].size == 1,
    ),
    ids=["single", "dp2-tp2-scan"],
)
def test_served_requests_of_very_different_lengths_equal_offline_generate(parallel, layer_loop):
    engine = _engine(parallel, layer_loop)
    rng = np.random.default_rng(3)
    requests = [
        dict(prompt=rng.integers(1, CONFIG.vocab_size, n).tolist(), max_tokens=m, seed=i)
        for i, (n, m) in enumerate([(200, 12), (3, 14), (5, 10), (150, 6), (2, 16), (4, 9)])
    ]
    requests[2]["sampling"] = Sampling(temperature=0.9, top_k=20)
    requests[1]["logprobs"] = 2
    expected = [
        engine.generate(
            [r["prompt"]],
            r["max_tokens"],
            sampling=r.get("sampling", Sampling()),
            seed=r["seed"],
            logprobs=r.get("logprobs"),
        )
        for r in requests
    ]
    budget = KVBudget(page_size=Z, tokens=4 * MAX_SEQ_LEN)
    with ContinuousBatcher(engine, prefill_batch=2, kv_budget=budget) as batcher:
        sched = batcher.scheduler
        assert sched.grouping is not None  # on by default (CPU: the fitted cost model)
        # A cost model where reading dominates, and any saving taken (with dp2, 2 rows a
        # shard: few splits save a fifth), so the split is taken whenever it can be.
        sched.grouping.cost, sched.grouping.keep = POSITIONS, 1.0
        groups = [b for b in batcher.warmup_plan().buckets if b.kind == "split"]
        assert groups  # the warm-up compiles the split steps' programs
        batcher.warmup(kinds=("split",))  # (the rest compiles on first use: a lean test)
        deadline = time.monotonic() + 120
        while len(batcher.primed_groups) < len(groups) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(batcher.primed_groups) == sorted((b.rows, b.tokens // Z) for b in groups)
        split = []
        plan_of = sched.decode_plan

        def recorded():
            plan = plan_of()
            split.append(plan.groups is not None)
            return plan

        sched.decode_plan = recorded
        streams = [batcher.submit(**r) for r in requests]
        got = [s.result(timeout=120) for s in streams]
    assert got == [run.tokens[0] for run in expected]
    lp = [e.logprob for e in streams[1].logprobs]
    np.testing.assert_allclose(lp, [e.logprob for e in expected[1].logprobs[0]], atol=1e-5)
    assert any(split)  # steps were split (a long row ran beside short ones)
