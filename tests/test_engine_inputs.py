"""Bad runtime input gets a clear jaxpar error before any device work; determinism."""

from __future__ import annotations

import numpy as np
import pytest

import jaxpar
from jaxpar.engine import Sampling
from jaxpar.spec import ParallelConfig
from tests._engine_util import PROMPTS, engine


@pytest.fixture(scope="module")
def eng():
    return engine("tiny-dense", ParallelConfig(dp=2, tp=4), max_batch=4, max_seq_len=32)


@pytest.fixture(scope="module")
def fresh():
    """A second engine of ``eng``'s model, strategy and shapes: what another process gets."""
    return engine("tiny-dense", ParallelConfig(dp=2, tp=4), max_batch=4, max_seq_len=32)


@pytest.fixture(scope="module")
def single():
    """One device, with room to spare (twice ``eng``'s max_seq_len, which changes no token:
    test_max_seq_len_boundary)."""
    return engine("tiny-dense", ParallelConfig(), max_batch=4, max_seq_len=64)


@pytest.mark.parametrize(
    ("prompts", "kwargs", "error", "match"),
    [
        (
            [[1, 2, 256]],
            {},
            jaxpar.ShapeError,
            r"token id\(s\) \[256\] outside the vocabulary \[0, 256\)",
        ),
        ([[1, -3]], {}, jaxpar.ShapeError, "outside the vocabulary"),
        ([[]], {}, jaxpar.ShapeError, "prompt 0 is empty"),
        ([], {}, jaxpar.ShapeError, "non-empty list"),
        ([[1]] * 5, {}, jaxpar.ShapeError, "5 prompts exceed the engine's max_batch=4"),
        ([[1] * 30], {"max_new_tokens": 4}, jaxpar.CacheOverflowError, "exceeds max_seq_len=32"),
        ([[1.5, 2.0]], {}, jaxpar.ShapeError, "dtype float64; token ids must be integers"),
        ([[[1, 2]]], {}, jaxpar.ShapeError, "must be a 1-D sequence"),
        ([[1, 2]], {"max_new_tokens": 0}, jaxpar.ShapeError, "max_new_tokens must be an int >= 1"),
    ],
)
def test_bad_prompts(eng, prompts, kwargs, error, match):
    kwargs.setdefault("max_new_tokens", 4)
    compiled_before = dict(eng.steps.compile_seconds)
    with pytest.raises(error, match=match):
        eng.generate(prompts, **kwargs)
    assert eng.steps.compile_seconds == compiled_before  # raised before any compile


def test_padding_refuses_ids_outside_the_vocabulary(eng):
    """``pad_prompts`` feeds the lower-level steps (``prefill_logits``): an id past the
    embedding table would read past it (NaN logits), so it is refused there too."""
    with pytest.raises(jaxpar.ShapeError, match=r"prompt 1 has token id\(s\) \[300\] outside"):
        eng.pad_prompts([[1, 2], [300]])
    with pytest.raises(jaxpar.ShapeError, match="5 prompts exceed max_batch=4"):
        eng.pad_prompts([[1]] * 5)
    tokens, lengths = eng.pad_prompts([[5, 6, 7]])
    assert tokens[0, :3].tolist() == [5, 6, 7] and lengths.tolist() == [3, 1, 1, 1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"temperature": 1.0, "top_k": 0}, "top_k must be >= 1"),
        ({"top_k": 5}, "need temperature > 0"),
    ],
)
def test_bad_sampling(kwargs, match):
    with pytest.raises(jaxpar.ConfigError, match=match):
        Sampling(**kwargs)


def test_cache_overflow_in_decode_raises_before_the_step(eng):
    tokens, lengths = eng.pad_prompts([[1, 2, 3]])
    lengths[:] = 32  # as if every row were full
    _, cache, first = eng.prefill(tokens, np.minimum(lengths, tokens.shape[1]))
    cache = cache.replace(lengths_B=cache.lengths_B + 32 - tokens.shape[1])
    with pytest.raises(jaxpar.CacheOverflowError, match="max_seq_len=32"):
        eng.decode(cache, first)


def test_illegal_strategy_rejected_before_compile():
    with pytest.raises(jaxpar.IllegalStrategyError, match="sp-prefill-tokens"):
        engine("tiny-dense", ParallelConfig(sp=8), max_seq_len=60)
    with pytest.raises(jaxpar.IllegalStrategyError, match="dp-batch-split"):
        engine("tiny-dense", ParallelConfig(dp=8), max_batch=4)


@pytest.mark.parametrize(
    "sampling",
    [Sampling(), Sampling(temperature=0.8, top_k=20, top_p=0.9)],
    ids=["greedy", "sampled"],
)
def test_deterministic_across_runs_and_engines(eng, fresh, sampling):
    first = eng.generate(PROMPTS[:4], 8, sampling=sampling, seed=7).tokens
    again = eng.generate(PROMPTS[:4], 8, sampling=sampling, seed=7).tokens
    assert fresh is not eng
    assert first == again == fresh.generate(PROMPTS[:4], 8, sampling=sampling, seed=7).tokens
    if not sampling.greedy:
        other = eng.generate(PROMPTS[:4], 8, sampling=sampling, seed=8).tokens
        assert other != first  # the seed matters


def test_sampling_is_sharding_independent(eng, single):
    """Partitionable threefry: the same seed samples the same tokens on 1 and 8 devices."""
    sampling = Sampling(temperature=1.0, top_k=50)
    assert (
        single.generate(PROMPTS[:4], 8, sampling=sampling, seed=3).tokens
        == eng.generate(PROMPTS[:4], 8, sampling=sampling, seed=3).tokens
    )


def test_streaming_callback_matches_fused_loop(eng):
    seen = []
    streamed = eng.generate(PROMPTS[:3], 6, callback=lambda step, toks: seen.append((step, toks)))
    fused = eng.generate(PROMPTS[:3], 6)
    assert streamed.tokens == fused.tokens
    assert [s for s, _ in seen] == list(range(6))
    assert [int(t[0]) for _, t in seen] == fused.tokens[0]


def test_stop_tokens_finish_sequences_individually(eng):
    full = eng.generate(PROMPTS[:3], 8).tokens
    stop = full[0][2]
    stopped = eng.generate(PROMPTS[:3], 8, stop_tokens=[stop]).tokens
    for got, whole in zip(stopped, full, strict=True):
        cut = whole.index(stop) + 1 if stop in whole else len(whole)
        assert got == whole[:cut]
    assert stopped[0] == full[0][:3]


def test_max_seq_len_past_learned_positions_is_refused():
    with pytest.raises(jaxpar.ConfigError, match="max_position_embeddings|position"):
        engine("tiny-gpt2", ParallelConfig(), max_seq_len=256)


@pytest.mark.parametrize("prompt_len", [28, 29], ids=["prompt+new=max_seq_len", "cache-full"])
def test_max_seq_len_boundary(eng, single, prompt_len):
    """prompt + 4 new = max_seq_len (32), and one more: the last new token is never cached,
    so 29 + 4 fills the cache exactly. Both equal a run with room to spare; 30 + 4 is refused."""
    prompt = [int(t) for t in np.random.default_rng(prompt_len).integers(0, 256, prompt_len)]
    got = eng.generate([prompt, PROMPTS[1]], 4).tokens
    assert got == single.generate([prompt, PROMPTS[1]], 4).tokens
    assert len(got[0]) == 4
    with pytest.raises(jaxpar.CacheOverflowError, match="max_seq_len=32"):
        eng.generate([prompt + [1] * (30 - prompt_len)], 4)


def test_max_new_tokens_does_not_recompile(eng):
    """Token counts, sampling parameters and stop lists are runtime values: 16, 17, 3 and
    1 new tokens, greedy and sampled, with different stop lists, run the same programs
    (prefill, first tokens, insert, and one decode step per block-table width)."""
    sampled = Sampling(temperature=0.7, top_k=10)
    runs, programs = {}, []
    before = set(eng.steps._compiled)  # other tests' programs, on this module's engine
    for n in (16, 17, 3, 1):
        runs[n] = eng.generate(PROMPTS[:3], n).tokens
        eng.generate(PROMPTS[:3], n, sampling=sampled, seed=1, stop_tokens=[5, 6, 7][: n % 4])
        programs.append(set(eng.steps._compiled))
    assert programs[0] == programs[-1], programs
    new = {key[0] for key in programs[-1] - before}
    assert new <= {"prefill", "first_tokens", "insert", "slot_step"}, new
    for n in (17, 3, 1):  # fewer tokens are a prefix of more (greedy)
        assert [row[:n] for row in runs[17]] == runs[n] and all(len(r) == n for r in runs[n])
