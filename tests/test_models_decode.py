"""Prefill/decode consistency, KV cache bookkeeping, sliding window, scan compile time."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.errors import CacheOverflowError
from jaxpar.models import KVCache, ModelConfig, check_room, init_model, preset
from jaxpar.models import decode as decode_fn
from jaxpar.models import prefill as prefill_fn

TOL = 1e-5


@functools.lru_cache(maxsize=None)
def _compiled(config: ModelConfig):
    """Model state plus jitted prefill/decode, built once per config."""
    graphdef, state = nnx.split(init_model(config, seed=1))
    prefill = jax.jit(functools.partial(prefill_fn, graphdef), static_argnames="all_logits")
    decode = jax.jit(functools.partial(decode_fn, graphdef))
    return state, prefill, decode


def _right_pad(rows: list[np.ndarray], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def _prefill_then_decode(config, prompts, continuations, max_seq_len):
    """Logits of prefill (last position) then of each decode step: [B, steps + 1, V]."""
    state, prefill, decode = _compiled(config)
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = _right_pad(prompts, int(lengths.max()))
    logits, k, v = prefill(state, jnp.asarray(tokens), jnp.asarray(lengths))
    cache = KVCache.from_prefill(k, v, jnp.asarray(lengths), max_seq_len)
    out = [np.asarray(logits)]
    for step in range(continuations.shape[1]):
        cache.check_room(1)
        logits, cache = decode(state, jnp.asarray(continuations[:, step]), cache)
        out.append(np.asarray(logits))
    np.testing.assert_array_equal(cache.lengths_B, lengths + continuations.shape[1])
    return np.stack(out, axis=1)


def _full_prefill_logits(config, prompts, continuations):
    """All-position logits of prefill over prompt + continuation, gathered like the above."""
    state, prefill, _ = _compiled(config)
    rows = [np.concatenate([p, c]) for p, c in zip(prompts, continuations, strict=True)]
    lengths = np.array([len(r) for r in rows], np.int32)
    logits, _, _ = prefill(
        state, jnp.asarray(_right_pad(rows, int(lengths.max()))), jnp.asarray(lengths),
        all_logits=True,
    )
    n = continuations.shape[1]
    idx = np.array([[len(p) - 1 + s for s in range(n + 1)] for p in prompts])
    return np.asarray(logits)[np.arange(len(prompts))[:, None], idx]


def _random_prompts(config, lengths, n_new, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, config.vocab_size, size=n).astype(np.int32) for n in lengths]
    return prompts, rng.integers(0, config.vocab_size, size=(len(lengths), n_new)).astype(np.int32)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-gqa", "tiny-moe", "tiny-gpt2"])
def test_prefill_then_decode_equals_longer_prefill(name: str) -> None:
    config = preset(name)
    prompts, cont = _random_prompts(config, [7, 3, 1], n_new=5)
    got = _prefill_then_decode(config, prompts, cont, max_seq_len=16)
    want = _full_prefill_logits(config, prompts, cont)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_sliding_window_decode_matches_prefill() -> None:
    config = dataclasses.replace(preset("tiny-gqa"), sliding_window=3)
    prompts, cont = _random_prompts(config, [6, 2, 4], n_new=6, seed=3)
    got = _prefill_then_decode(config, prompts, cont, max_seq_len=16)
    np.testing.assert_allclose(got, _full_prefill_logits(config, prompts, cont), atol=TOL, rtol=0)


def test_sliding_window_hides_old_tokens() -> None:
    """One layer, window 2: token 0 reaches positions 0 and 1 only (prefill and decode)."""
    config = dataclasses.replace(preset("tiny-dense"), n_layers=1, sliding_window=2)
    state, prefill, decode = _compiled(config)
    base = np.random.default_rng(5).integers(0, 256, size=(1, 8)).astype(np.int32)
    changed = base.copy()
    changed[0, 0] = (base[0, 0] + 1) % 256
    lengths = jnp.array([8], jnp.int32)
    a = np.asarray(prefill(state, jnp.asarray(base), lengths, all_logits=True)[0])
    b = np.asarray(prefill(state, jnp.asarray(changed), lengths, all_logits=True)[0])
    assert np.abs(a[0, :2] - b[0, :2]).max() > 1e-3
    np.testing.assert_allclose(a[0, 2:], b[0, 2:], atol=TOL, rtol=0)
    decoded = []
    for tokens in (base, changed):
        _, k, v = prefill(state, jnp.asarray(tokens[:, :3]), jnp.array([3], jnp.int32))
        cache = KVCache.from_prefill(k, v, jnp.array([3], jnp.int32), 8)
        decoded.append(np.asarray(decode(state, jnp.asarray(tokens[:, 3]), cache)[0]))
    np.testing.assert_allclose(decoded[0], decoded[1], atol=TOL, rtol=0)
    np.testing.assert_allclose(decoded[0], a[:, 3], atol=TOL, rtol=0)


def test_padding_does_not_leak_into_logits() -> None:
    """Garbage after a row's length changes nothing at its real positions."""
    config = preset("tiny-gqa")
    state, prefill, _ = _compiled(config)
    tokens = np.random.default_rng(2).integers(0, 256, size=(2, 9)).astype(np.int32)
    other = tokens.copy()
    other[:, 5:] = 7
    lengths = jnp.array([5, 5], jnp.int32)
    a = prefill(state, jnp.asarray(tokens), lengths)[0]
    b = prefill(state, jnp.asarray(other), lengths)[0]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=0)


def test_cache_overflow_is_raised_on_host_before_the_step() -> None:
    config = preset("tiny-dense")
    state, prefill, decode = _compiled(config)
    tokens = jnp.ones((2, 4), jnp.int32)
    lengths = jnp.array([4, 2], jnp.int32)
    _, k, v = prefill(state, tokens, lengths)
    with pytest.raises(CacheOverflowError, match="max_seq_len=3"):
        KVCache.from_prefill(k, v, lengths, 3)
    cache = KVCache.from_prefill(k, v, lengths, 5)
    assert cache.max_seq_len == 5
    _, cache = decode(state, jnp.array([1, 1], jnp.int32), cache)  # row 0 is now full
    before = np.asarray(cache.k_LBSKH)
    with pytest.raises(CacheOverflowError, match="row 0 \\(length 5\\)"):
        cache.check_room(1)
    with pytest.raises(CacheOverflowError, match="max_seq_len=5"):
        check_room(np.array([5, 3]), 1, 5)
    check_room(np.array([4, 3]), 1, 5)  # fits exactly: no error
    np.testing.assert_array_equal(np.asarray(cache.k_LBSKH), before)


def test_decode_writes_one_slot_per_row() -> None:
    """The new K/V land at position lengths[b] of each row; nothing else changes."""
    config = preset("tiny-gqa")
    state, prefill, decode = _compiled(config)
    lengths = jnp.array([3, 1], jnp.int32)
    _, k, v = prefill(state, jnp.ones((2, 3), jnp.int32), lengths)
    cache = KVCache.from_prefill(k, v, lengths, 6)
    _, new = decode(state, jnp.array([5, 6], jnp.int32), cache)
    changed = np.any(np.asarray(new.k_LBSKH) != np.asarray(cache.k_LBSKH), axis=(0, 3, 4))
    np.testing.assert_array_equal(np.argwhere(changed), [[0, 3], [1, 1]])


def test_cache_logical_axes_and_abstract() -> None:
    axes = KVCache.logical_axes()
    assert axes.k_LBSKH == ("layers", "batch", "cache_seq", "kv_heads", "head_dim")
    assert axes.lengths_B == ("batch",)
    abstract = KVCache.abstract(preset("tiny-gqa"), batch=3, max_seq_len=10)
    assert abstract.k_LBSKH.shape == (4, 3, 10, 2, 8)
    assert abstract.lengths_B.dtype == jnp.int32


def _compile_seconds(n_layers: int) -> tuple[float, int]:
    config = dataclasses.replace(preset("tiny-dense"), n_layers=n_layers)
    graphdef, state = nnx.split(init_model(config))
    lowered = jax.jit(functools.partial(prefill_fn, graphdef)).lower(
        state, jnp.ones((2, 8), jnp.int32), jnp.full((2,), 8, jnp.int32)
    )
    start = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - start, len(lowered.as_text())


def test_compile_time_does_not_grow_with_depth() -> None:
    t2, size2 = _compile_seconds(2)
    t16, size16 = _compile_seconds(16)
    assert abs(size16 - size2) < 0.02 * size2, (size2, size16)  # one scanned body
    assert t16 < 2 * t2 + 1.0, (t2, t16)


def test_modules_are_named_in_hlo_metadata() -> None:
    config = preset("tiny-moe")
    graphdef, state = nnx.split(init_model(config))
    text = jax.jit(functools.partial(prefill_fn, graphdef)).lower(
        state, jnp.ones((1, 4), jnp.int32), jnp.array([4], jnp.int32)
    ).as_text(debug_info=True)
    for scope in ("embedding", "attention", "moe", "lm_head"):
        assert f"/{scope}/" in text, scope
