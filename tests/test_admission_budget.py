"""Admission within a token budget per step, whether or not rows decode (engine level).

Eight requests are queued at once in a batcher with rows for all of them and a prefill
budget of 32 padded tokens a step (one 16-token prompt per prefill, two per step): the
first requests must decode while the later ones are still waiting, not after every
prompt was prefilled, and every request's greedy tokens must still equal its own offline
``engine.generate``. A lone request on CPU computes a one-row step
(:func:`~jaxpar.engine._slots.step_row_floor`), and nothing compiles after the warm-up.
"""

from __future__ import annotations

import threading

import jax
import numpy as np

from jaxpar import InferenceEngine, ParallelConfig
from jaxpar.engine import ContinuousBatcher, Sampling
from jaxpar.engine._kv_budget import KVBudget
from jaxpar.models import init_params, preset
from jaxpar.spec import make_mesh

CONFIG = preset("tiny-gqa")
REQUESTS, MAX_TOKENS, MAX_SEQ_LEN = 8, 6, 24


def _engine() -> InferenceEngine:
    parallel = ParallelConfig()
    mesh = make_mesh(parallel, jax.devices()[:1])
    params = init_params(CONFIG)
    return InferenceEngine(
        CONFIG, params, parallel, mesh=mesh, max_batch=REQUESTS, max_seq_len=MAX_SEQ_LEN
    )


def _record_order(streams) -> list[tuple[int, int]]:
    """Wraps each stream's ``emit``: (request, token index) in the order tokens are drawn
    (the decode loop emits every token, one at a time)."""
    events, lock = [], threading.Lock()
    for i, stream in enumerate(streams):

        def emit(token, logprob=None, *, _i=i, _emit=stream.emit, _stream=stream):
            with lock:
                events.append((_i, len(_stream.tokens)))
            return _emit(token, logprob)

        stream.emit = emit
    return events


def test_a_queue_is_prefilled_over_steps_while_its_first_requests_decode():
    engine = _engine()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, CONFIG.vocab_size, 9 + i % 6).tolist() for i in range(REQUESTS)]
    expected = [
        engine.generate([p], MAX_TOKENS, sampling=Sampling(), seed=i).tokens[0]
        for i, p in enumerate(prompts)
    ]
    budget = KVBudget(page_size=8, tokens=512)
    batcher = ContinuousBatcher(
        engine, kv_budget=budget, prefix_caching=False, max_prefill_tokens=32
    )
    assert batcher.slot_steps.row_buckets()[0] == 1  # CPU: a lone request, one row
    batcher.warmup(range(9, 15))  # the prompts' lengths: few compiles
    compiled = len(engine.steps._compiled)
    streams = [batcher.submit(p, max_tokens=MAX_TOKENS, seed=i) for i, p in enumerate(prompts)]
    events = _record_order(streams)  # all queued before the loop starts
    with batcher.start():
        got = [s.result(timeout=60) for s in streams]
    assert got == expected
    second_of_first = events.index((0, 1))
    first_of_last = events.index((REQUESTS - 1, 0))
    assert second_of_first < first_of_last, events
    assert len(engine.steps._compiled) == compiled  # nothing compiled after the warm-up
