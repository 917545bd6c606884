"""What the compiled programs do: weights stay put in decode, the cache is updated in
place, per-device memory is the ideal share, and the handoff is exact."""

from __future__ import annotations

import functools
import math
import re

import jax
import numpy as np
import pytest

from jaxpar.engine import AbstractEngine
from jaxpar.inspect import parse_collectives
from jaxpar.models import KVCache, params_layer_loop
from jaxpar.spec import ParallelConfig, make_mesh
from tests._engine_util import MAX_BATCH, MAX_SEQ_LEN, PROMPTS, engine, model

DECODE_CASES = [
    ("tiny-dense", ParallelConfig(tp=8)),
    ("tiny-dense", ParallelConfig(dp=2, sp=2, tp=2)),
    ("tiny-dense", ParallelConfig(dp=4, tp=2)),
    ("tiny-moe", ParallelConfig(ep=8)),
    ("tiny-moe", ParallelConfig(dp=2, ep=2, tp=2)),
    ("tiny-moe", ParallelConfig(sp=2, ep=4)),
]


@functools.cache
def _decode_compiled(name: str, parallel: ParallelConfig):
    """The compiled decode step for abstract inputs in its own shardings (nothing is placed
    or run: the same program a real engine compiles), and its cache, per layer ``[B, K, S,
    H]``, as ``ShapeDtypeStruct`` in the decode layout."""
    config, _ = model(name)
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    eng = AbstractEngine.build(
        config, parallel, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN, mesh=mesh
    )
    compiled = eng.lower("decode", prompt_len=1).compile()  # decode: no prompt
    cache = KVCache.abstract(eng.run, MAX_BATCH, MAX_SEQ_LEN)
    cache = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache, eng.layouts.cache
    )
    return compiled, cache


def _shard_shape(x: jax.ShapeDtypeStruct) -> tuple[int, ...]:
    return x.sharding.shard_shape(x.shape)


def _param_shards(path: str, p: ParallelConfig, kv_heads: int) -> int:
    """By hand from the tables: how many ways each parameter is split."""
    if "norm" in path or "router" in path or "position_table" in path:
        return 1  # 1-D norms, the router and positional rows stay replicated
    if path.endswith(("['o_bias']", "['down_bias']")):
        return 1  # biases added after the row-parallel reduction
    if "experts" in path:
        return p.ep * p.tp  # experts over ep, each expert's intermediate over tp
    if "['kv_kernel']" in path or "['kv_bias']" in path:
        # K/V heads split over tp; with fewer heads than tp, one head per device (each
        # head on its tp/K devices only: rule kv-head-replicas), so K ways.
        return min(p.tp, kv_heads)
    return p.tp  # heads, FFN intermediate, vocab


@pytest.mark.parametrize(("name", "parallel"), DECODE_CASES, ids=lambda x: str(x))
def test_decode_moves_no_weights_and_updates_cache_in_place(name, parallel):
    config, params = model(name)
    compiled, cache = _decode_compiled(name, parallel)

    # No collective of parameter size: every one is below half of the smallest per-layer
    # projection (the router, E x D, is activation-sized and left out). Parameters are
    # per layer (layer_loop="unrolled"): a projection is any matrix under "layers".
    assert params_layer_loop(params) == "unrolled"
    smallest_weight = min(
        v.nbytes
        for p, v in jax.tree_util.tree_flatten_with_path(params)[0]
        if v.ndim >= 2 and "layers" in (key := jax.tree_util.keystr(p)) and "router" not in key
    )
    collectives = parse_collectives(compiled)
    assert collectives, "a sharded decode step must communicate"
    for c in collectives:
        assert c.bytes < smallest_weight / 2, (c.kind, c.shapes, c.op_name)

    # In place: the donated cache aliases the output, and no copy of it is made.
    layers = jax.tree.leaves((cache.k, cache.v))  # per layer [B, K, S, H]
    per_device_cache = sum(math.prod(_shard_shape(x)) * x.dtype.itemsize for x in layers)
    stats = compiled.memory_analysis()
    assert stats.alias_size_in_bytes >= per_device_cache
    local_shape = ",".join(map(str, _shard_shape(layers[0])))
    copies = [
        line
        for line in compiled.as_text().splitlines()
        if re.search(rf"= f32\[{local_shape}\]\S* copy\(", line)
    ]
    assert not copies, copies


@pytest.mark.parametrize(("name", "parallel"), DECODE_CASES, ids=lambda x: str(x))
def test_per_device_memory_is_the_ideal_share(name, parallel):
    config, params = model(name)
    compiled, cache = _decode_compiled(name, parallel)
    ideal = sum(
        v.nbytes / _param_shards(jax.tree_util.keystr(p), parallel, config.n_kv_heads)
        for p, v in jax.tree_util.tree_flatten_with_path(params)[0]
    )
    cache_total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((cache.k, cache.v)))
    batch_split = parallel.dp * parallel.sp * parallel.ep
    ideal += (
        cache_total / (batch_split * parallel.tp) + 2 * 4 * 8 / batch_split
    )  # + lengths, tokens
    measured = compiled.memory_analysis().argument_size_in_bytes
    assert measured == pytest.approx(ideal, rel=0.02)


@pytest.mark.parametrize("parallel", [ParallelConfig(dp=2, sp=4), ParallelConfig(sp=8)], ids=str)
def test_handoff_cache(parallel):
    """The handoff reshards prefill K/V (sequence split over sp) into the decode layout
    (sequence contiguous, batch over dp and sp) bit for bit; that cache equals the
    single-device one up to f32 rounding of the differently blocked matmuls."""
    from jaxpar.engine._placement import put_global
    from jaxpar.engine._sampling import Sampling

    ref = engine("tiny-dense", ParallelConfig())
    eng = engine("tiny-dense", parallel)
    tokens, lengths = ref.pad_prompts(PROMPTS)
    _, ref_cache, _ = ref.prefill(tokens, lengths)

    lay = eng.layouts
    tok = put_global(tokens, lay.tokens_BT)
    n = put_global(lengths, lay.lengths_prefill_B)
    logits, k, v = eng.steps.prefill(eng.params, tok, n)
    assert k[0].sharding.spec[1] == "sp"  # prefill layout [B, T, K, H]: tokens over sp
    prefill_k, prefill_v = np.stack(k), np.stack(v)  # [L, B, T, K, H]
    key = jax.random.key(0)
    cache, _ = eng.steps.handoff(k, v, n, logits, key, Sampling())
    spec = cache.k[0].sharding.spec  # decode layout [B, K, S, H]
    assert len(spec) < 3 or spec[2] is None  # contiguous sequence ...
    assert "sp" in spec[0]  # ... and sp carries batch
    t = tokens.shape[1]
    for got, want in [(cache.k, prefill_k), (cache.v, prefill_v)]:
        got_LBSKH = np.stack(got).transpose(0, 1, 3, 2, 4)
        np.testing.assert_array_equal(got_LBSKH[:, :, :t], want)
        assert not got_LBSKH[:, :, t:].any()
    for a, b in [(cache.k, ref_cache.k), (cache.v, ref_cache.v)]:
        np.testing.assert_allclose(np.stack(a), np.stack(b), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.lengths_B), np.asarray(ref_cache.lengths_B))
