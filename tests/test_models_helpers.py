"""Shared helpers of the model tests: one compiled prefill/decode per config."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.models import KVCache, ModelConfig, init_model
from jaxpar.models import decode as decode_fn
from jaxpar.models import prefill as prefill_fn

TOL = 1e-5
# One shape everywhere (batch, padded prompt width, cache size): one compile per config.
B, WIDTH, MAX_SEQ = 3, 16, 24


@functools.cache
def compiled(config: ModelConfig):
    """Model state plus jitted prefill (all positions) and decode, built once per config."""
    graphdef, state = nnx.split(init_model(config, seed=1))
    prefill = jax.jit(functools.partial(prefill_fn, graphdef, all_logits=True))
    decode = jax.jit(functools.partial(decode_fn, graphdef))
    return state, prefill, decode


def prefill_rows(
    config: ModelConfig, rows: list[np.ndarray]
) -> tuple[np.ndarray, jax.Array, jax.Array, np.ndarray]:
    """Right-pads rows to WIDTH; returns (all logits [B, WIDTH, V], k, v, lengths)."""
    state, prefill, _ = compiled(config)
    lengths = np.array([len(r) for r in rows], np.int32)
    tokens = np.zeros((len(rows), WIDTH), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    logits, k, v = prefill(state, jnp.asarray(tokens), jnp.asarray(lengths))
    return np.asarray(logits), k, v, lengths


def prefill_then_decode(
    config: ModelConfig, prompts: list[np.ndarray], continuations: np.ndarray
) -> np.ndarray:
    """Logits of prefill (last real position) then of each decode step: [B, steps + 1, V]."""
    state, _, decode = compiled(config)
    logits, k, v, lengths = prefill_rows(config, prompts)
    cache = KVCache.from_prefill(k, v, jnp.asarray(lengths), MAX_SEQ)
    out = [logits[np.arange(len(prompts)), lengths - 1]]
    for step in range(continuations.shape[1]):
        cache.check_room(1)
        step_logits, cache = decode(state, jnp.asarray(continuations[:, step]), cache)
        out.append(np.asarray(step_logits))
    np.testing.assert_array_equal(cache.lengths_B, lengths + continuations.shape[1])
    return np.stack(out, axis=1)


def full_prefill_logits(
    config: ModelConfig, prompts: list[np.ndarray], continuations: np.ndarray
) -> np.ndarray:
    """Prefill of prompt + continuation, logits at the positions compared above."""
    rows = [np.concatenate([p, c]) for p, c in zip(prompts, continuations, strict=True)]
    logits, _, _, _ = prefill_rows(config, rows)
    idx = np.array([[len(p) - 1 + s for s in range(continuations.shape[1] + 1)] for p in prompts])
    return logits[np.arange(len(prompts))[:, None], idx]


def random_tokens(
    config: ModelConfig, lengths: list[int], n_new: int, seed: int = 0
) -> tuple[list[np.ndarray], np.ndarray]:
    """Random prompts of the given lengths, and [B, n_new] continuation tokens."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, config.vocab_size, size=n).astype(np.int32) for n in lengths]
    return prompts, rng.integers(0, config.vocab_size, size=(len(lengths), n_new)).astype(np.int32)
