"""The engine's MoE: capacity drops counted per step on the Generation, path resolution."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.engine import InferenceEngine
from jaxpar.errors import ConfigError
from jaxpar.models import (
    ExecutionOptions,
    ModelRun,
    abstract_model,
    count_dropped,
    init_model,
    init_params,
    preset,
    total_dropped,
    with_layer_loop,
)
from jaxpar.spec import ParallelConfig, make_mesh
from tests._prompts import PROMPTS

L, B = 2, 8  # two layers: the counts scale with L, the compile time too


def _engine(factor: float | None, parallel: ParallelConfig, **kw) -> InferenceEngine:
    """tiny-moe with every router kernel zero: equal logits, so every token's top-2 are
    experts 0 and 1 (ties go to the lower index), both on expert peer 0."""
    model = dataclasses.replace(preset("tiny-moe"), n_layers=L)
    config = ModelRun(model, ExecutionOptions(moe_capacity_factor=factor, **kw))
    params = init_params(config, seed=0)
    flat = []
    for path, var in nnx.to_flat_state(params):
        if "router" in path:
            var = var.replace(np.zeros(var.get_value().shape, np.float32))
        flat.append((path, var))
    params = nnx.from_flat_state(flat)
    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    return InferenceEngine(config, params, parallel, max_batch=B, max_seq_len=64, mesh=mesh)


def _expected_drops(tokens_per_device: int, devices: int, ep: int) -> int:
    """All 2n assignments of a device go to one peer, which takes C = ceil(1.25 x 2n / ep)."""
    n = tokens_per_device
    cap = min(2 * n, math.ceil(1.25 * n * 2 / ep))
    return L * devices * (2 * n - cap)


def test_generation_reports_drops_per_step() -> None:
    eng = _engine(1.25, ParallelConfig(ep=4, tp=2))
    gen = eng.generate(PROMPTS[:B], 5)
    t_pad = eng.pad_prompts(PROMPTS[:B])[0].shape[1]
    # Token shards: ep=4 (tp holds copies of the same tokens, counted once).
    prefill = _expected_drops((B // 4) * t_pad, 4, 4)
    decode = _expected_drops(B // 4, 4, 4)
    assert gen.moe_dropped == (prefill, *[decode] * 4)
    assert gen.moe_dropped_total == prefill + 4 * decode > 0
    # The streaming loop (one program per step) counts the same.
    streamed = eng.generate(PROMPTS[:B], 5, callback=lambda step, tokens: None)
    assert streamed.moe_dropped == gen.moe_dropped
    assert streamed.tokens == gen.tokens


def test_paths_resolved_at_build() -> None:
    """(Dropless engines report ``moe_dropped=None``: tests/test_engine_hf.py.)"""
    eng = _engine(None, ParallelConfig(ep=2))
    assert eng.options.moe_dispatch == "padded"  # XLA:CPU: no ragged all-to-all
    assert not eng.steps.counts_drops
    with pytest.raises(ConfigError, match="ragged-all-to-all"):
        _engine(None, ParallelConfig(ep=2), moe_dispatch="ragged")
    with pytest.raises(ConfigError, match="drop counts"):
        _engine(1.25, ParallelConfig(pp=2, ep=2))


def test_scanned_layers_count_the_same_drops() -> None:
    """``layer_loop="scan"``: each layer's drops leave the scan as outputs, same total."""
    model = dataclasses.replace(preset("tiny-moe"), n_layers=L)
    config = ModelRun(model, ExecutionOptions(moe_capacity_factor=0.5))
    unrolled = init_model(config, seed=1)
    scan_config = config.with_options(layer_loop="scan")
    scan_params = with_layer_loop(config, nnx.state(unrolled), "scan")
    scanned = nnx.merge(nnx.split(abstract_model(scan_config))[0], scan_params)
    tokens = jnp.asarray(np.arange(2 * 8).reshape(2, 8) % config.vocab_size, jnp.int32)
    lengths = jnp.array([8, 5], jnp.int32)

    def dropped(model):
        def f(m):
            with count_dropped() as drops:
                logits = m.prefill(tokens, lengths)[0]
            return logits, total_dropped(drops)

        return jax.jit(f)(model)

    (logits_u, drops_u), (logits_s, drops_s) = dropped(unrolled), dropped(scanned)
    # One group of 16 tokens per layer, C = ceil(0.5 x 16 x 2) = 16 of 32 kept.
    assert int(drops_u) == int(drops_s) == L * (32 - 16)
    np.testing.assert_allclose(np.asarray(logits_u), np.asarray(logits_s), atol=1e-5)
