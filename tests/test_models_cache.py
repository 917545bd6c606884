"""Sliding window, cache shapes, scanned-layer program size, module names in HLO."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.models import ExecutionOptions, KVCache, ModelRun, WindowConfig, init_model, preset
from jaxpar.models import prefill as prefill_fn
from tests.test_models_helpers import (
    MAX_SEQ,
    TOL,
    B,
    compiled,
    full_prefill_logits,
    prefill_rows,
    prefill_then_decode,
    random_tokens,
)

# Two layers, window 2: each layer reaches one token further back, so token 0 can affect
# positions 0..2 only.
WINDOWED = dataclasses.replace(preset("tiny-gqa"), n_layers=2, window=WindowConfig(size=2))


def test_sliding_window_decode_matches_prefill() -> None:
    prompts, cont = random_tokens(WINDOWED, [6, 2, 4], n_new=6, seed=3)
    got = prefill_then_decode(WINDOWED, prompts, cont)
    np.testing.assert_allclose(got, full_prefill_logits(WINDOWED, prompts, cont), atol=TOL)


def test_sliding_window_hides_old_tokens() -> None:
    state, _, decode = compiled(WINDOWED)
    base = np.random.default_rng(5).integers(0, 256, size=8).astype(np.int32)
    changed = base.copy()
    changed[0] = (base[0] + 1) % 256
    a, *_ = prefill_rows(WINDOWED, [base, base, base])
    b, *_ = prefill_rows(WINDOWED, [changed, changed, changed])
    assert np.abs(a[0, :3] - b[0, :3]).max() > 1e-3
    np.testing.assert_allclose(a[:, 3:8], b[:, 3:8], atol=TOL, rtol=0)
    for tokens in (base, changed):  # decode position 4 from a 4-token cache
        _, k, v, lengths = prefill_rows(WINDOWED, [tokens[:4]] * B)
        cache = KVCache.from_prefill(k, v, jnp.asarray(lengths), MAX_SEQ)
        got = decode(state, jnp.full((B,), tokens[4]), cache)[0]
        np.testing.assert_allclose(np.asarray(got), a[:, 4], atol=TOL, rtol=0)


def test_cache_logical_axes_and_abstract() -> None:
    config = preset("tiny-gqa")
    axes = KVCache.logical_axes(config)
    assert axes.k == (("batch", "kv_heads", "cache_seq", "head_dim"),) * config.n_layers
    assert axes.lengths_B == ("batch",)
    abstract = KVCache.abstract(config, batch=3, max_seq_len=10)
    assert [x.shape for x in abstract.k] == [(3, 2, 10, 8)] * 4  # per layer [B, K, S, H]
    assert abstract.lengths_B.dtype == jnp.int32
    scanned = ModelRun(config, ExecutionOptions(layer_loop="scan"))
    assert KVCache.logical_axes(scanned).k == (
        "layers",
        "batch",
        "cache_seq",
        "kv_heads",
        "head_dim",
    )
    assert KVCache.abstract(scanned, batch=3, max_seq_len=10).k.shape == (4, 3, 10, 2, 8)


def _program_size(n_layers: int, layer_loop: str) -> int:
    config = dataclasses.replace(preset("tiny-dense"), n_layers=n_layers)
    graphdef, state = nnx.split(init_model(config, options=ExecutionOptions(layer_loop=layer_loop)))
    lowered = jax.jit(functools.partial(prefill_fn, graphdef)).lower(
        state, jnp.ones((2, 8), jnp.int32), jnp.full((2,), 8, jnp.int32)
    )
    return len(lowered.as_text())


def test_program_size_with_depth_scan_flat_unrolled_linear() -> None:
    """``layer_loop="scan"`` lowers one layer body whatever the depth (compile time flat);
    ``"unrolled"`` lowers every layer (no weight slices, compile time grows with depth)."""
    scan2, scan16 = _program_size(2, "scan"), _program_size(16, "scan")
    assert abs(scan16 - scan2) < 0.02 * scan2, (scan2, scan16)
    flat2, flat16 = _program_size(2, "unrolled"), _program_size(16, "unrolled")
    per_layer = (flat16 - flat2) / 14
    assert per_layer > 0.2 * flat2, (flat2, flat16)


def test_modules_are_named_in_hlo_metadata() -> None:
    """Op locations carry the module scope, also inside the scanned layer body."""
    config = preset("tiny-moe")
    graphdef, state = nnx.split(init_model(config))
    text = (
        jax.jit(functools.partial(prefill_fn, graphdef))
        .lower(state, jnp.ones((1, 4), jnp.int32), jnp.array([4], jnp.int32))
        .as_text(debug_info=True)
    )
    for scope in ("embedding", "attention", "moe", "lm_head"):
        assert re.search(f'loc\\("[^"]*\\b{scope}/', text), scope
