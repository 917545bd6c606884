"""The quantized KV cache (``kv_cache_dtype`` int8 / fp8) under pipeline parallelism.

Each stage's cache holds int8/fp8 values and their float32 scales (one per token per kv
head), split over ``pp`` by layers exactly as the float stage caches are; the handoff
quantizes the prompt's K/V once, each decode step writes its token quantized through the
pipeline's group view (group and bubble masking applying to the scales too), and
attention reads the scales. Quantization is deterministic, so a pipelined engine must
equal the same quantized cache on one device: f32 logits within 1e-4, greedy tokens
identical (the float cache differs from both by the quantization error: see
tests/test_kv_quant.py). The prompts differ in length, so a write at a wrong row or
position (of a value or of a scale) changes what later steps attend to.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar import ParallelConfig
from jaxpar.engine import AbstractEngine
from jaxpar.inspect._report import compile_step
from jaxpar.models import ExecutionOptions, KVCache, ModelRun, QuantKV, preset
from jaxpar.spec import make_mesh
from tests.test_pipeline import _cache_copies

PC = ParallelConfig
CONFIG = preset("tiny-gqa")  # f32; 4 layers, 8 query heads over 2 kv heads, head_dim 8
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 64], [9, 4, 31], [200, 11, 6, 73, 150, 2], [8] * 8]
MAX_BATCH, MAX_SEQ_LEN, STEPS = 4, 32, 6
STORED = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
# pp alone, and pp with tp (one kv head per device), GPipe microbatches and decode groups
# (rows 0, 2 and 1, 3 pass the stages one group after the other).
GROUPED = PC(pp=2, tp=2, microbatches=2, decode_groups=2)
CASES = [("int8", PC(pp=2)), ("fp8", PC(pp=2)), ("int8", GROUPED), ("fp8", GROUPED)]


@functools.cache
def _params():
    """One set of weights for every engine here (each run is compared with one device)."""
    return jaxpar.init_params(CONFIG)


@functools.cache
def _engine(mode: str, parallel: ParallelConfig) -> jaxpar.InferenceEngine:
    return jaxpar.InferenceEngine(
        CONFIG,
        _params(),
        parallel,
        max_batch=MAX_BATCH,
        max_seq_len=MAX_SEQ_LEN,
        mesh=make_mesh(parallel, jax.devices()[: parallel.size]),
        kv_cache_dtype=mode,
    )


@functools.cache
def _greedy(mode: str, parallel: ParallelConfig):
    """Prefill logits ``[B, V]``, then ``STEPS`` greedy decode steps' logits
    ``[STEPS, B, V]`` and the tokens ``[B, 1 + STEPS]`` (the first from prefill), and the
    cache after them."""
    eng = _engine(mode, parallel)
    tokens, lengths = eng.pad_prompts(PROMPTS)
    logits, cache, _ = eng.prefill(tokens, lengths)
    prefill = np.asarray(logits, np.float32)
    fed = [np.argmax(prefill, -1).astype(np.int32)]
    steps = []
    for _ in range(STEPS):
        logits, cache = eng.decode(cache, fed[-1])
        steps.append(np.asarray(logits, np.float32))
        fed.append(np.argmax(steps[-1], -1).astype(np.int32))
    return prefill, np.stack(steps), np.stack(fed, axis=1), cache


@pytest.mark.parametrize(("mode", "parallel"), CASES, ids=str)
def test_pipelined_quantized_cache_equals_single_device(mode, parallel):
    prefill, steps, tokens, cache = _greedy(mode, parallel)
    ref_prefill, ref_steps, ref_tokens, _ = _greedy(mode, PC())
    assert np.max(np.abs(prefill - ref_prefill)) <= 1e-4
    assert np.max(np.abs(steps - ref_steps)) <= 1e-4
    np.testing.assert_array_equal(tokens, ref_tokens)
    # Stacked [L, B, S, K, H] values and [L, B, S, K, 1] scales, both split by layers.
    for x in (cache.k, cache.v):
        assert isinstance(x, QuantKV) and x.dtype == jnp.dtype(STORED[mode])
        assert x.scale.shape == (*x.values.shape[:-1], 1) and x.scale.dtype == jnp.float32
        values_spec, scale_spec = _spec(x.values), _spec(x.scale)
        assert values_spec[0] == "pp" and scale_spec[:-1] == values_spec[:-1]


def _spec(x: jax.Array) -> tuple:
    """``x``'s PartitionSpec, one entry per dim."""
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def test_pipelined_generate_runs_the_quantized_cache_in_its_decode_loop():
    """``generate`` on a pipelined engine runs every step in one compiled ``while_loop``
    carrying the quantized cache: the tokens of the step-by-step single-device run."""
    _, _, ref_tokens, _ = _greedy("int8", PC())
    out = _engine("int8", GROUPED).generate(PROMPTS, 1 + STEPS, stop_tokens=())
    assert out.tokens == ref_tokens.tolist()


@functools.cache
def _decode_program(mode: str | None, parallel: ParallelConfig):
    """The pipelined decode step compiled over abstract inputs, and its engine."""
    run = ModelRun(CONFIG, ExecutionOptions(kv_cache_dtype=mode))
    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    eng = AbstractEngine.build(
        run, parallel, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN, mesh=mesh
    )
    return compile_step(eng, "decode", prompt_len=8), eng


def test_int8_stage_caches_take_their_share_of_the_float_bytes():
    """Decode argument bytes per device, pp=2: the int8 cache (H values + a 4-byte scale
    per token per kv head) replaces the f32 one (4 H bytes), over each stage's L / pp
    layers; nothing else changes. Here H = 8: 12 / 32 of the cache's bytes (a bf16 model
    with H >= 64: about half)."""
    parallel = PC(pp=2)
    full = _decode_program(None, parallel)[0].memory_analysis().argument_size_in_bytes
    int8 = _decode_program("int8", parallel)[0].memory_analysis().argument_size_in_bytes
    c = CONFIG
    lp = c.n_layers // parallel.pp
    per_token_and_head = 4 * c.head_dim - (c.head_dim + 4)
    saved = 2 * lp * MAX_BATCH * MAX_SEQ_LEN * c.n_kv_heads * per_token_and_head  # K and V
    assert full - int8 == saved
    assert int8 < full


@pytest.mark.parametrize(("mode", "parallel"), [("int8", PC(pp=2)), ("fp8", GROUPED)], ids=str)
def test_quantized_stage_caches_are_updated_in_place(mode, parallel):
    """The donated cache (values and scales) is the output's buffer, and no program copies
    a stage's block of either whole (with the scales' size-1 last dim and, under tp=2, one
    kv head per device: the shapes XLA:CPU copied when stages took a ``[P, Lp, ...]`` view).
    """
    compiled, eng = _decode_program(mode, parallel)
    shapes = KVCache.abstract(eng.run, MAX_BATCH, MAX_SEQ_LEN)
    shards = [
        s.shard_shape(x.shape)
        for x, s in zip(
            jax.tree.leaves((shapes.k, shapes.v)),
            jax.tree.leaves((eng.layouts.cache.k, eng.layouts.cache.v)),
            strict=True,
        )
    ]
    dtypes = [x.dtype for x in jax.tree.leaves((shapes.k, shapes.v))]
    quantized = sum(math.prod(s) * d.itemsize for s, d in zip(shards, dtypes, strict=True))
    assert compiled.memory_analysis().alias_size_in_bytes >= quantized
    for shard in {tuple(s) for s in shards}:
        assert not _cache_copies(compiled, shard), shard
