"""Pipeline parallelism inside one SPMD program: the pipelined engine equals the single-device
run, stores 1/pp of the layer stack and KV cache per device, updates the cache in place, and
crosses stages only with activation-sized collective-permutes."""

from __future__ import annotations

import functools
import math
import re

import jax
import numpy as np
import pytest

from jaxpar.engine import Sampling
from jaxpar.engine._pipeline import bubble_fraction, schedule
from jaxpar.errors import IllegalStrategyError
from jaxpar.inspect import collective_axes, parse_collectives
from jaxpar.models import KVCache
from jaxpar.spec import ParallelConfig
from tests._engine_util import MAX_BATCH, MAX_SEQ_LEN, NEW_TOKENS, PROMPTS, engine, reference
from tests._tiers import sweep

PC = ParallelConfig
# Every combination the issue names: pp 2 and 4 alone and with tp, dp, ep (MoE) and sp
# (prefill), dense and MoE, microbatches > 1, decode_groups 1 and pp. (pp2 with 2
# microbatches and 2 decode groups alone takes the path of pp4 with 4 and 4, and runs
# beside dp and tp below.)
CONFIGS = [
    ("tiny-dense", PC(pp=2)),
    ("tiny-dense", PC(pp=4)),
    ("tiny-dense", PC(pp=4, microbatches=4, decode_groups=4)),
    ("tiny-dense", PC(pp=2, tp=2, dp=2, microbatches=2, decode_groups=2)),
    ("tiny-dense", PC(pp=2, sp=2, dp=2, microbatches=2)),
    ("tiny-dense", PC(pp=4, tp=2, microbatches=2)),
    ("tiny-moe", PC(pp=2, ep=2, tp=2, decode_groups=2)),
    ("tiny-moe", PC(pp=4, ep=2, microbatches=2, decode_groups=4)),
    # The MoE shard_map (manual over dp) nested in the pp-manual one: jax >= 0.11.2 aborts
    # unless the mesh names pp before dp (jaxpar.spec.MESH_NAME_ORDER).
    ("tiny-moe", PC(pp=2, dp=2, tp=2, microbatches=2, decode_groups=2)),
]
# The compiled-program checks run on the mixed strategies.
COMPILED = CONFIGS[2:7]


def _id(case) -> str:
    return f"{case[0]}-{case[1]}" if isinstance(case, tuple) else str(case)


def _compat(case):
    """``case`` marked ``jax_compat`` (version-sensitive: scripts/test.sh runs it on both JAX
    releases)."""
    return pytest.param(case, marks=pytest.mark.jax_compat, id=_id(case))


@functools.cache
def _engine(name: str, parallel: ParallelConfig):
    return engine(name, parallel)


@functools.cache
def _decode_step(name: str, parallel: ParallelConfig):
    """The compiled public decode step of an engine, for abstract inputs (nothing runs)."""
    eng = _engine(name, parallel)
    lay = eng.layouts
    cache = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        KVCache.abstract(eng.run, MAX_BATCH, MAX_SEQ_LEN),
        lay.cache,
    )
    tokens = jax.ShapeDtypeStruct((MAX_BATCH,), np.int32, sharding=lay.tokens_B)
    return eng.steps.jit_decode().lower(eng.params, cache, tokens).compile()


# The fast tier's point: a pipeline beside dp and tp, with microbatches and decode groups,
# one engine for the whole file (the MoE pipelines are the full tier's).
FAST = "tiny-dense-dp=2,pp=2,tp=2,microbatches=2,decode_groups=2"


def _fast(case) -> bool:
    return _id(case) == FAST


@pytest.mark.parametrize(
    "case", sweep([*CONFIGS[:-1], _compat(CONFIGS[-1])], _fast, one_argument=True), ids=_id
)
def test_matches_single_device(case):
    name, parallel = case
    ref_logits, ref_tokens = reference(name)
    eng = _engine(name, parallel)
    tokens, lengths = eng.pad_prompts(PROMPTS)
    logits, cache, first = eng.prefill(tokens, lengths)
    assert logits.shape == ref_logits.shape and first.shape == (MAX_BATCH,)
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-4, rtol=0)
    assert cache.k.sharding.spec[0] == "pp"  # each stage keeps its layers' cache
    assert eng.generate(PROMPTS, NEW_TOKENS).tokens == ref_tokens


@pytest.mark.sweep  # a variant: the fast tier keeps the engine's own parameter layouts
def test_parameters_in_the_steps_layouts_match_single_device(monkeypatch):
    """The TPU path (:mod:`jaxpar.engine._param_formats`) run on CPU: the steps pick
    the parameter layouts, the engine places the parameters so, and every step compiled
    against them equals one device."""
    monkeypatch.setattr(
        "jaxpar.engine._abstract.stores_in_step_layouts", lambda platform, pp: pp > 1
    )
    ref_logits, ref_tokens = reference("tiny-dense")
    eng = engine("tiny-dense", PC(pp=2, tp=2, microbatches=2, decode_groups=2))
    assert eng.steps.param_formats is not None
    kernel = eng.params["layers"]["ffn"]["gate_up_kernel"].get_value()
    chosen = eng.steps.param_formats["layers"]["ffn"]["gate_up_kernel"].get_value()
    assert kernel.format == chosen
    tokens, lengths = eng.pad_prompts(PROMPTS)
    logits = np.asarray(eng.prefill(tokens, lengths)[0])
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=0)
    assert eng.generate(PROMPTS, NEW_TOKENS).tokens == ref_tokens


@pytest.mark.sweep  # the public steps, streaming and sampling: their own tests run unpipelined
def test_public_steps_and_streaming_match():
    """``prefill``/``decode`` hand back unpipelined shapes; streaming equals the fused loop;
    sampled tokens equal the single-device ones for the same seed (groups included)."""
    ref = _engine("tiny-dense", PC())
    eng = _engine(*CONFIGS[3])  # the fast tier's pipeline, built once for the file
    tokens, lengths = eng.pad_prompts(PROMPTS)
    outs = []
    for e in (ref, eng):
        _, cache, first = e.prefill(tokens, lengths)
        logits, cache = e.decode(cache, first)
        outs.append((np.asarray(logits), np.asarray(cache.lengths_B)))
    np.testing.assert_allclose(outs[1][0], outs[0][0], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(outs[1][1], outs[0][1])
    every = [np.asarray(e.prefill_logits(tokens, lengths)) for e in (ref, eng)]
    np.testing.assert_allclose(every[1], every[0], atol=1e-4, rtol=0)

    seen = []
    streamed = eng.generate(PROMPTS[:3], 6, callback=lambda step, toks: seen.append(toks))
    assert streamed.tokens == [t[:6] for t in reference("tiny-dense")[1][:3]]
    assert [int(t[0]) for t in seen] == streamed.tokens[0]

    sampling = Sampling(temperature=1.0, top_k=50)
    assert (
        eng.generate(PROMPTS, 8, sampling=sampling, seed=3).tokens
        == ref.generate(PROMPTS, 8, sampling=sampling, seed=3).tokens
    )


def _crossing(compiled, mesh) -> list:
    """Collectives whose devices differ in their ``pp`` coordinate (or cannot be mapped)."""
    out = []
    for c in parse_collectives(compiled):
        axes = collective_axes(c, mesh)
        if axes is None or "pp" in axes:
            out.append((c, axes))
    return out


@pytest.mark.parametrize(
    "case", sweep([*COMPILED[:-1], _compat(COMPILED[-1])], _fast, one_argument=True), ids=_id
)
def test_only_activation_permutes_cross_stages(case):
    name, parallel = case
    eng = _engine(name, parallel)
    cfg, mesh = eng.model_config, eng.mesh
    tokens, lengths = eng.pad_prompts(PROMPTS)
    t = tokens.shape[1]
    lay = eng.layouts
    args = [
        jax.ShapeDtypeStruct(tokens.shape, np.int32, sharding=lay.tokens_BT),
        jax.ShapeDtypeStruct(lengths.shape, np.int32, sharding=lay.lengths_prefill_B),
    ]
    prefill = eng.steps.lower_prefill(eng.params, *args).compile()
    itemsize = np.dtype(cfg.dtype).itemsize
    microbatch = MAX_BATCH // parallel.microbatches * t * cfg.d_model * itemsize
    group = MAX_BATCH // parallel.decode_groups * cfg.d_model * itemsize
    for compiled, bound in [(prefill, microbatch), (_decode_step(name, parallel), group)]:
        crossing = _crossing(compiled, mesh)
        assert crossing, "activations must move between stages"
        for c, axes in crossing:
            assert c.kind == "collective-permute" and axes == ("pp",), (c.kind, axes, c.op_name)
            assert c.shapes[0][-1] == cfg.d_model and c.bytes <= bound, (c.shapes, c.bytes)


def test_decode_loop_crosses_stages_with_permutes_and_its_exit_test():
    """The fused loop adds the token hand-over (a permute of B int32) and the early-exit
    test, one scalar all-reduce, as the unpipelined loop reduces over its batch axes."""
    name, parallel = COMPILED[1]
    eng = _engine(name, parallel)
    eng.generate(PROMPTS, NEW_TOKENS)  # compiled already if the equivalence test ran
    loop = next(v for k, v in eng.steps._compiled.items() if k[0] == "decode_loop")
    kinds = set()
    for c, axes in _crossing(loop, eng.mesh):
        if c.kind == "all-reduce":
            assert c.bytes <= 4 and c.shapes == ((),), c.shapes
        else:
            assert c.kind == "collective-permute" and axes == ("pp",), (c.kind, axes)
        kinds.add(c.kind)
    assert kinds == {"collective-permute", "all-reduce"}
    cfg = eng.model_config
    shape = (cfg.n_layers, MAX_BATCH, MAX_SEQ_LEN, cfg.n_kv_heads, cfg.head_dim)
    assert not _cache_copies(loop, eng.layouts.cache.k.shard_shape(shape))


def _cache_copies(compiled, shard: tuple[int, ...]) -> list[str]:
    """Copies of the carried cache: its shard's dims in order, size-1 dims aside (a view
    like ``[1, Lp, B, ...]`` counts), in any dtype (a quantized cache's int8/fp8 values,
    its f32 scales). Per-layer K/V slices transposed for the attention product are not
    such copies; the unpipelined step makes them too."""
    want = [d for d in shard if d != 1]
    found = []
    for line in compiled.as_text().splitlines():
        m = re.search(r"= \w+\[([\d,]*)\]\S* (copy\(|fusion\(.*wrapped_copy)", line)
        if m and [int(d) for d in m.group(1).split(",") if d not in ("", "1")] == want:
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize(
    "case", sweep([CONFIGS[1], *COMPILED[:2], COMPILED[4]], _fast, one_argument=True), ids=_id
)
def test_decode_updates_the_cache_in_place(case):
    name, parallel = case
    compiled = _decode_step(name, parallel)
    eng = _engine(name, parallel)
    cfg = eng.model_config
    shape = (cfg.n_layers, MAX_BATCH, MAX_SEQ_LEN, cfg.n_kv_heads, cfg.head_dim)
    shard = eng.layouts.cache.k.shard_shape(shape)
    assert compiled.memory_analysis().alias_size_in_bytes >= 2 * math.prod(shard) * 4
    assert not _cache_copies(compiled, shard)


def _arg_bytes(name: str, parallel: ParallelConfig) -> tuple[int, int]:
    """(argument bytes per device of the decode step, bytes of the layer stack + cache)."""
    eng = _engine(name, parallel)
    per_device = _decode_step(name, parallel).memory_analysis().argument_size_in_bytes
    stack = sum(
        v.addressable_shards[0].data.nbytes
        for p, v in jax.tree_util.tree_flatten_with_path(eng.params)[0]
        if "layers" in jax.tree_util.keystr(p)
    )
    cache = KVCache.abstract(eng.run, MAX_BATCH, MAX_SEQ_LEN)
    # The flat engine keeps one [B, K, S, H] array per layer, the pipelined one a stack.
    shardings, shapes = jax.tree.leaves(eng.layouts.cache.k), jax.tree.leaves(cache.k)
    kv = (
        2
        * sum(math.prod(s.shard_shape(x.shape)) for s, x in zip(shardings, shapes, strict=True))
        * 4
    )
    return per_device, stack + kv


@pytest.mark.parametrize(
    ("name", "parallel", "flat"),
    sweep(
        [
            ("tiny-dense", PC(pp=4), PC()),
            ("tiny-dense", PC(pp=2, tp=2, dp=2), PC(tp=2, dp=2)),
            ("tiny-moe", PC(pp=2, ep=2, tp=2), PC(ep=2, tp=2)),
        ],
        lambda case: case[1] == PC(pp=2, tp=2, dp=2),
    ),
    ids=lambda x: str(x) if isinstance(x, ParallelConfig) else x,
)
def test_each_stage_stores_its_share(name, parallel, flat):
    """Layer parameters and KV cache per device are 1/pp of the unpipelined figure; the
    embedding, LM head and final norm (replicated over pp) are the same."""
    measured, stack = _arg_bytes(name, parallel)
    flat_measured, flat_stack = _arg_bytes(name, flat)
    assert stack * parallel.pp == flat_stack  # exactly the share, by construction
    replicated = flat_measured - flat_stack  # embedding, head, norm, tokens, lengths
    assert measured == pytest.approx(replicated + flat_stack / parallel.pp, rel=0.02)


def test_schedule_and_bubble():
    grid = schedule(4, 6)
    assert len(grid) == 9 and grid[0] == [0, None, None, None] and grid[-1][-1] == 5
    idle = sum(x is None for row in grid for x in row) / (len(grid) * 4)
    assert idle == pytest.approx(bubble_fraction(4, 6)) == pytest.approx(3 / 9)


def test_overlapping_decode_groups_are_refused():
    with pytest.raises(IllegalStrategyError, match="pp-no-decode-overlap"):
        engine("tiny-dense", PC(pp=4, decode_groups=2))
