"""The quantized KV cache (``kv_cache_dtype`` int8 / fp8, one float32 scale per token per
kv head): quantization error bounds, the bytes it counts, refusals, accuracy against the
float cache on the Hugging Face fixtures, sharded = single-device, and no copy of the
cache (or of a weight) per decode step.

Accuracy bounds (teacher-forced: both caches decode the float model's 64 greedy tokens
after the prompt, so every step compares the same inputs). Per vector, int8 stores
``round(x / s)`` with ``s = absmax / 127``: each element errs by at most ``absmax / 254``
(0.4% of the vector's largest); fp8 e4m3 keeps 3 mantissa bits: at most ``2**-4`` of the
element itself (6%). Those errors pass through softmax-weighted sums and the remaining
layers into the logits. Measured on the ``llama`` / ``qwen3`` fixtures (2 layers, head_dim
8 and 16, random weights): max logit error over the 64 steps, relative to the largest
float logit, int8 0.018 / 0.020, fp8 0.12 / 0.053; greedy agreement int8 63 / 64 of 64,
fp8 58 / 61. Bounds: int8 0.05, fp8 0.25 (about twice the largest measured, well under
the O(1) error of a broken scale: a scale off by 2x errs by ~50%); every greedy
disagreement must sit at a step where the float model's top-two margin is below twice
that step's logit error (only there can an error that size flip the choice), and at
least 60 (int8) / 52 (fp8) of 64 agree.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar import ParallelConfig
from jaxpar.engine import AbstractEngine, PagePool, SlotSteps
from jaxpar.engine._kv_budget import describe, page_bytes_per_device
from jaxpar.errors import ConfigError
from jaxpar.inspect._report import compile_step
from jaxpar.models import (
    ExecutionOptions,
    ModelRun,
    PagedKVCache,
    QuantKV,
    dequantize_kv,
    preset,
    quantize_kv,
    read_pages,
    write_prompts,
)
from jaxpar.spec import make_mesh
from tests._movement import moved_fraction, paged_moved_fraction
from tests._tiers import sweep

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64]
STEPS = 64
MODES = ("int8", "fp8")
REL_LOGIT_BOUND = {"int8": 0.05, "fp8": 0.25}
MIN_AGREE = {"int8": 60, "fp8": 52}
CONFIG = preset("tiny-gqa")  # 4 layers, 8 query heads over 2 kv heads, head_dim 8


def _quantized(config, mode: str, **options) -> ModelRun:
    """``config`` run with a ``mode`` KV cache (an execution option)."""
    return ModelRun(config, ExecutionOptions(kv_cache_dtype=mode, **options))


# --- quantization itself ---------------------------------------------------------------------


@pytest.mark.jax_compat
@pytest.mark.parametrize("mode", MODES)
def test_quantize_per_vector_error_bounds(mode):
    rng = np.random.default_rng(0)
    # Vectors of very different magnitudes: one scale each, so each keeps its precision.
    x = rng.normal(size=(3, 5, 4, 16)) * 10.0 ** rng.integers(-3, 3, size=(3, 5, 4, 1))
    x = jnp.asarray(x, jnp.float32)
    q = quantize_kv(x, mode)
    assert q.values.dtype == jnp.dtype({"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[mode])
    assert q.scale.shape == (3, 5, 4, 1) and q.scale.dtype == jnp.float32
    err = np.abs(np.asarray(dequantize_kv(q, jnp.float32)) - np.asarray(x))
    amax = np.max(np.abs(np.asarray(x)), axis=-1, keepdims=True)
    if mode == "int8":
        bound = amax / 254 * (1 + 1e-5)
    else:  # half an ulp of 3 mantissa bits; subnormals (below 2**-6 * s) step by 2**-9 * s
        bound = 2.0**-4 * np.abs(np.asarray(x)) + 2.0**-10 * amax / 448 + 1e-12
    assert np.all(err <= bound), float(np.max(err / bound))
    # The largest element of each vector is stored exactly at the format's largest value.
    assert np.allclose(
        np.max(np.abs(np.asarray(q.values, np.float32)), -1), {"int8": 127, "fp8": 448}[mode]
    )
    zero = quantize_kv(jnp.zeros((2, 8)), mode)
    assert np.all(np.asarray(zero.scale) == 1) and not np.any(
        np.asarray(dequantize_kv(zero, jnp.float32))
    )


@pytest.mark.jax_compat
def test_pages_written_quantized_read_back_dequantized():
    """What a prefix hit or a chunk reads: prefilled K written into a quantized pool
    (values and scales by the same scatter), gathered back per row as prefill lays it out."""
    config = _quantized(CONFIG, "int8")
    pool = PagedKVCache.empty_pool(config, pages=9, page_size=4)
    rng = np.random.default_rng(1)
    new = tuple(
        jnp.asarray(rng.normal(size=(2, 7, config.n_kv_heads, config.head_dim)), jnp.float32)
        for _ in range(config.n_layers)
    )
    pages_PN = jnp.asarray([[3, 1], [8, 5]], jnp.int32)
    pool = write_prompts(pool, new, pages_PN)
    assert all(isinstance(layer, QuantKV) and layer.dtype == jnp.int8 for layer in pool)
    back = read_pages(pool, pages_PN, jnp.float32)
    for x, y in zip(new, back, strict=True):
        expect = dequantize_kv(quantize_kv(x, "int8"), jnp.float32)
        np.testing.assert_array_equal(np.asarray(y[:, :7]), np.asarray(expect))
        assert not np.any(np.asarray(y[:, 7:]))  # past the prompt: pages never written
    with pytest.raises(ValueError, match="dtype"):
        read_pages(pool, pages_PN)


# --- bytes and refusals ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_pool_bytes_count_values_and_scales(mode):
    config = _quantized(CONFIG, mode)
    pool = jax.eval_shape(lambda: PagedKVCache.empty_pool(config, 10, 4))
    stored = 2 * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool))
    assert PagedKVCache.pool_bytes(config, 10, 4) == stored
    # Per page and device: (head_dim bytes + a 4-byte scale) against 4 * head_dim in f32.
    mesh = make_mesh(ParallelConfig(tp=2), jax.devices()[:2])
    quant = page_bytes_per_device(ParallelConfig(tp=2), mesh, config, 16)
    full = page_bytes_per_device(ParallelConfig(tp=2), mesh, CONFIG, 16)
    h = CONFIG.head_dim
    assert quant * 4 * h == full * (h + 4)
    line = describe(PagePool(16, 5, 1, 2, 64), quant, f"{mode} + f32 scales")
    assert f"({mode} + f32 scales)" in line


def test_refusals_name_the_option_and_what_is_legal():
    with pytest.raises(ConfigError, match="kv_cache_dtype='int4'; legal: None, int8, fp8"):
        ExecutionOptions(kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="decode_attention='cudnn' reads no KV cache scales"):
        ExecutionOptions(kv_cache_dtype="int8", decode_attention="cudnn")
    # Pipelined engines (pp > 1) run it: tests/test_kv_quant_pipeline.py.


@functools.cache
def _float_params():
    return jaxpar.init_params(CONFIG)


# --- accuracy on the fixtures, and sharded = single device -----------------------------------


@functools.cache
def _decode(fixture: str, mode: str | None, parallel: ParallelConfig, teacher=None):
    """Logits ``[STEPS, V]`` of decode steps over the contiguous cache, fed the float
    model's greedy tokens (``teacher``; None: its own, returned as the teacher)."""
    engine = jaxpar.engine_from_hf(
        FIXTURES / fixture,
        parallel,
        max_batch=parallel.dp,
        max_seq_len=len(PROMPT) + STEPS + 1,
        mesh=make_mesh(parallel, jax.devices()[: parallel.size]),
        kv_cache_dtype=mode,
    )
    rows = parallel.dp
    tokens = np.asarray([PROMPT] * rows, np.int32)
    logits, cache, _ = engine.prefill(tokens, np.full(rows, len(PROMPT), np.int32))
    feed = [int(np.argmax(np.asarray(logits)[0]))]
    out = []
    for i in range(STEPS):
        token = feed[i] if teacher is None else teacher[i]
        logits, cache = engine.decode(cache, np.full(rows, token, np.int32))
        out.append(np.asarray(logits, np.float32)[0])
        feed.append(int(np.argmax(out[-1])))
    if mode is not None:
        assert isinstance(cache.k[0], QuantKV) and cache.k[0].dtype == jnp.dtype(
            jnp.int8 if mode == "int8" else jnp.float8_e4m3fn
        )
    return np.stack(out), tuple(feed)


@pytest.mark.parametrize(
    ("mode", "fixture"),
    sweep(
        [(mode, fixture) for fixture in ("llama", "qwen3") for mode in MODES],
        lambda point: point == ("int8", "llama"),
    ),
)
def test_quantized_cache_tracks_the_float_cache(fixture, mode):
    one = ParallelConfig()
    ref, teacher = _decode(fixture, None, one)
    got, _ = _decode(fixture, mode, one, teacher)
    err_S = np.max(np.abs(got - ref), axis=-1)
    rel = float(err_S.max() / np.abs(ref).max())
    assert 0 < rel <= REL_LOGIT_BOUND[mode], rel
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margin_S = top2[:, 1] - top2[:, 0]
    disagree = np.argmax(got, -1) != np.argmax(ref, -1)
    assert np.all(margin_S[disagree] < 2 * err_S[disagree]), (margin_S, err_S, disagree)
    assert STEPS - disagree.sum() >= MIN_AGREE[mode], int(disagree.sum())


@pytest.mark.sweep  # the fast tier's sharded quantized cache: the tp=2 movement check below
@pytest.mark.parametrize("parallel", [ParallelConfig(dp=2, tp=2)], ids=str)
def test_sharded_quantized_decode_equals_single_device(parallel):
    _, teacher = _decode("llama", None, ParallelConfig())
    single, _ = _decode("llama", "int8", ParallelConfig(), teacher)
    sharded, _ = _decode("llama", "int8", parallel, teacher)
    assert np.max(np.abs(sharded - single)) <= 1e-4
    np.testing.assert_array_equal(np.argmax(sharded, -1), np.argmax(single, -1))


@functools.cache
def _served(mode: str, parallel: ParallelConfig, layer_loop: str = "unrolled"):
    prompts = [PROMPT, PROMPT[:3], PROMPT[2:7]]
    return _serving_engine(mode, parallel, layer_loop).generate(prompts, 24, logprobs=0)


@functools.cache
def _serving_engine(
    mode: str, parallel: ParallelConfig, layer_loop: str = "unrolled"
) -> jaxpar.InferenceEngine:
    params = jaxpar.models.with_layer_loop(CONFIG, _float_params(), layer_loop)
    return jaxpar.InferenceEngine(
        CONFIG,
        params,
        parallel,
        max_batch=4,
        max_seq_len=48,
        mesh=make_mesh(parallel, jax.devices()[: parallel.size]),
        options=ExecutionOptions(layer_loop=layer_loop, kv_cache_dtype=mode),
    )


@pytest.mark.sweep  # sharded = single device: the contiguous cache's test above (full tier)
@pytest.mark.parametrize("parallel", [ParallelConfig(dp=2, tp=2)], ids=["dp2-tp2"])
def test_sharded_paged_serving_equals_single_device(parallel):
    """``generate`` runs the paged serving core: pages over dp, kv heads over tp, scales
    split as their values (kv heads held whole over tp: the kernel test below); the sharded
    engine's layers are stacked (``layer_loop="scan"``: one pool ``[L, K, A, Z, H]`` and its
    scales, written per layer inside the scan)."""
    single, sharded = _served("int8", ParallelConfig()), _served("int8", parallel, "scan")
    assert sharded.tokens == single.tokens
    lp = np.asarray([[t.logprob for t in row] for row in single.logprobs])
    lp_sharded = np.asarray([[t.logprob for t in row] for row in sharded.logprobs])
    assert np.max(np.abs(lp - lp_sharded)) <= 1e-4


# --- data movement ----------------------------------------------------------------------------

BUDGET = 0.05  # of (quantized) parameter + cache bytes per device, as tests/test_data_movement
# A tp=2 shard of the scales, [8, 1, 64, 1], has the element count and bytes of the [8, 64]
# f32 activations (d_model 64); the check counts only moves of buffers the step was given
# (tests/_movement.py), so their copies are not taken for copies of the scales.
CACHE_LEN = 64


@functools.cache
def _abstract(parallel: ParallelConfig, mode: str, batch: int) -> AbstractEngine:
    bf16 = dataclasses.replace(CONFIG, dtype="bfloat16", param_dtype="bfloat16")
    config = _quantized(bf16, mode)
    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    return AbstractEngine.build(config, parallel, max_batch=batch, max_seq_len=CACHE_LEN, mesh=mesh)


@pytest.mark.parametrize(
    ("parallel", "mode"),
    sweep([(ParallelConfig(), "fp8"), (ParallelConfig(tp=2), "int8")], lambda p: p[1] == "int8"),
    ids=str,
)
def test_quantized_cache_decode_copies_no_weight_or_layer_cache(parallel, mode):
    """The contiguous cache's decode step (a cast of the cache fused into a copy counts,
    see tests/_movement.py): scales apply to the scores and the softmax weights, never to
    a dequantized cache."""
    eng = _abstract(parallel, mode, 8)
    compiled = compile_step(eng, "decode", prompt_len=24)
    fraction = moved_fraction(compiled, eng, 8, CACHE_LEN)
    assert fraction <= BUDGET, f"{fraction:.1%} of parameter + cache bytes moved per step"


@pytest.mark.parametrize(
    ("parallel", "mode"),
    # The fast tier keeps the contiguous cache's movement check above; the paged pool's
    # quantized reads run in its prefix-hit test below.
    sweep([(ParallelConfig(), "int8"), (ParallelConfig(dp=2, tp=2), "fp8")], lambda _: False),
    ids=str,
)
def test_quantized_paged_step_copies_no_weight_or_page_pool(parallel, mode):
    batch = 6  # not 8: see tests/test_data_movement.py's PAGED_ROWS
    eng = _abstract(parallel, mode, batch)
    pool = PagePool(
        page_size=8, pages_per_shard=33, shards=parallel.dp, rows=batch, max_seq_len=CACHE_LEN
    )
    slots = SlotSteps(eng.steps, eng.run, pool)
    compiled = slots.compile_step(eng.params, pool.pages_per_row)
    assert any(isinstance(x, QuantKV) for x in slots.abstract().k)
    fraction = paged_moved_fraction(compiled, eng, slots)
    assert fraction <= BUDGET, f"{fraction:.1%} of parameter + pool bytes moved per step"


# --- the Pallas GPU paged kernel's scale inputs (interpret mode on CPU) -----------------------


@pytest.mark.jax_compat
@pytest.mark.parametrize("name", sweep(["single", "tp4-kv-replicated"], "single".__eq__))
def test_pallas_gpu_paged_kernel_reads_the_scales(name):
    """The kernel given int8 pages and their ``[K, A, Z]`` scales equals the XLA path over
    the same quantized pool (f32, 1e-5 of the largest output as tests/test_paged_kernels.py
    for outputs of size ~1; measured 1.7e-6), and both equal
    attention over the dequantized pool: the scales are applied, and to the right keys."""
    from tests.test_paged_kernels import STRATEGIES, _attend, _case, _max_diff, _reference, _run

    config, n_kv_heads = STRATEGIES[name]
    case = _case(config, n_kv_heads=n_kv_heads)
    # Vectors of different magnitudes: a scale applied to the wrong key changes the result.
    rng = np.random.default_rng(5)
    spread = jnp.asarray(2.0 ** rng.integers(-3, 4, size=(*case.k_KAZH.shape[:3], 1)))
    case.k_KAZH = quantize_kv(case.k_KAZH * spread, "int8")
    case.v_KAZH = quantize_kv(case.v_KAZH * spread, "int8")

    def both(*args):
        return _attend("pallas_gpu")(*args), _attend("xla")(*args)

    (out, ref), jaxpr = _run(config, both, case, n_kv_heads)
    assert jaxpr.count("pallas_call") == 1, "the kernel path fell back to XLA"
    tol = 1e-5 * float(np.max(np.abs(np.asarray(ref))))
    assert _max_diff(out, ref) < tol
    dequantized = dataclasses.replace(
        case,
        k_KAZH=dequantize_kv(case.k_KAZH, jnp.float32),
        v_KAZH=dequantize_kv(case.v_KAZH, jnp.float32),
    )
    assert _max_diff(out, _reference(dequantized)) < tol


# --- prefix hits and chunked prefill read the quantized pages ----------------------------------


def test_prefix_hits_over_a_quantized_cache():
    """A prefix hit (as every chunk of a chunked prefill after the first) prefills over its
    context read back from the int8 pages, dequantized; a cold prompt attends to its own
    float K/V inside one prefill (as offline ``generate``). The same prompt served cold,
    then again with all but its last page cached, differs only by the context's
    quantization error (int8: at most 0.4% of each vector's largest element), so greedy
    tokens may differ only at near-ties: at least 90% must agree (measured: all of them,
    here and with chunks on dp2·tp2, 36 of 36)."""
    from jaxpar.engine import ContinuousBatcher, Sampling
    from jaxpar.engine._kv_budget import KVBudget
    from tests.test_prefix_chunked import _shared_prefix_requests

    engine = _serving_engine("int8", ParallelConfig())  # its programs shared (cached)
    request = dict(_shared_prefix_requests()[0], sampling=Sampling(), max_tokens=16)
    batcher = ContinuousBatcher(engine, kv_budget=KVBudget(page_size=4, tokens=256))
    assert "256 tokens (int8 + f32 scales)" in batcher.describe_cache()  # serve's start line
    with batcher:
        cold = batcher.submit(**request)
        expected = cold.result(timeout=120)
        hit = batcher.submit(**request)
        got = hit.result(timeout=120)
    whole = (len(request["prompt"]) - 1) // 4 * 4
    assert (cold.cached_tokens, hit.cached_tokens) == (0, whole)
    assert len(got) == len(expected) == 16
    assert sum(a == b for a, b in zip(expected, got, strict=True)) >= 0.9 * 16, (expected, got)


# --- the command line ----------------------------------------------------------------------------


def test_plan_counts_the_quantized_cache_and_keeps_the_flag(capsys):
    """``jaxpar plan`` (analytic): llama-1b in bf16 (head_dim 64) on 2 devices; int8 K/V
    with their scales take (64 + 4) / (2 * 64) = 0.53 of the bf16 cache's bytes (the rows'
    int32 lengths aside) in every plan, pipelined ones (pp=2: each stage its layers' share)
    among them, while the prompt K/V a prefill step returns stay bf16; and the proposed
    command keeps the flag."""
    import json

    from jaxpar.cli import main

    args = ["plan", "--model", "llama-1b", "--dtype", "bfloat16", "--devices", "2"]
    args += ["--hardware", "h100", "--batch", "16", "--prompt-len", "64", "--gen-len", "64"]

    def plans(*extra):
        assert main([*args, *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    full, quant = plans(), plans("--kv-cache-dtype", "int8")
    by_strategy = {p["strategy"]: p["memory"]["kv_cache"] for p in full["plans"]}
    by_prompt = {p["strategy"]: p["memory"]["prompt_kv"] for p in full["plans"]}
    compared = 0
    assert any(p["degrees"]["pp"] > 1 for p in quant["plans"])
    for p in quant["plans"]:
        if p["strategy"] in by_strategy:
            ratio = p["memory"]["kv_cache"] / by_strategy[p["strategy"]]
            assert abs(ratio - 68 / 128) < 0.01, (p["strategy"], ratio)
            # Prefill returns the prompt's K/V in bf16: quantized only at the handoff.
            assert p["memory"]["prompt_kv"] == by_prompt[p["strategy"]]
            compared += 1
    assert compared > 0
    assert "--kv-cache-dtype int8" in quant["command"]
    # A disaggregated plan's K/V cross as the cache stores them.
    from jaxpar.plan._disaggregated import kv_transfer_bytes
    from jaxpar.plan._enumerate import Workload

    model = dataclasses.replace(preset("llama-1b"), dtype="bfloat16", param_dtype="bfloat16")
    work = Workload(batch=4, prompt_len=64, gen_len=8)
    int8 = _quantized(model, "int8")
    ints = 2 * work.prefill_rows * 4  # each row's length and first token
    assert (kv_transfer_bytes(int8, work) - ints) * 128 == (
        kv_transfer_bytes(model, work) - ints
    ) * 68


@pytest.mark.parametrize("command", ["run", "serve", "demo", "explain"])
def test_the_flag_is_on_every_command_that_holds_a_cache(capsys, command):
    from jaxpar.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert "--kv-cache-dtype {int8,fp8}" in " ".join(capsys.readouterr().out.split())


def test_explain_lists_the_pool_and_its_scales_with_dtypes_and_bytes():
    from jaxpar.cli._explain import tensor_rows
    from jaxpar.spec import Phase

    config = _quantized(CONFIG, "fp8")
    kw = dict(batch=8, prompt_len=16, max_seq_len=64)
    rows = {
        r["tensor"].split(" (")[0]: r
        for r in tensor_rows(config, ParallelConfig(tp=2), Phase.DECODE, **kw)
    }
    pool, scales = rows["KV page pool"], rows["KV cache scales"]
    assert (pool["dtype"], scales["dtype"]) == ("float8_e4m3fn", "float32")
    assert pool["spec"] == scales["spec"]  # split as their values: kv heads over tp
    assert scales["bytes_per_device"] * CONFIG.head_dim == pool["bytes_per_device"] * 4
    full = {
        r["tensor"].split(" (")[0]: r
        for r in tensor_rows(CONFIG, ParallelConfig(tp=2), Phase.DECODE, **kw)
    }
    assert "KV cache scales" not in full
    assert full["KV page pool"]["bytes_per_device"] == 4 * pool["bytes_per_device"]  # f32 vs fp8
    prefill = tensor_rows(config, ParallelConfig(tp=2), Phase.PREFILL, **kw)
    assert prefill[0]["dtype"] == "float32"  # prefill's K/V leave the step unquantized


@pytest.mark.sweep  # a variant: quantized serving's main case is the prefix-hit test above
def test_disaggregated_kv_crosses_quantized():
    """Prefill on device 0, decode on device 1: the prompt's K/V are quantized where the
    prefill ran and cross as int8 values plus float32 scales (2 x L x T x K x (H + 4)
    bytes, and the row's length and first token), then are inserted as they are: the
    same tokens as the offline run of the same quantized model on one device."""
    from jaxpar.engine import ContinuousBatcher, Sampling
    from jaxpar.engine._kv_budget import KVBudget

    def engine(device: int) -> jaxpar.InferenceEngine:
        mesh = make_mesh(ParallelConfig(), jax.devices()[device : device + 1])
        return jaxpar.InferenceEngine(
            CONFIG, _float_params(), max_batch=4, max_seq_len=48, mesh=mesh, kv_cache_dtype="int8"
        )

    batcher = ContinuousBatcher(
        engine(1), prefill_engine=engine(0), kv_budget=KVBudget(page_size=4, tokens=128)
    )
    with batcher:
        got = batcher.submit(prompt=PROMPT, max_tokens=24, sampling=Sampling()).result(120)
        stats = batcher.stats
    assert got == _served("int8", ParallelConfig()).tokens[0]
    c = CONFIG
    per_token = 2 * c.n_layers * c.n_kv_heads * (c.head_dim + 4)  # int8 K and V, f32 scales
    t, rest = divmod(stats.transfer_bytes - 8, per_token)  # 8: the length and first token
    assert stats.transfers == 1 and rest == 0 and len(PROMPT) <= t <= 48, stats.transfer_bytes
