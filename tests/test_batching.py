"""Continuous batching (engine level): every request equals its own offline ``generate``.

The batcher serves requests over a few decode slots, refilling them as requests finish;
each request's tokens must equal ``engine.generate([prompt], ...)`` with the same
sampling, seed and stop tokens, token for token, whatever else shares the slots. Also:
nothing compiles per request, a cancelled request frees its slot, the queue is bounded,
bad requests fail before they queue, the insert moves only the new rows, and a step's
release mask frees those slots' device state and no other slot's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxpar import ConfigError, InferenceEngine, ParallelConfig, QueueFullError, ShapeError
from jaxpar.engine import ContinuousBatcher, Request, RequestStream, RowSampling, Sampling
from jaxpar.engine._kv_budget import KVBudget
from jaxpar.engine._pages import PagePool, PageTable
from jaxpar.engine._placement import put_global
from jaxpar.engine._sampling import select, select_rows
from jaxpar.engine._slots import FirstTokens, Inserted, SlotSteps
from jaxpar.errors import CacheOverflowError
from jaxpar.inspect import parse_collectives
from jaxpar.inspect._movement import data_movement
from jaxpar.models import ExecutionOptions, ModelRun, init_params, preset
from jaxpar.spec import make_mesh
from tests._tiers import sweep

MAX_SEQ_LEN, SLOTS = 32, 4
CONFIG = preset("tiny-gqa")
SAMPLED = Sampling(temperature=0.9, top_k=20, top_p=0.9)
PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.7)


@functools.cache
def _params(layer_loop: str):
    config = ModelRun(CONFIG, ExecutionOptions(layer_loop=layer_loop))
    return config, init_params(config)


def _engine(parallel: ParallelConfig, first_device: int = 0, layer_loop="unrolled", **kw):
    config, params = _params(layer_loop)
    devices = jax.devices()[first_device : first_device + parallel.size]
    kw.setdefault("max_batch", SLOTS)
    kw.setdefault("max_seq_len", MAX_SEQ_LEN)
    return InferenceEngine(config, params, parallel, mesh=make_mesh(parallel, devices), **kw)


def _requests() -> list[dict]:
    """Eight requests for four slots: mixed prompt and output lengths, greedy and sampled
    rows, one that ends at its first token, two with stop tokens (set from offline runs);
    penalties on a sampled and a greedy row, logprobs on three rows."""
    rng = np.random.default_rng(7)
    out = []
    for i, (length, n) in enumerate([(3, 12), (9, 2), (14, 9), (5, 1), (2, 16), (11, 6)] * 2):
        if i >= 8:
            break
        prompt = rng.integers(1, CONFIG.vocab_size, length).tolist()
        sampling = SAMPLED if i % 3 == 1 else Sampling()
        if i in (4, 5):
            sampling = dataclasses.replace(sampling, **PENALTIES)
        logprobs = 3 if i in (0, 4, 6) else None
        out.append(dict(prompt=prompt, max_tokens=n, sampling=sampling, seed=i, logprobs=logprobs))
    return out


def _offline(engine: InferenceEngine, r: dict, stop_tokens=()) -> list[int]:
    return _offline_run(engine, r, stop_tokens).tokens[0]


def _offline_run(engine: InferenceEngine, r: dict, stop_tokens=()):
    return engine.generate(
        [r["prompt"]],
        r["max_tokens"],
        sampling=r["sampling"],
        seed=r["seed"],
        stop_tokens=stop_tokens,
        logprobs=r.get("logprobs"),
    )


def _check_served(batcher: ContinuousBatcher, reference: InferenceEngine) -> None:
    requests = _requests()
    # Stop tokens from the offline runs: request 0 stops at (the first occurrence of) its
    # 4th token, request 2 at a token it never emits (it runs to max_tokens).
    expected = [_offline(reference, r) for r in requests]
    stops = {0: [expected[0][3]], 2: [CONFIG.vocab_size - 1]}
    runs = [_offline_run(reference, r, stops.get(i, ())) for i, r in enumerate(requests)]
    expected = [run.tokens[0] for run in runs]
    compiled = len(batcher.engine.steps._compiled)
    streams = [batcher.submit(**r, stop_tokens=stops.get(i, ())) for i, r in enumerate(requests)]
    got = [s.result(timeout=120) for s in streams]
    assert got == expected
    for stream, run in zip(streams, runs, strict=True):  # logprobs too, where asked for
        want = [] if run.logprobs is None else run.logprobs[0]
        assert [e.token for e in stream.logprobs] == [e.token for e in want]
        np.testing.assert_allclose(
            [e.logprob for e in stream.logprobs], [e.logprob for e in want], atol=1e-5
        )
    assert [s.finish_reason for s in streams] == [
        "stop" if i == 0 else "length" for i in range(len(requests))
    ]
    assert got[0].index(stops[0][0]) == len(got[0]) - 1  # ends at its first stop token
    # Eight requests over four slots: slots were refilled; nothing compiled after warmup.
    assert batcher.stats.finished == len(requests)
    assert len(batcher.engine.steps._compiled) == compiled


@pytest.mark.parametrize(
    "parallel,layer_loop",
    sweep(
        [(ParallelConfig(), "unrolled"), (ParallelConfig(dp=2, tp=2), "scan")],
        lambda p: p[0].size == 1,
    ),
    ids=["single", "dp2-tp2-scan"],
)
def test_served_requests_equal_offline_generate(parallel, layer_loop):
    engine = _engine(parallel, layer_loop=layer_loop)
    with ContinuousBatcher(engine, prefill_batch=2) as batcher:
        buckets = batcher.warmup(range(1, 17))
        assert {length for _, length in buckets} == {8, 16}
        _check_served(batcher, engine)


def test_disaggregated_pair_must_not_share_devices():
    prefill = _engine(ParallelConfig(sp=2), 0, max_batch=2)
    decode = _engine(ParallelConfig(tp=2), 1)
    with pytest.raises(ConfigError, match="disjoint devices"):
        ContinuousBatcher(decode, prefill_engine=prefill)


def test_select_rows_draws_as_offline_select():
    """Row b with its own sampling and step draws what ``select`` draws for row 0."""
    rng = np.random.default_rng(0)
    logits_BV = rng.normal(size=(5, 64)).astype(np.float32)
    samplings = [
        Sampling(),
        Sampling(temperature=0.7),
        Sampling(temperature=1.3, top_k=3),
        Sampling(temperature=1.0, top_p=0.5),
        Sampling(temperature=0.5, top_k=10, top_p=0.8),
    ]
    seeds, steps = [3, 1, 4, 1, 5], np.array([0, 2, 7, 1, 30], np.int32)
    rows = jax.tree.map(np.asarray, RowSampling.rows(samplings, seeds))
    got = np.asarray(jax.jit(select_rows)(logits_BV, rows, steps))
    want = [
        int(select(logits_BV[b : b + 1], jax.random.fold_in(jax.random.key(s), int(t)), sp)[0])
        for b, (sp, s, t) in enumerate(zip(samplings, seeds, steps, strict=True))
    ]
    assert got.tolist() == want
    # Sampled rows really sample: other seeds draw other tokens somewhere.
    other = jax.tree.map(np.asarray, RowSampling.rows(samplings, [s + 100 for s in seeds]))
    draws = [np.asarray(jax.jit(select_rows)(logits_BV, other, steps + k)) for k in range(8)]
    assert any((d[1:] != got[1:]).any() for d in draws)
    assert all(d[0] == got[0] for d in draws)  # the greedy row never changes


def test_cancel_frees_the_slot():
    engine = _engine(ParallelConfig(), max_batch=1)
    with ContinuousBatcher(engine, prefill_batch=1) as batcher:
        batcher.warmup([4])
        long = batcher.submit([5, 6, 7, 8], max_tokens=MAX_SEQ_LEN - 3)
        waiting = batcher.submit([9, 10], max_tokens=3)
        next(iter(long))  # its first token arrived: it holds the only slot
        long.cancel()
        assert waiting.result(timeout=60) == _offline(
            engine, dict(prompt=[9, 10], max_tokens=3, sampling=Sampling(), seed=0)
        )
        assert long.finish_reason == "cancelled"
        assert len(long.tokens) < MAX_SEQ_LEN - 3
        assert batcher.active == 0


def test_queue_is_bounded_and_bad_requests_fail_before_queueing():
    engine = _engine(ParallelConfig(), max_batch=1)
    batcher = ContinuousBatcher(engine, max_queue=2)  # not started: nothing drains
    for bad, error, match in [
        ([], ShapeError, "is empty"),
        ([1, CONFIG.vocab_size], ShapeError, "outside the vocabulary"),
        ([1.5, 2.0], ShapeError, "integers"),
        ([1] * (MAX_SEQ_LEN + 1), CacheOverflowError, "max_seq_len"),
    ]:
        with pytest.raises(error, match=match):
            batcher.submit(bad, max_tokens=1)
    with pytest.raises(CacheOverflowError, match="lower max_tokens to at most 23"):
        batcher.submit([1] * 10, max_tokens=24)
    with pytest.raises(ShapeError, match="max_tokens"):
        batcher.submit([1], max_tokens=0)
    queued = [batcher.submit([1], max_tokens=1), batcher.submit([2], max_tokens=1)]
    with pytest.raises(QueueFullError, match="max_queue=2"):
        batcher.submit([3], max_tokens=1)
    assert batcher.queued == 2
    batcher.close()
    assert [s.finish_reason for s in queued] == ["shutdown", "shutdown"]  # none left waiting
    assert batcher.stats.finished == batcher.stats.submitted == 2  # and counted
    with pytest.raises(QueueFullError, match="shutting down"):
        batcher.submit([3], max_tokens=1)


def test_a_request_is_counted_before_anyone_can_see_it_finish():
    """``stats.finished`` is read by clients right after ``result()``: the stream's
    ``on_finish`` (the batcher's count) runs before it is done, once."""
    seen = []
    stream = RequestStream(
        0, Request(prompt=(1,), max_tokens=2), on_finish=lambda: seen.append(stream.done)
    )
    assert stream.emit(5) is None and seen == []
    assert stream.emit(6) == "length"
    stream.finish("shutdown")  # a second finish changes nothing and is not counted
    assert seen == [False]
    assert stream.finish_reason == "length" and stream.result(timeout=0) == [5, 6]


def test_close_ends_running_requests_and_drain_finishes_them():
    engine = _engine(ParallelConfig(), max_batch=2)
    batcher = ContinuousBatcher(engine, prefill_batch=1).start()
    batcher.warmup([3])
    kept = batcher.submit([1, 2, 3], max_tokens=6)
    batcher.close(drain=True, timeout=60)
    assert kept.finish_reason == "length" and len(kept.tokens) == 6
    batcher = ContinuousBatcher(engine, prefill_batch=1).start()
    running = batcher.submit([1, 2, 3], max_tokens=MAX_SEQ_LEN - 2)
    next(iter(running))
    batcher.close()
    assert running.finish_reason == "shutdown"
    assert not batcher.running


def test_what_pipelined_serving_does_not_compose_with_is_refused_with_a_clear_error():
    engine = _engine(ParallelConfig(pp=2))
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="speculative decoding does not compose"):
        ContinuousBatcher(engine, speculative=ngram)
    with pytest.raises(ConfigError, match="split_decode runs unpipelined steps"):
        ContinuousBatcher(engine, split_decode=True)


def test_insert_writes_only_the_new_pages():
    """The insert's compiled program copies no pool-sized buffer, and what it moves
    between devices is the new rows' K/V (gathered over dp), not the pool."""
    engine = _engine(ParallelConfig(dp=2, tp=2))
    batcher = ContinuousBatcher(engine, prefill_batch=2, kv_budget=KVBudget(tokens=256))
    batcher.warmup([16])
    (name, key), compiled = next(
        ((k[0], k[1:]), c) for k, c in engine.steps._compiled.items() if k[0] == "insert"
    )
    hlo = compiled.as_text()
    dp, tp = 2, 2
    k_heads = CONFIG.n_kv_heads // tp
    pool = batcher.pool
    layer_pool = k_heads * pool.pages_per_shard * pool.page_size * CONFIG.head_dim * 4
    assert not data_movement(hlo, [layer_pool])
    new_rows = 2 * CONFIG.n_layers * 2 * k_heads * 16 * CONFIG.head_dim * 4  # K+V, 2 rows
    moved = sum(c.bytes for c in parse_collectives(hlo))
    whole_pool = 2 * CONFIG.n_layers * layer_pool * dp
    assert moved <= new_rows * dp, (moved, new_rows)
    assert moved < whole_pool / 2


def test_capacity_limited_moe_serves_as_offline_and_counts_its_drops():
    """tiny-moe with capacity factor 0.5 drops expert assignments: served tokens still equal
    the offline ones, and the drops are counted (never silent): at least the offline runs'
    (the step drawn after a request's last token drops its own)."""
    config = ModelRun(preset("tiny-moe"), ExecutionOptions(moe_capacity_factor=0.5))
    mesh = make_mesh(ParallelConfig(), jax.devices()[:1])
    engine = InferenceEngine(
        config, init_params(config), mesh=mesh, max_batch=1, max_seq_len=MAX_SEQ_LEN
    )
    prompts = [[5, 6, 7, 8, 9], [3, 1, 4]]
    offline = [engine.generate([p], 6) for p in prompts]
    assert all(g.moe_dropped_total > 0 for g in offline)
    with ContinuousBatcher(engine, prefill_batch=1) as batcher:
        batcher.warmup([5])
        streams = [batcher.submit(p, max_tokens=6) for p in prompts]
        assert [s.result(timeout=60) for s in streams] == [g.tokens[0] for g in offline]
        assert batcher.stats.moe_dropped >= sum(g.moe_dropped_total for g in offline)


def _insert(engine, slot_steps: SlotSteps, table: PageTable, prompts, slot_P, slots=None):
    """``slots`` (default: all free) with ``prompts`` prefilled (greedy) and inserted at
    ``slot_P``, with pages from ``table``, as the batcher does it (the prefill's padding
    rows are dropped)."""
    tokens_PT, lengths_P = engine.pad_prompts(prompts)
    rows = tokens_PT.shape[0]
    lay = engine.layouts
    lengths = put_global(lengths_P, lay.lengths_prefill_B)
    logits_PV, k, v = engine.steps.prefill(
        engine.params, put_global(tokens_PT, lay.tokens_BT), lengths
    )
    sampling_P = RowSampling.rows([Sampling()] * rows, [0] * rows)
    first_P, _ = FirstTokens(engine.steps)(logits_PV, sampling_P)
    new = Inserted(k=k, v=v, lengths_P=lengths, first_P=first_P)
    slots = slot_steps.empty() if slots is None else slots
    rows_P = np.full(rows, slot_steps.n_slots)
    rows_P[: len(slot_P)] = slot_P
    n = table.pool.pages_for(tokens_PT.shape[1])
    pages_PN = np.full((rows, n), table.pool.pages, np.int32)
    for i, (slot, prompt) in enumerate(zip(slot_P, prompts, strict=True)):
        assert table.grow(slot, len(prompt) + 1)
        pages_PN[i] = table.global_ids(slot, n)
    return slot_steps.insert(slots, new, rows_P, pages_PN, np.zeros(rows, np.int32), sampling_P)


def _host_state(slots, table: PageTable) -> dict[str, np.ndarray]:
    """Every per-row field of ``slots`` on the host, each with the rows on axis 0; K/V
    are each row's pages ``[B, L, K, N, Z, H]`` (read through the table)."""
    pool = table.pool

    def pages(layers):
        out = []
        for row in range(pool.rows):
            ids = table.tables_BN[row] + table.shard(row) * pool.pages_per_shard
            held = np.arange(len(ids)) < table.held_B[row]  # the rest: the scratch page
            out.append(np.stack([np.asarray(x)[:, ids] * held[:, None, None] for x in layers]))
        return np.stack(out)

    return dict(
        active=np.asarray(slots.active_B),
        lengths=np.asarray(slots.lengths_B),
        tokens=np.asarray(slots.tokens_B),
        step=np.asarray(slots.step_B),
        k=pages(slots.k),
        v=pages(slots.v),
    )


def test_step_frees_released_slots_by_state_and_leaves_the_others():
    """A step with a release mask frees those rows on the device (inactive, length 0, no
    token drawn, step not advanced) and computes the other rows exactly as a step without
    it, pages included; a released row then takes a new request as a free one does."""
    engine = _engine(ParallelConfig(dp=2))  # rows 0-1 on one device, 2-3 on the other
    pool = PagePool(page_size=4, pages_per_shard=12, shards=2, rows=SLOTS, max_seq_len=MAX_SEQ_LEN)
    slot_steps = SlotSteps(engine.steps, engine.program.run, pool)
    prompts, all_slots = [[5, 6, 7], [1, 2, 3, 4, 5], [9, 8], [3, 3, 3, 3]], np.arange(SLOTS)
    keep_B, release_B = np.zeros(SLOTS, bool), np.array([True, False, False, True])

    def step(slots, table, release):
        tables = slot_steps.tables(table.tables_BN)
        slots, tokens_B, *_ = slot_steps.step(engine.params, slots, release, tables)
        return slots, np.asarray(tokens_B)

    def inserted(prompts, slot_P, slots=None, table=None):
        table = table or PageTable(pool)
        return _insert(engine, slot_steps, table, prompts, slot_P, slots), table

    slots, table = inserted(prompts, all_slots)
    before = _host_state(slots, table)
    kept, kept_tokens = step(*inserted(prompts, all_slots), keep_B)
    slots, freed_table = inserted(prompts, all_slots)
    freed, freed_tokens = step(slots, freed_table, release_B)
    kept_state, freed_state = _host_state(kept, table), _host_state(freed, freed_table)
    assert before["active"].all() and kept_state["active"].all()  # the release frees them
    np.testing.assert_array_equal(kept_state["lengths"], before["lengths"] + 1)
    # Released: inactive, length 0, token 0, step not advanced, no token drawn.
    np.testing.assert_array_equal(freed_state["active"], ~release_B)
    np.testing.assert_array_equal(freed_state["lengths"][release_B], 0)
    np.testing.assert_array_equal(freed_state["tokens"][release_B], 0)
    np.testing.assert_array_equal(freed_state["step"][release_B], before["step"][release_B])
    np.testing.assert_array_equal(freed_tokens[release_B], -1)
    # Their pages are untouched by the step (it wrote nothing for them) ...
    np.testing.assert_array_equal(freed_state["k"][release_B], before["k"][release_B])
    # ... while the kept rows wrote their new token into theirs.
    assert (kept_state["k"][release_B] != before["k"][release_B]).any()
    # The others: exactly as without the release, pages included.
    for field, got in freed_state.items():
        np.testing.assert_array_equal(got[~release_B], kept_state[field][~release_B], field)
    np.testing.assert_array_equal(freed_tokens[~release_B], kept_tokens[~release_B])

    # Reuse: a request written into released row 0 (its pages given back and taken again)
    # steps as it does in a free row 0, and released row 3 stays free.
    new = [[4, 2, 7, 1]]
    for row in np.nonzero(release_B)[0]:
        freed_table.release(row)
    fresh_slots, fresh_table = inserted(new, [0])
    fresh, fresh_tokens = step(fresh_slots, fresh_table, keep_B)
    reused_slots, _ = inserted(new, [0], freed, freed_table)
    reused, reused_tokens = step(reused_slots, freed_table, keep_B)
    fresh, reused = _host_state(fresh, fresh_table), _host_state(reused, freed_table)
    for field, got in reused.items():
        np.testing.assert_array_equal(got[0], fresh[field][0], field)
    assert reused_tokens[0] == fresh_tokens[0] != -1
    assert not reused["active"][3] and reused["lengths"][3] == 0 and reused_tokens[3] == -1
