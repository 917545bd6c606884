"""Quantized MoE experts (``quantize`` int8 / fp8 per output channel per expert, int4 per
group): the grouped and masked expert matmuls against the dequantized kernels, accuracy
against the float model on the Hugging Face MoE fixtures, sharded = single-device over
the padded and (emulated) ragged exchanges, and the compiled decode step reading the
quantized bytes (argument bytes, no dequantized copy of an expert kernel)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar import ParallelConfig
from jaxpar.engine import AbstractEngine
from jaxpar.inspect._report import compile_step
from jaxpar.models import (
    ExecutionOptions,
    ModelRun,
    abstract_model,
    init_params,
    load_hf_checkpoint,
    preset,
    quantize_params,
)
from jaxpar.models import prefill as model_prefill
from jaxpar.models._moe_matmul import grouped_matmul, masked_matmul
from jaxpar.models._quant import from_stored, quantize_array, scale_layout
from jaxpar.spec import make_mesh
from tests._movement import moved_fraction
from tests._tiers import sweep

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
PROMPT = [5, 17, 42, 99, 3, 25, 7, 64]
STEPS = 64


# --- the expert matmuls ----------------------------------------------------------------------


def _dequantized(q: jax.Array, scale_EgO: jax.Array) -> np.ndarray:
    """``q * scale`` per (expert, group of contracted rows, output channel), in float64."""
    e, c, o = q.shape
    g = scale_EgO.shape[1]
    w = np.asarray(q.astype(jnp.float32), np.float64).reshape(e, g, c // g, o)
    return (w * np.asarray(scale_EgO, np.float64)[:, :, None, :]).reshape(e, c, o)


@pytest.mark.parametrize("mode", ["int8", "fp8", "int4"])
def test_expert_matmuls_equal_the_dequantized_kernels(mode):
    """Row r times its expert's kernel, scaled after the dot (and per group for int4: 256
    contracted rows, 2 groups), equals ``x @ (q * scale)`` per expert: the grouped
    ``ragged_dot`` (accelerators) and the masked batched matmuls (XLA:CPU) alike."""
    rng = np.random.default_rng(0)
    e, c, o, sizes = 3, 256, 8, np.array([4, 0, 5], np.int32)
    rows = 11  # 9 grouped rows, 2 past the groups
    w = jnp.asarray(rng.normal(size=(e, c, o)), jnp.float32)
    shape, _ = scale_layout(w.shape, ("experts", "embed", "mlp"), 1, mode, batch=1)
    assert shape == ((e, 2, o) if mode == "int4" else (e, 1, o))
    q, scale = quantize_array(w, shape, mode)
    x = rng.normal(size=(rows, c)).astype(np.float32)
    deq = _dequantized(q, scale)
    want = np.zeros((rows, o))
    ends = np.cumsum(sizes)
    for k, (start, end) in enumerate(zip(ends - sizes, ends, strict=True)):
        want[start:end] = x[start:end].astype(np.float64) @ deq[k]
    got = grouped_matmul(jnp.asarray(x), q, jnp.asarray(sizes), scale)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    mask_ER = np.zeros((e, rows), bool)
    for k, (start, end) in enumerate(zip(ends - sizes, ends, strict=True)):
        mask_ER[k, start:end] = True
    x_ERC = jnp.asarray(np.where(mask_ER[..., None], x[None], 0), jnp.float32)
    masked = np.asarray(masked_matmul(x_ERC, q, scale)).sum(0)
    np.testing.assert_allclose(masked, want, rtol=1e-5, atol=1e-4)


# --- accuracy against the float model ---------------------------------------------------------


@functools.cache
def _prefill_fn(config):
    graphdef, _ = nnx.split(abstract_model(config))
    return jax.jit(functools.partial(model_prefill, graphdef, all_logits=True))


def _all_logits(config, params, tokens) -> np.ndarray:
    """Logits at every position of one sequence (one prefill)."""
    t = jnp.asarray([tokens], jnp.int32)
    logits, *_ = _prefill_fn(config)(params, t, jnp.asarray([t.shape[1]], jnp.int32))
    return np.asarray(logits[0], np.float32)


@functools.cache
def _float(fixture: str):
    """(config, float params, teacher tokens: the prompt and the float model's 64 greedy
    tokens after it). Greedy by re-running one compiled prefill over the whole buffer:
    attention is causal and the MoE dropless, so the tokens after a position (zeros until
    chosen) do not change its logits."""
    config, params = load_hf_checkpoint(FIXTURES / fixture)
    tokens = PROMPT + [0] * STEPS
    for i in range(len(PROMPT), len(tokens)):
        tokens[i] = int(np.argmax(_all_logits(config, params, tokens)[i - 1]))
    return config, params, tuple(tokens)


def _teacher_logits(config, params, tokens) -> np.ndarray:
    """Logits predicting each of the 64 teacher tokens (teacher-forced)."""
    return _all_logits(config, params, tokens)[len(PROMPT) - 1 : -1]


@functools.cache
def _float_logits(fixture: str) -> np.ndarray:
    config, params, tokens = _float(fixture)
    return _teacher_logits(config, params, tokens)


# Bounds, and why. The fixtures' float logits have std ~1.2, |max| ~4.3 and a median
# top-2 gap of 0.25-0.36 (min 0.003: random weights give near ties). Every kernel with a
# scale is quantized: attention and the experts (the router is not), so the error of
# each matmul is as tests/test_quantize.py derives (int8 ~0.55%, fp8 e4m3 ~3.6%, int4
# ~10% per matmul, relative) -- except where a quantized hidden state changes which
# top-k experts a token's router picks: that token's layer output jumps by O(1), which
# sets the max error. Measured (relative rms logit error / max |error| over max |logit|
# / greedy agreement of 64, teacher-forced):
#   mixtral int8 0.030 / 0.095 / 62;  qwen3_moe int8 0.016 / 0.037 / 62,
#   fp8 0.058 / 0.080 / 60, int4 0.197 / 0.235 / 47;  gpt_oss int8 0.075 / 0.241 / 62.
# Bounds give ~2x room; and every greedy disagreement must sit at a step whose float
# top-two margin is below twice that step's logit error (only there can an error that
# size flip the choice).
BOUNDS = {  # (fixture, mode): (relative rms error, max error / max |logit|, min agreement)
    ("mixtral_fused", "int8"): (0.06, 0.2, 58),
    ("qwen3_moe", "int8"): (0.04, 0.1, 58),
    ("qwen3_moe", "fp8"): (0.12, 0.16, 54),
    ("qwen3_moe", "int4"): (0.4, 0.5, 38),
    ("gpt_oss", "int8"): (0.15, 0.45, 58),
}


@pytest.mark.parametrize(
    ("fixture", "mode"),
    sweep(BOUNDS, lambda case: case in {("qwen3_moe", "int4"), ("gpt_oss", "int8")}),
    ids=str,
)
def test_quantized_experts_track_the_float_model(fixture, mode):
    config, params, tokens = _float(fixture)
    want = _float_logits(fixture)
    qparams = quantize_params(config, params, mode)
    experts = qparams["layers"][0]["ffn"]["experts"]
    assert experts["down_kernel"].get_value().dtype == jnp.dtype(
        {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.int4}[mode]
    )
    got = _teacher_logits(ModelRun(config, ExecutionOptions(quantize=mode)), qparams, tokens)
    err_S = np.max(np.abs(got - want), axis=-1)
    rel_rms = float(np.sqrt(np.mean((got - want) ** 2)) / np.std(want))
    rel_max = float(err_S.max() / np.abs(want).max())
    top2 = np.sort(want, axis=-1)[:, -2:]
    margin_S = top2[:, 1] - top2[:, 0]
    disagree = np.argmax(got, -1) != np.argmax(want, -1)
    max_rms, max_rel, min_agree = BOUNDS[fixture, mode]
    measured = (rel_rms, rel_max, STEPS - int(disagree.sum()))
    assert 0 < rel_rms <= max_rms and rel_max <= max_rel, measured
    assert STEPS - disagree.sum() >= min_agree, measured
    assert np.all(margin_S[disagree] < 2 * err_S[disagree]), (margin_S, err_S, disagree)


def test_the_quantized_model_is_the_dequantized_float_model():
    """GPT-OSS (expert biases, clamped SwiGLU, router bias) with int8 kernels computes what
    the float model computes with every kernel replaced by ``q * scale``: the scales are
    applied to the right experts and channels, after the dot, on the masked path."""
    config, params, tokens = _float("gpt_oss")
    qparams = quantize_params(config, params, "int8")
    flat = dict(nnx.to_flat_state(qparams))
    deq = []
    for path, var in nnx.to_flat_state(params):
        scale = flat.get((*path[:-1], f"{path[-1]}_scale"))
        if scale is None:
            deq.append((path, var))
            continue
        q, s = flat[path].get_value(), scale.get_value()
        if q.ndim == 3 and "experts" in path:
            w = _dequantized(q, s)
        else:  # stored out-major: dequantized there, then back in the float kernel's order
            w = np.asarray(q.astype(jnp.float32), np.float64) * np.asarray(s, np.float64)
            w = from_stored(w, flat[path].get_metadata()["stored_order"])
        deq.append((path, var.replace(jnp.asarray(w, jnp.float32))))
    want = _teacher_logits(config, nnx.from_flat_state(deq), tokens)
    got = _teacher_logits(ModelRun(config, ExecutionOptions(quantize="int8")), qparams, tokens)
    assert np.max(np.abs(got - want)) <= 1e-4, np.max(np.abs(got - want))


# --- sharded = single device ------------------------------------------------------------------


def _hf_engine(fixture: str, mode: str, parallel: ParallelConfig) -> jaxpar.InferenceEngine:
    """The fixture read straight into ``parallel``'s shards, each kernel quantized where it
    lies as it is read (the experts split over ep and their columns over tp)."""
    return jaxpar.engine_from_hf(
        FIXTURES / fixture,
        parallel,
        max_batch=4,
        max_seq_len=32,
        mesh=make_mesh(parallel, jax.devices()[: parallel.size]),
        quantize=mode,
    )


SHARDED = [
    # GPT-OSS: expert biases (the down bias once over tp), clamped SwiGLU, padded exchange.
    ("gpt_oss", "int8", ParallelConfig(ep=2, tp=2)),
    # Mixtral: batch over dp as well, padded; fp8 kernels.
    ("mixtral_fused", "fp8", ParallelConfig(dp=2, ep=2, tp=2)),
]
PROMPTS = [PROMPT, PROMPT[2:7], PROMPT[:3], [9, 8, 7, 6]]


@pytest.mark.parametrize(
    ("fixture", "mode", "parallel"), sweep(SHARDED, lambda case: case[0] == "gpt_oss"), ids=str
)
def test_sharded_quantized_experts_equal_single_device(fixture, mode, parallel):
    one = _hf_engine(fixture, mode, ParallelConfig())
    sharded = _hf_engine(fixture, mode, parallel)
    experts = sharded.params["layers"][0]["ffn"]["experts"]
    kernel, scale = experts["gate_kernel"].get_value(), experts["gate_kernel_scale"].get_value()
    assert scale.shape == (kernel.shape[0], 1, kernel.shape[2])  # [E, 1, F]
    assert tuple(scale.sharding.spec) == tuple(kernel.sharding.spec) == ("ep", None, "tp")
    # generate runs the prefill and decode programs: tokens equal, each chosen token's
    # log-probability (the f32 logits through one log-softmax) within 1e-4.
    got = sharded.generate(PROMPTS, 8, stop_tokens=(), logprobs=0)
    want = one.generate(PROMPTS, 8, stop_tokens=(), logprobs=0)
    assert got.tokens == want.tokens
    lp = np.asarray([[t.logprob for t in row] for row in got.logprobs])
    lp_one = np.asarray([[t.logprob for t in row] for row in want.logprobs])
    assert np.max(np.abs(lp - lp_one)) <= 1e-4


@pytest.mark.sweep
def test_ragged_exchange_of_quantized_experts_equals_single_device(monkeypatch):
    """Qwen3-MoE (64 experts of F = 4, top-8) under ep4·tp2 through the ragged exchange
    (XLA:CPU compiles none: the emulation tests/test_models_moe_ragged.py checks), int8
    experts; prefill only, as tests/test_engine_hf.py (the emulation compiles slowly)."""
    from jaxpar.engine import _moe_probe
    from tests.test_models_moe_ragged import emulated_ragged_all_to_all

    one = _hf_engine("qwen3_moe", "int8", ParallelConfig())
    want = np.asarray(one.prefill_logits(*one.pad_prompts(PROMPTS)))
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    monkeypatch.setattr(_moe_probe, "ragged_all_to_all_compiles", lambda device: True)
    sharded = _hf_engine("qwen3_moe", "int8", ParallelConfig(ep=4, tp=2))
    assert sharded.options.moe_dispatch == "ragged"
    got = np.asarray(sharded.prefill_logits(*sharded.pad_prompts(PROMPTS)))
    for i, p in enumerate(PROMPTS):
        np.testing.assert_allclose(got[i, : len(p)], want[i, : len(p)], atol=1e-4, rtol=0)


# int4 with more than one group per expert column: F = 256 (down: 2 groups of 128 rows,
# split over tp=2 with their rows), D = 256 (gate/up: 2 groups along the embedding).
INT4_MOE = dataclasses.replace(preset("tiny-moe"), n_layers=2, d_model=256, d_ff=256)


@pytest.mark.sweep
def test_int4_expert_groups_split_over_tp_equal_single_device():
    """int4 down kernels' groups split over tp with their rows (scales ``[E, 2, D]``,
    P(ep, tp, None)), under a capacity factor (the capacity path: drops counted), the
    sharded engine's layers stacked under ``lax.scan`` (the scales' axes derived inside
    the scan, where the variables' metadata also names the stacked dim)."""
    if jax.__version_info__ < (0, 11):
        pytest.skip("int4 placement needs jax >= 0.11 (tests/test_quantize.py checks the refusal)")
    params = quantize_params(INT4_MOE, init_params(INT4_MOE, seed=0), "int4")
    down_scale = params["layers"][0]["ffn"]["experts"]["down_kernel_scale"].get_value()
    assert down_scale.shape == (8, 2, 256)
    options = ExecutionOptions(moe_capacity_factor=4.0)  # C at the dropless bound: no drops
    kw = dict(max_batch=4, max_seq_len=32, options=options)
    one = jaxpar.InferenceEngine(INT4_MOE, params, **kw)
    parallel = ParallelConfig(ep=2, tp=2)
    scan = dict(kw, options=dataclasses.replace(options, layer_loop="scan"))
    sharded = jaxpar.InferenceEngine(
        INT4_MOE, params, parallel, mesh=make_mesh(parallel, jax.devices()[:4]), **scan
    )
    placed = sharded.params["layers"]["ffn"]["experts"]["down_kernel_scale"].get_value()
    assert tuple(placed.sharding.spec) == (None, "ep", "tp", None)  # [L, E, 2, D]
    a, b = one.generate(PROMPTS, 8), sharded.generate(PROMPTS, 8)
    assert a.tokens == b.tokens and b.moe_dropped_total == 0


# --- the compiled decode step reads the quantized bytes --------------------------------------

# bf16, experts dominating: 4 layers of 8 experts [256, 512] (9.4M expert elements)
# against 0.4M attention and 66K embedding + LM head elements.
BIG = dataclasses.replace(
    preset("tiny-moe"), d_model=256, d_ff=512, dtype="bfloat16", param_dtype="bfloat16"
)


def _abstract(config, parallel: ParallelConfig, batch: int = 8) -> AbstractEngine:
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    return AbstractEngine.build(config, parallel, max_batch=batch, max_seq_len=64, mesh=mesh)


@pytest.mark.parametrize(
    "parallel", sweep([ParallelConfig(), ParallelConfig(ep=2, tp=2)], lambda p: p.size > 1), ids=str
)
def test_int8_experts_decode_reads_at_most_055_of_the_bf16_bytes(parallel):
    def argument_bytes(config):
        compiled = compile_step(_abstract(config, parallel), "decode", prompt_len=8)
        return compiled.memory_analysis().argument_size_in_bytes

    bf16 = argument_bytes(BIG)
    int8 = argument_bytes(ModelRun(BIG, ExecutionOptions(quantize="int8")))
    assert int8 <= 0.55 * bf16, (int8, bf16, int8 / bf16)


BUDGET = 0.05  # of (quantized) parameter + cache bytes per device, as tests/test_data_movement
MOVEMENT_MOE = dataclasses.replace(preset("tiny-moe"), dtype="bfloat16", param_dtype="bfloat16")


@pytest.mark.parametrize(
    ("parallel", "mode"),
    sweep(
        [(ParallelConfig(), "int8"), (ParallelConfig(ep=2, tp=2), "int4")], lambda c: c[1] == "int4"
    ),
    ids=str,
)
def test_quantized_moe_decode_copies_no_weight_or_layer_cache(parallel, mode):
    """No dequantized expert kernel (cast and scaled) and no copy of one per decode step:
    the scales multiply the matmuls' outputs."""
    eng = _abstract(ModelRun(MOVEMENT_MOE, ExecutionOptions(quantize=mode)), parallel)
    compiled = compile_step(eng, "decode", prompt_len=24)
    fraction = moved_fraction(compiled, eng, 8, 64)
    assert fraction <= BUDGET, f"{fraction:.1%} of quantized parameter + cache bytes moved"


@pytest.mark.sweep
def test_bf16_int4_experts_with_several_groups_run():
    """bf16 compute with int4 experts of 4 groups (D 512): XLA:CPU's dot thunk refused the
    masked matmul's bf16 x bf16 -> f32 form at this width (found by the bench); the
    logits come out finite and near the float-compute run of the same int4 weights."""
    if jax.__version_info__ < (0, 11):
        pytest.skip("int4 placement needs jax >= 0.11 (tests/test_quantize.py checks the refusal)")
    model = dataclasses.replace(
        preset("tiny-moe"), n_layers=1, d_model=512, head_dim=64, n_kv_heads=2, d_ff=128
    )
    bf16 = dataclasses.replace(model, dtype="bfloat16", param_dtype="bfloat16")
    params = quantize_params(bf16, init_params(bf16, seed=0), "int4")
    assert params["layers"][0]["ffn"]["experts"]["gate_kernel_scale"].get_value().shape[1] == 4
    got = _all_logits(ModelRun(bf16, ExecutionOptions(quantize="int4")), params, PROMPT)
    f32 = ExecutionOptions(quantize="int4", dtype="float32")
    want = _all_logits(ModelRun(bf16, f32), params, PROMPT)
    assert np.all(np.isfinite(got))
    assert np.max(np.abs(got - want)) <= 0.05 * np.max(np.abs(want)), np.max(np.abs(got - want))


def test_int4_groups_that_do_not_divide_over_tp_are_refused_before_placing():
    """d_ff 256 is 2 int4 groups per expert column: tp=4 cannot split their scales with
    the rows. The validator says so (before anything is placed or compiled), naming the
    dims, the rule and the legal degrees."""
    from jaxpar.errors import IllegalStrategyError
    from jaxpar.spec import validate

    run = ModelRun(INT4_MOE, ExecutionOptions(quantize="int4"))
    with pytest.raises(IllegalStrategyError, match=r"d_ff=256 has 2 groups.*tp=4.*tp in \[1, 2\]"):
        validate(run, ParallelConfig(ep=2, tp=4), n_devices=8)
    validate(run, ParallelConfig(ep=2, tp=2), n_devices=4)  # 2 groups over tp=2: legal
    validate(ModelRun(INT4_MOE, ExecutionOptions(quantize="int8")), ParallelConfig(ep=2, tp=4))
