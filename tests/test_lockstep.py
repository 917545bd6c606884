"""The batcher's device work as commands (what a multi-process server sends the others).

The continuous batcher's :class:`~jaxpar.engine._executor.Executor` records every command
before it runs; a process that replays the record must end in the same device state. Here
in one process: a batcher serves requests (greedy, seeded, penalised, one preempted for
lack of pages, prefix hits, chunks of a long prompt) while a recorder keeps its commands;
a second executor over the same engine replays them and must hold bit-identical slots
(page pool, rows, sampling rows, token counts). Also: a replaying executor reads nothing
back, only commands replay, and reads flush the record first.
"""

from __future__ import annotations

import pickle

import jax
import numpy as np
import pytest

from jaxpar import InferenceEngine, ParallelConfig
from jaxpar.engine import ContinuousBatcher, Sampling
from jaxpar.engine._executor import DECODE, Executor, Recorder
from jaxpar.engine._kv_budget import KVBudget
from jaxpar.models import init_params, preset
from jaxpar.spec import make_mesh

CONFIG = preset("tiny-gqa")


class Capture(Recorder):
    """Keeps what process 0 would send: pickled commands, and where it would send them."""

    def __init__(self):
        self.records: list[bytes] = []
        self.sent = 0  # records already "sent" at the last flush
        self.flushes = 0

    def record(self, name, args, kwargs) -> None:
        self.records.append(pickle.dumps((name, args, kwargs)))

    def flush(self) -> None:
        self.flushes += 1
        self.sent = len(self.records)


@pytest.fixture(scope="module")
def engine():
    parallel = ParallelConfig(dp=2, tp=2)
    mesh = make_mesh(parallel, jax.devices()[:4])
    params = init_params(CONFIG)
    return InferenceEngine(CONFIG, params, parallel, mesh=mesh, max_batch=4, max_seq_len=64)


def _batcher(engine) -> ContinuousBatcher:
    # 12 pages of 8 tokens per shard (2 shards): tight enough to preempt; chunks of 16.
    budget = KVBudget(page_size=8, tokens=8 * 22)
    return ContinuousBatcher(engine, kv_budget=budget, max_prefill_tokens=32)


def test_replaying_the_record_reproduces_the_device_state(engine):
    batcher = _batcher(engine)
    capture = Capture()
    batcher.executor.recorder = capture
    rng = np.random.default_rng(3)
    shared = [1, *rng.integers(3, 200, 20).tolist()]  # a prefix several requests share
    prompts = [shared + [5], shared + [9, 4], [1, *rng.integers(3, 200, 40).tolist()], [1, 2]]
    samplings = [
        Sampling(),
        Sampling(temperature=0.9, top_k=20),
        Sampling(presence_penalty=0.5),
        Sampling(temperature=0.7),
    ]
    with batcher:
        streams = [
            batcher.submit(p, max_tokens=12, sampling=s, seed=i)
            for i, (p, s) in enumerate(zip(prompts * 2, samplings * 2, strict=True))
        ]
        for stream in streams:
            assert len(list(stream)) == 12
    stats = batcher.stats
    assert stats.prefix_hits > 0 and stats.prefill_chunks > 0  # both paths were recorded
    names = [pickle.loads(r)[0] for r in capture.records]
    assert {"start", "prefill", "insert", "step"} <= set(names)

    replica = Executor(
        engine,
        engine,
        batcher.slot_steps,
        None,
        batcher.first_tokens,
        keeps_outputs=False,
    )
    for record in capture.records:
        replica.replay(*pickle.loads(record))
    original = jax.device_get(batcher.executor._slots[DECODE])
    replayed = jax.device_get(replica._slots[DECODE])
    for a, b in zip(jax.tree.leaves(original), jax.tree.leaves(replayed), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not replica._outputs  # a replaying process keeps nothing to read
    assert capture.sent == len(capture.records)  # everything was sent before it went idle


def test_a_replaying_executor_reads_nothing_and_replays_only_commands(engine):
    batcher = _batcher(engine)
    replica = Executor(
        engine, engine, batcher.slot_steps, None, batcher.first_tokens, keeps_outputs=False
    )
    with pytest.raises(RuntimeError, match="reads nothing back"):
        replica.tokens(1, logprobs=False)
    with pytest.raises(ValueError, match="not an executor command"):
        replica.replay("tokens", (1,), {"logprobs": False})
