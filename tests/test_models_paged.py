"""The paged KV cache: decode over pages equals decode over the contiguous cache.

Pages are scattered over the pool in a shuffled order (and the scratch page 0 is never
handed out), so a bug that reads a row's pages in the wrong order, or another row's page,
changes the logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.models import (
    ExecutionOptions,
    KVCache,
    ModelRun,
    PagedKVCache,
    WindowConfig,
    init_model,
    preset,
    write_prompts,
)

PROMPTS = [7, 3, 12]  # lengths: one spans several pages, one is shorter than a page
STEPS = 6


def _paged_tables(lengths, steps, page_size, pages, seed):
    """Block tables with enough shuffled pages per row; global ids (one shard)."""
    n = -(-(max(lengths) + steps) // page_size)
    free = list(np.random.default_rng(seed).permutation(np.arange(1, pages)))
    tables = np.zeros((len(lengths), n), np.int32)
    for b in range(len(lengths)):
        for j in range(n):
            tables[b, j] = free.pop()
    return tables


@pytest.mark.parametrize(
    "layer_loop,page_size,window",
    [("unrolled", 4, None), ("scan", 4, None), ("unrolled", 8, 3), ("unrolled", 5, None)],
)
def test_paged_decode_equals_contiguous(layer_loop, page_size, window) -> None:
    config = ModelRun(
        dataclasses.replace(preset("tiny-gqa"), n_layers=2, window=WindowConfig(size=window)),
        ExecutionOptions(layer_loop=layer_loop),
    )
    model = init_model(config, seed=1)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    t = max(PROMPTS)
    tokens_BT = np.zeros((len(PROMPTS), t), np.int32)
    for b, n in enumerate(PROMPTS):
        tokens_BT[b, :n] = rng.integers(0, config.vocab_size, n)
    lengths_B = jnp.asarray(PROMPTS, jnp.int32)
    _, k, v = nnx.merge(graphdef, state).prefill(jnp.asarray(tokens_BT), lengths_B)

    max_seq = t + STEPS + page_size
    dense = KVCache.from_prefill(k, v, lengths_B, max_seq)
    pages = 4 * len(PROMPTS) * (-(-max_seq // page_size)) + 1
    tables_BN = _paged_tables(PROMPTS, STEPS, page_size, pages, seed=2)
    prompt_pages = -(-t // page_size)
    write_ids = np.where(
        np.arange(prompt_pages)[None] < -(-np.asarray(PROMPTS)[:, None] // page_size),
        tables_BN[:, :prompt_pages],
        pages,  # past a row's prompt: dropped
    )
    pool = PagedKVCache.empty_pool(config, pages, page_size)
    paged = PagedKVCache(
        k=write_prompts(pool, k, jnp.asarray(write_ids)),
        v=write_prompts(pool, v, jnp.asarray(write_ids)),
        block_tables_BN=jnp.asarray(tables_BN),
        lengths_B=lengths_B,
    )

    @jax.jit
    def step(state, cache, tokens_B):
        return nnx.merge(graphdef, state).decode(tokens_B, cache)

    tokens_B = jnp.asarray(rng.integers(0, config.vocab_size, len(PROMPTS)), jnp.int32)
    for _ in range(STEPS):
        want, dense = step(state, dense, tokens_B)
        got, paged = step(state, paged, tokens_B)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
        tokens_B = jnp.argmax(want, axis=-1).astype(jnp.int32)
    np.testing.assert_array_equal(np.asarray(paged.lengths_B), np.asarray(dense.lengths_B))
