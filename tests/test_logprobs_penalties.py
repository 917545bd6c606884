"""Logprobs and penalties in the serving core: against NumPy, and served equal offline.

* ``generate(logprobs=k)``: each token's logprob and its ``k`` most likely alternatives
  are ``log_softmax`` of the model's logits at that position (raw: before penalties and
  temperature), as a teacher-forced prefill of the same tokens gives them.
* ``prompt_logprobs``: each prompt token's logprob given the ones before it.
* Penalties (presence, frequency, repetition): greedy decoding with them equals a NumPy
  reference that applies OpenAI's and vLLM's formulas to the prefill's logits step by
  step.
* Served requests with penalties and logprobs (sampled and greedy, beside rows without
  them, through prefix hits, chunks, preemption and eviction) equal their offline runs;
  sharded (dp=2, tp=2) runs equal one device's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxpar import ConfigError, ParallelConfig
from jaxpar.engine import ContinuousBatcher, Sampling
from jaxpar.engine._kv_budget import KVBudget
from tests.test_batching import CONFIG, SAMPLED, _engine
from tests.test_prefix_chunked import PAGE, _shared_prefix_requests

PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.7)
PENALIZED = Sampling(**PENALTIES)
TOL = 1e-5


def _log_softmax(logits_xV: np.ndarray) -> np.ndarray:
    x = logits_xV.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _teacher_forced(engine, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """log_softmax at every position of ``prompt + tokens``: ``[T, V]``."""
    ids = [*prompt, *tokens]
    tokens_BT, lengths_B = engine.pad_prompts([ids])
    return _log_softmax(np.asarray(engine.prefill_logits(tokens_BT, lengths_B))[0, : len(ids)])


@pytest.fixture(scope="module")
def engine():
    return _engine(ParallelConfig())


@pytest.mark.parametrize(
    "sampling", [Sampling(), SAMPLED, dataclasses.replace(SAMPLED, **PENALTIES)], ids=str
)
def test_generate_logprobs_are_the_models_log_softmax(engine, sampling):
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    out = engine.generate(prompts, 6, sampling=sampling, seed=3, stop_tokens=(), logprobs=4)
    assert out.tokens == engine.generate(prompts, 6, sampling=sampling, seed=3).tokens
    for prompt, tokens, entries in zip(prompts, out.tokens, out.logprobs, strict=True):
        lp_TV = _teacher_forced(engine, prompt, tokens)
        assert [e.token for e in entries] == tokens
        for i, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
            lp_V = lp_TV[len(prompt) - 1 + i]
            assert entry.logprob == pytest.approx(lp_V[token], abs=TOL)
            top_ids = [t for t, _ in entry.top]
            assert len(top_ids) == 4
            np.testing.assert_allclose([lp for _, lp in entry.top], np.sort(lp_V)[::-1][:4], TOL)
            np.testing.assert_allclose(lp_V[top_ids], [lp for _, lp in entry.top], atol=TOL)
    assert engine.generate(prompts, 2).logprobs is None


def test_prompt_logprobs_are_each_tokens_given_the_ones_before(engine):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [8]]
    scored = engine.prompt_logprobs(prompts, top=3)
    for prompt, entries in zip(prompts, scored, strict=True):
        lp_TV = _teacher_forced(engine, prompt, [])
        assert entries[0] is None and len(entries) == len(prompt)
        for t in range(1, len(prompt)):
            assert entries[t].token == prompt[t]
            assert entries[t].logprob == pytest.approx(lp_TV[t - 1, prompt[t]], abs=TOL)
            assert entries[t].top[0][1] == pytest.approx(lp_TV[t - 1].max(), abs=TOL)
            assert len(entries[t].top) == 3
    with pytest.raises(ConfigError, match="top must be in"):
        engine.prompt_logprobs(prompts, top=21)


def _penalized_greedy(engine, prompt: list[int], n: int, s: Sampling) -> list[int]:
    """Greedy decoding with ``s``'s penalties applied in NumPy to the prefill's logits."""
    tokens: list[int] = []
    for _ in range(n):
        ids = [*prompt, *tokens]
        tokens_BT, lengths_B = engine.pad_prompts([ids])
        logits = np.asarray(engine.prefill_logits(tokens_BT, lengths_B))[0, len(ids) - 1]
        logits = logits.astype(np.float64)
        counts = np.bincount(tokens, minlength=logits.size)
        seen = (counts > 0) | np.isin(np.arange(logits.size), prompt)
        r = s.repetition_penalty
        logits = np.where(seen, np.where(logits > 0, logits / r, logits * r), logits)
        logits = logits - s.frequency_penalty * counts - s.presence_penalty * (counts > 0)
        tokens.append(int(np.argmax(logits)))
    return tokens


@pytest.mark.parametrize(
    "sampling",
    [
        PENALIZED,
        Sampling(repetition_penalty=3.0),
        Sampling(presence_penalty=2.0),
        Sampling(frequency_penalty=1.5),
        Sampling(repetition_penalty=0.5, frequency_penalty=-1.0),  # rewards repeats
    ],
    ids=str,
)
def test_penalised_greedy_equals_a_numpy_reference(engine, sampling):
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 1]]
    out = engine.generate(prompts, 8, sampling=sampling, stop_tokens=())
    plain = engine.generate(prompts, 8, stop_tokens=()).tokens
    for prompt, tokens in zip(prompts, out.tokens, strict=True):
        assert tokens == _penalized_greedy(engine, prompt, 8, sampling)
    assert out.tokens != plain  # the penalties change something


def _mixed(requests: list[dict]) -> list[dict]:
    """Penalties on half the requests (greedy and sampled), logprobs on two in three:
    rows with and without either share the steps."""
    out = []
    for i, r in enumerate(requests):
        sampling = r["sampling"]
        if i % 4 < 2:
            sampling = dataclasses.replace(sampling, **PENALTIES)
        out.append(dict(r, sampling=sampling, logprobs=2 if i % 3 else None))
    return out


def _offline(engine, r: dict) -> tuple[list[int], list | None]:
    out = engine.generate(
        [r["prompt"]],
        r["max_tokens"],
        sampling=r["sampling"],
        seed=r["seed"],
        stop_tokens=(),
        logprobs=r["logprobs"],
    )
    return out.tokens[0], None if out.logprobs is None else out.logprobs[0]


def _check_logprobs(got, want) -> None:
    assert [e.token for e in got] == [e.token for e in want]
    np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in want], atol=TOL)
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        np.testing.assert_allclose([lp for _, lp in g.top], [lp for _, lp in w.top], atol=TOL)


def test_sharded_generate_equals_one_device(engine):
    """dp=2, tp=2: the token counts split over the batch shards, the logits (and the top
    alternatives' search) over tp; tokens and logprobs as on one device."""
    requests = _mixed(_shared_prefix_requests())[:2]  # penalised, greedy and sampled
    assert requests[1]["sampling"].temperature > 0 and requests[1]["sampling"].penalized
    sharded = _engine(ParallelConfig(dp=2, tp=2))
    for r in requests:
        tokens, logprobs = _offline(sharded, r | {"logprobs": 2})
        want_tokens, want_logprobs = _offline(engine, r | {"logprobs": 2})
        assert tokens == want_tokens
        _check_logprobs(logprobs, want_logprobs)


def test_served_penalties_and_logprobs_equal_offline(engine):
    """Prefix hits, chunks of long prompts, preemption and eviction (eleven usable
    pages): each request's tokens and logprobs equal its own offline run (a preempted
    request resumes with the counts of what it drew). That nothing compiles per request
    is test_batching's check, whose requests have penalties and logprobs too."""
    requests = _mixed(_shared_prefix_requests())
    expected = [_offline(engine, r) for r in requests]
    batcher = ContinuousBatcher(
        engine,
        prefill_batch=2,
        kv_budget=KVBudget(page_size=PAGE, tokens=44),
        max_prefill_tokens=8,
    )
    with batcher:
        streams = [batcher.submit(**r) for r in requests[:2]]
        streams[0].result(timeout=120)
        streams += [batcher.submit(**r) for r in requests[2:]]
        got = [s.result(timeout=120) for s in streams]
        assert got == [tokens for tokens, _ in expected]
        for stream, (_, logprobs) in zip(streams, expected, strict=True):
            if logprobs is None:
                assert stream.logprobs == []
            else:
                _check_logprobs(stream.logprobs, logprobs)
        assert batcher.stats.preemptions + batcher.pages.evictions > 0
        assert batcher.stats.prefill_chunks >= 2


def test_pipelined_generate_refuses_penalties_and_logprobs(engine):
    pipelined = _engine(ParallelConfig(pp=2))
    with pytest.raises(ConfigError, match="pp=2"):
        pipelined.generate([[1, 2]], 2, sampling=PENALIZED)
    with pytest.raises(ConfigError, match="pp=2"):
        pipelined.generate([[1, 2]], 2, logprobs=1)
    with pytest.raises(ConfigError, match="must be in"):
        engine.generate([[1, 2]], 2, logprobs=21)
    with pytest.raises(ConfigError, match="repetition_penalty"):
        Sampling(repetition_penalty=0)
    with pytest.raises(ConfigError, match="presence_penalty"):
        Sampling(presence_penalty=2.5)
    assert CONFIG.vocab_size > 20  # the alternatives above are never padding
