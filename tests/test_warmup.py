"""Warm-up: how many programs ``jaxpar serve`` compiles by default, and that they compile
on threads, a program two threads need compiling once.

The count is the deterministic figure the server's start line prints (and the README
states): buckets of prefill (rows x prompt tokens, up to one chunk), prefill after cached
pages (rows x new tokens x cached tokens) and decode (rows x block-table width).
"""

from __future__ import annotations

import threading
import time

import jax
import pytest

from jaxpar.cli._serve import CPU_MAX_NUM_SEQS
from jaxpar.engine import ContinuousBatcher, KVBudget, engine_from_hf
from jaxpar.engine._warmup import Warmup
from jaxpar.spec import ParallelConfig, make_mesh
from tests._serve_util import ROOT

LLAMA = ROOT / "tests" / "fixtures" / "hf" / "llama"


def _served(max_seq_len: int) -> ContinuousBatcher:
    """The batcher ``jaxpar serve`` builds by default on one CPU device."""
    parallel = ParallelConfig()
    engine = engine_from_hf(
        LLAMA,
        parallel,
        max_batch=CPU_MAX_NUM_SEQS,
        max_seq_len=max_seq_len,
        mesh=make_mesh(parallel, jax.devices()[:1]),
    )
    return ContinuousBatcher(engine, kv_budget=KVBudget())


@pytest.mark.parametrize(
    "max_seq_len,count",
    # 256: the fixture's context; 16384: what the default CPU KV cache gives a model with a
    # longer context (Llama-3.2-1B in the README). Before: 171 for 16384; 68 with 64 rows
    # and decode steps of at least 8 rows (on CPU now 16 rows, in steps of 1, 4, 8 or 16);
    # 72 since CPU prefills take 256 tokens at a time (two prefill buckets more); 107
    # since decode steps split by width by default (the groups' programs: 35; none at 256,
    # where no split saves a fifth of a step).
    [(256, 36), (16384, 107)],
)
def test_default_serve_program_count(max_seq_len, count):
    batcher = _served(max_seq_len)
    plan = batcher.warmup_plan()
    assert len(plan) == count
    assert plan.describe().startswith(f"{count} programs (prefill: rows {{1,4}} x tokens ")
    kinds = [b.kind for b in plan.buckets]
    # Prefill lengths stop at a chunk's bucket: a longer prompt is prefilled in chunks.
    chunk = batcher.prefill_engine.bucket(batcher.chunk_tokens)
    assert max(b.tokens for b in plan.buckets if b.kind == "prefill") == chunk == 256
    assert kinds.count("prefill") == len(batcher.row_buckets()) * 6  # 8, 16, ..., 256
    assert kinds.count("decode") == len(batcher.slot_steps.row_buckets()) * len(
        batcher.table_widths()
    )
    groups = batcher.scheduler.grouping.programs(batcher.table_widths())
    assert kinds.count("split") == len(groups) == (35 if max_seq_len > 256 else 0)
    assert kinds[len(kinds) - len(groups) :] == ["split"] * len(groups)  # compiled last
    # Lazy warm-up serves after the first two: the smallest prefill and decode step.
    assert plan.first == 2 and [b.kind for b in plan.buckets[:2]] == ["prefill", "decode"]
    assert plan.buckets[0].rows == 1 and plan.buckets[0].tokens == 8


def test_each_decode_step_runs_once_while_idle_then_serves_alike():
    """A compiled program's first run is slower (on CPU ~160 ms for a decode step of
    SmolLM2-135M shapes): the idle loop runs each decode step a warm-up compiled once, every
    row released, and requests afterwards draw what the offline engine draws."""
    batcher = _served(64)  # one block-table width: few programs
    engine = batcher.engine
    offline = engine.generate([[5, 6, 7, 8]], 6).tokens[0]
    with batcher:
        batcher.warmup([4])
        z = batcher.pool.page_size
        plan = batcher.warmup_plan([4]).buckets
        decode = sorted((b.rows, b.tokens // z) for b in plan if b.kind == "decode")
        deadline = time.monotonic() + 120
        while len(batcher.primed) < len(decode) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(batcher.primed) == decode  # each once
        assert batcher.submit([5, 6, 7, 8], max_tokens=6).result(timeout=60) == offline


def test_a_program_two_threads_need_compiles_once():
    batcher = _served(256)
    steps = batcher.engine.steps
    width = batcher.table_widths()[0]
    compiled, barrier = [], threading.Barrier(3)

    def compile_step() -> None:
        barrier.wait()
        compiled.append(batcher.slot_steps.compile_step(batcher.engine.params, width, 8))

    threads = [threading.Thread(target=compile_step) for _ in range(3)]
    before = steps.compiled_count()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(compiled) == 3 and all(c is compiled[0] for c in compiled)
    assert steps.compiled_count() == before + 1


def test_warmup_waits_for_the_first_jobs_and_stops_the_rest():
    gate, ran = threading.Event(), []

    def job(i: int):
        def run() -> None:
            if i >= 2:
                gate.wait(10)
            ran.append(i)

        return run

    warmup = Warmup([(f"job {i}", job(i)) for i in range(6)], threads=2).start()
    assert warmup.wait_first(2, timeout=10)
    assert not warmup.finished and sorted(ran) == [0, 1]
    warmup.stop()  # jobs 2 and 3 are running (waiting on the gate); 4 and 5 never start
    assert not warmup.wait(timeout=10)  # stopped: nothing waits for the running ones
    gate.set()
    deadline = time.monotonic() + 10
    while not warmup.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert warmup.finished and sorted(ran) == [0, 1, 2, 3]


def test_several_processes_always_warm_up_in_full(monkeypatch):
    import argparse

    from jaxpar.cli._serve import warmup_mode

    lazy = argparse.Namespace(warmup="lazy")
    assert warmup_mode(lazy) == "lazy"
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert warmup_mode(lazy) == "full"
