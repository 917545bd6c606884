"""Prefill/decode consistency and KV cache bookkeeping on every tiny preset."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.errors import CacheOverflowError
from jaxpar.models import KVCache, check_room, init_model, preset
from jaxpar.models import prefill as prefill_fn
from tests.test_models_helpers import (
    MAX_SEQ,
    TOL,
    WIDTH,
    B,
    compiled,
    full_prefill_logits,
    prefill_rows,
    prefill_then_decode,
    random_tokens,
)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-gqa", "tiny-moe", "tiny-gpt2"])
def test_prefill_then_decode_equals_longer_prefill(name: str) -> None:
    config = preset(name)
    prompts, cont = random_tokens(config, [9, 3, 1], n_new=6)
    got = prefill_then_decode(config, prompts, cont)
    np.testing.assert_allclose(got, full_prefill_logits(config, prompts, cont), atol=TOL, rtol=0)


def test_last_position_logits_equal_all_logits() -> None:
    """prefill(all_logits=False) gathers position lengths-1 of each row."""
    config = preset("tiny-gqa")
    state, _, _ = compiled(config)
    graphdef, _ = nnx.split(init_model(config))
    prompts, _ = random_tokens(config, [16, 5, 2], n_new=0, seed=4)
    all_logits, _, _, lengths = prefill_rows(config, prompts)
    tokens = jnp.asarray(np.stack([np.pad(p, (0, WIDTH - len(p))) for p in prompts]))
    last, _, _ = jax.jit(functools.partial(prefill_fn, graphdef))(state, tokens, lengths)
    np.testing.assert_allclose(np.asarray(last), all_logits[np.arange(B), lengths - 1], atol=TOL)


def test_padding_does_not_leak_into_logits() -> None:
    """Garbage after a row's length changes nothing at its real positions."""
    config = preset("tiny-gqa")
    prompts, _ = random_tokens(config, [9, 9, 9], n_new=0, seed=2)
    a, *_ = prefill_rows(config, [p[:5] for p in prompts])
    b, *_ = prefill_rows(
        config, [np.concatenate([p[:5], np.full(9, 7, np.int32)]) for p in prompts]
    )
    np.testing.assert_allclose(a[:, :5], b[:, :5], atol=TOL, rtol=0)


def test_cache_overflow_is_raised_on_host_before_the_step() -> None:
    config = preset("tiny-dense")
    state, _, decode = compiled(config)
    prompts, _ = random_tokens(config, [WIDTH, 2, 2], n_new=0)
    _, k, v, lengths = prefill_rows(config, prompts)
    with pytest.raises(CacheOverflowError, match=f"max_seq_len={WIDTH - 1}"):
        KVCache.from_prefill(k, v, jnp.asarray(lengths), WIDTH - 1)
    cache = KVCache.from_prefill(k, v, jnp.asarray(lengths), MAX_SEQ)
    assert cache.max_seq_len == MAX_SEQ
    for _ in range(MAX_SEQ - WIDTH):  # fill row 0 to the brim
        cache.check_room(1)
        _, cache = decode(state, jnp.ones((B,), jnp.int32), cache)
    assert int(cache.lengths_B[0]) == MAX_SEQ
    before = np.stack(cache.k)
    with pytest.raises(CacheOverflowError, match=f"row 0 \\(length {MAX_SEQ}\\)"):
        cache.check_room(1)
    with pytest.raises(CacheOverflowError, match="max_seq_len=5"):
        check_room(np.array([5, 3]), 1, 5)
    check_room(np.array([4, 3]), 1, 5)  # fits exactly: no error
    np.testing.assert_array_equal(np.stack(cache.k), before)


def test_decode_writes_one_slot_per_row() -> None:
    """The new K/V land at position lengths[b] of each row; nothing else changes."""
    config = preset("tiny-gqa")
    state, _, decode = compiled(config)
    prompts, _ = random_tokens(config, [3, 1, 7], n_new=0, seed=6)
    _, k, v, lengths = prefill_rows(config, prompts)
    cache = KVCache.from_prefill(k, v, jnp.asarray(lengths), MAX_SEQ)
    _, new = decode(state, jnp.array([5, 6, 7], jnp.int32), cache)
    # Per-layer caches [B, K, S, H], stacked to [L, B, K, S, H]: which (row, position) moved.
    changed = np.any(np.stack(new.k) != np.stack(cache.k), axis=(0, 2, 4))
    np.testing.assert_array_equal(np.argwhere(changed), [[0, 3], [1, 1], [2, 7]])
