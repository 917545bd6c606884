"""Weight-only quantization (int8, fp8 per output channel; int4 per group): accuracy
against the float model, decode argument bytes, scales sharded as their kernels, the same
integers on every mesh, and the engine and CLI paths."""

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
from jaxpar.errors import ConfigError
from jaxpar.inspect._report import compile_step
from jaxpar.models import (
    EmbedConfig,
    ExecutionOptions,
    ModelRun,
    abstract_model,
    init_params,
    preset,
    quantize_params,
)
from jaxpar.models import prefill as model_prefill
from jaxpar.models._quant import (
    from_stored,
    qmatmul,
    quantize_array,
    scale_layout,
    stored_order,
    to_stored,
)
from jaxpar.spec import make_mesh
from tests._tiers import sweep

CONFIG = preset("tiny-gqa")  # float32, 4 layers, D 64, 8 query heads over 2 kv heads
NEW_TOKENS = 64
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64]


@functools.cache
def _float_params():
    return init_params(CONFIG, seed=0)


@functools.cache
def _teacher_tokens() -> tuple[int, ...]:
    """The float model's 64 greedy tokens after PROMPT."""
    engine = jaxpar.InferenceEngine(CONFIG, _float_params(), max_batch=1, max_seq_len=96)
    return tuple(PROMPT + engine.generate([PROMPT], NEW_TOKENS).tokens[0])


def _all_logits(config, params) -> np.ndarray:
    """Logits at every position of the teacher sequence (teacher-forced: both models see
    the same tokens, so one early disagreement does not decide the rest)."""
    graphdef, _ = nnx.split(abstract_model(config))
    tokens = jnp.asarray([_teacher_tokens()], jnp.int32)
    lengths = jnp.asarray([tokens.shape[1]], jnp.int32)
    fn = jax.jit(functools.partial(model_prefill, graphdef, all_logits=True))
    logits, *_ = fn(params, tokens, lengths)
    return np.asarray(logits[0, len(PROMPT) - 1 : -1], np.float32)  # predicting the 64 new


@functools.cache
def _float_logits() -> np.ndarray:
    """The float model's teacher-forced logits, which every quantize mode is held to."""
    return _all_logits(CONFIG, _float_params())


# Bounds, and why. The float model's logits have std 1.0 and a median top-2 gap of 0.21
# (min 0.014: random-init logits are flat, so some greedy choices are near ties). A weight
# quantized with step q = amax/qmax errs by ~q/sqrt(12); Gaussian columns of 64 (D here)
# have amax ~2.4 sigma, so per matmul the relative error is ~0.55% for int8 (qmax 127),
# ~3.6% for fp8 e4m3 (3 mantissa bits: relative, not absolute) and ~10% for int4 (qmax
# 7), compounding over 4 layers x 4 matmuls. Measured (seed 0), relative rms logit error
# / max |error| / greedy agreement over the 64 tokens (teacher-forced):
#   int8 0.028 / 0.15 / 62 of 64;  fp8 0.13 / 0.72 / 51 of 64;  int4 0.52 / 2.8 / 22 of 64.
# The bounds give each ~1.5-2x room. int8 agrees on nearly every token (its two misses
# are near ties); int4 at groups of 64 on an untrained model is well above chance (1/256)
# but far from float: use it where the weights' memory matters more than fidelity.
BOUNDS = {  # quantize: (relative rms logit error, max |logit error|, min greedy agreement)
    "int8": (0.05, 0.3, 0.93),
    "fp8": (0.25, 1.2, 0.7),
    "int4": (0.8, 4.5, 0.25),
}


@pytest.mark.parametrize("quantize", list(BOUNDS))
def test_quantized_logits_and_greedy_tokens_track_the_float_model(quantize):
    want = _float_logits()
    qparams = quantize_params(CONFIG, _float_params(), quantize)
    got = _all_logits(ModelRun(CONFIG, ExecutionOptions(quantize=quantize)), qparams)
    error = np.abs(got - want)
    rel_rms = float(np.sqrt(np.mean(error**2)) / np.std(want))
    agree = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    max_rel, max_error, min_agree = BOUNDS[quantize]
    measured = (rel_rms, float(error.max()), agree)
    assert rel_rms <= max_rel and error.max() <= max_error and agree >= min_agree, measured


@pytest.mark.parametrize("tied", sweep([False, True], lambda tied: tied), ids=["untied", "tied"])
def test_quantized_embeddings_track_the_float_model_and_split_with_the_table(tied):
    """``quantize_embeddings``: the token table (and an untied LM head, stored [V, D]) int8
    per vocabulary row, scales [V, 1] split over tp with their rows; off by default. The
    teacher-forced logits stay within int8's bounds above (measured rel rms 0.034 untied
    and tied, against 0.028 with float tables; greedy agreement 61 and 59 of 64, against 62
    and 60), and tp2 equals one device."""
    config = dataclasses.replace(CONFIG, embed=EmbedConfig(tied=tied))
    params = init_params(config, seed=0)
    run = ModelRun(config, ExecutionOptions(quantize="int8", quantize_embeddings=True))
    assert "token_table_scale" not in quantize_params(config, params, "int8")["embed"]
    qparams = quantize_params(run, params, "int8")
    want = _all_logits(config, params)
    got = _all_logits(run, qparams)
    rel_rms = float(np.sqrt(np.mean((got - want) ** 2)) / np.std(want))
    assert 0 < rel_rms <= BOUNDS["int8"][0], rel_rms
    kw = dict(max_batch=2, max_seq_len=32, options=run.options)
    one = jaxpar.InferenceEngine(config, params, **kw)
    tp2 = jaxpar.InferenceEngine(config, params, ParallelConfig(tp=2), **kw)
    table = tp2.params["embed"]["token_table"].get_value()
    scale = tp2.params["embed"]["token_table_scale"].get_value()
    assert table.dtype == jnp.int8 and scale.shape == (config.vocab_size, 1)
    assert scale.sharding.spec == table.sharding.spec  # rows split over tp together
    if not tied:
        head = tp2.params["lm_head"]["kernel"].get_value()
        assert head.dtype == jnp.int8 and head.shape == (config.vocab_size, config.d_model)
    tokens, lengths = one.pad_prompts([PROMPT, PROMPT[:5]])
    np.testing.assert_allclose(
        np.asarray(tp2.prefill(tokens, lengths)[0]),
        np.asarray(one.prefill(tokens, lengths)[0]),
        atol=1e-4,
        rtol=0,
    )
    assert tp2.generate([PROMPT], 8).tokens == one.generate([PROMPT], 8).tokens
    with pytest.raises(ConfigError, match="quantize_embeddings=True"):
        ExecutionOptions(quantize_embeddings=True)


# Weights dominate: 4 layers of D 512, F 2048 (14.7M kernel elements) against 0.26M in
# the bf16 embedding and LM head and a 0.26 MB bf16 cache (8 rows x 64 positions).
BIG = dataclasses.replace(
    CONFIG, d_model=512, head_dim=64, d_ff=2048, dtype="bfloat16", param_dtype="bfloat16"
)
BYTES_STRATEGIES = [ParallelConfig(), ParallelConfig(tp=2), ParallelConfig(dp=2, tp=2)]


def _decode_argument_bytes(config, parallel: ParallelConfig) -> int:
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    engine = AbstractEngine.build(config, parallel, max_batch=8, max_seq_len=64, mesh=mesh)
    compiled = compile_step(engine, "decode", prompt_len=8)
    return compiled.memory_analysis().argument_size_in_bytes


@pytest.mark.parametrize(
    "parallel", sweep(BYTES_STRATEGIES, lambda p: p == ParallelConfig(dp=2, tp=2)), ids=str
)
def test_int8_decode_reads_at_most_055_of_the_bf16_bytes(parallel):
    """The compiled decode step's arguments (weights, scales, cache, tokens per device):
    int8 kernels with float32 scales against bf16 kernels, under each strategy."""
    bf16 = _decode_argument_bytes(BIG, parallel)
    int8 = _decode_argument_bytes(ModelRun(BIG, ExecutionOptions(quantize="int8")), parallel)
    assert int8 <= 0.55 * bf16, (int8, bf16, int8 / bf16)


def test_scale_axes_follow_the_kernel():
    """Contracted dims become size-1 and unnamed; the others keep their names (a
    tp-split column's scales split with it); int4 keeps the grouped dim's name. A dense
    kernel's values and scales are stored out-major (contracted dims last); a MoE's
    stacked experts keep their order."""
    axes = ("embed", "heads", "head_dim")
    assert scale_layout((64, 8, 8), axes, 1, "int8") == ((8, 8, 1), ("heads", "head_dim", None))
    assert stored_order(3, 1) == (1, 2, 0) and stored_order(3, 2) == (2, 0, 1)
    o_axes = ("heads", "head_dim", "embed")
    assert scale_layout((8, 256, 64), o_axes, 2, "int4") == ((64, 8, 2), ("embed", *o_axes[:2]))
    # One group along the dim: nothing to split.
    assert scale_layout((128, 64), ("mlp", "embed"), 1, "int4") == ((64, 1), ("embed", None))
    experts = ("expert", "embed", "mlp")
    assert stored_order(3, 1, batch=1) is None
    assert scale_layout((4, 64, 32), experts, 1, "int8", batch=1) == (
        (4, 1, 32),
        ("expert", None, "mlp"),
    )
    with pytest.raises(ConfigError, match="group"):
        scale_layout((192, 64), ("mlp", "embed"), 1, "int4")


# One row, a decode batch, past ROWS_MAX.
@pytest.mark.parametrize("rows", sweep([1, 3, 80], lambda rows: rows != 3))
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize(
    ("shape", "contract"),
    [((256, 2, 4, 8), 1), ((4, 64, 256), 2)],  # a fused K/V kernel; an o kernel [N, H, D]
    ids=["kv", "o"],
)
def test_the_rows_form_computes_the_dot_form(shape, contract, mode, rows):
    """XLA:CPU's ``matmul="rows"`` (row reductions over the out-major kernel) and the dot
    over it both equal ``x`` times the dequantized float kernel (float64 reference), on
    kernels of several output dims (the scales reshaped as ``project`` does)."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal(shape, np.float32))
    scale_shape, _ = scale_layout(shape, (None,) * len(shape), contract, mode)
    order = stored_order(len(shape), contract)
    q, s = quantize_array(to_stored(w, order), scale_shape, mode)
    n_in = int(np.prod(shape[:contract]))
    q_OC = q.reshape(*q.shape[: len(shape) - contract], n_in)
    s_Og = s.reshape(*q_OC.shape[:-1], -1)
    x = jnp.asarray(rng.standard_normal((rows, 1, n_in), np.float32))
    deq_stored = q.astype(jnp.float32) * _scales_over_values(q, s, mode)
    deq = np.asarray(from_stored(deq_stored, order), np.float64)
    want = np.asarray(x, np.float64).reshape(rows, n_in) @ deq.reshape(n_in, -1)
    for form in ("rows", "dot"):
        got = qmatmul(x, q_OC, s_Og, jnp.float32, form)
        assert got.shape == (rows, 1, *q_OC.shape[:-1])
        np.testing.assert_allclose(np.asarray(got).reshape(rows, -1), want, rtol=1e-4, atol=1e-4)


@pytest.mark.sweep
def test_a_tied_float_table_runs_as_row_reductions_at_one_row():
    """XLA:CPU's ``"rows"`` form also reads a tied float table ``[V, D]`` (out-major) at one
    row: the decode step's LM head is a reduction, not a dot (one dot fewer in the compiled
    step), and its logits and tokens equal the ``"dot"`` form's."""
    config = dataclasses.replace(CONFIG, embed=EmbedConfig(tied=True))
    params = init_params(config, seed=0)
    engines = {
        form: jaxpar.InferenceEngine(
            config, params, max_batch=1, max_seq_len=32, options=ExecutionOptions(matmul=form)
        )
        for form in ("rows", "dot")
    }
    dots, logits, tokens = {}, {}, {}
    for form, eng in engines.items():
        prompt_BT, lengths_B = eng.pad_prompts([PROMPT])
        _, cache, first_B = eng.prefill(prompt_BT, lengths_B)
        dots[form] = eng.steps.lower_decode(eng.params, cache, first_B).compile().as_text()
        logits[form] = np.asarray(eng.steps.decode(eng.params, cache, first_B)[0])
        tokens[form] = eng.generate([PROMPT], 8).tokens
    assert dots["rows"].count(" dot(") == dots["dot"].count(" dot(") - 1
    np.testing.assert_allclose(logits["rows"], logits["dot"], atol=1e-4, rtol=0)
    assert tokens["rows"] == tokens["dot"]


def _scales_over_values(q: jax.Array, s: jax.Array, mode: str) -> jax.Array:
    """Scales broadcast over the stored values (int4: each group's scale over its group)."""
    if mode != "int4":
        return s
    return jnp.repeat(s, q.shape[-1] // s.shape[-1], axis=-1)


def test_the_same_integers_and_scales_on_every_mesh():
    """Quantizing weights that lie split over tp (as a sharded checkpoint load leaves
    them) gives bit-identical values and scales to quantizing them on one device."""
    engine = jaxpar.InferenceEngine(
        CONFIG, _float_params(), ParallelConfig(tp=2), max_batch=2, max_seq_len=32
    )
    sharded = quantize_params(CONFIG, engine.params, "int8")
    single = quantize_params(CONFIG, _float_params(), "int8")
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_engine_quantize_places_scales_split_as_their_kernels():
    """``quantize=`` on the engine: the placed kernels are int8, their scales float32 in
    the kernel's sharding (tp splits both by heads); quantizing twice is refused.
    (Sharded generation equal to one device's: the engine_from_hf and int4 tests.)"""
    tp2 = jaxpar.InferenceEngine(
        CONFIG, _float_params(), ParallelConfig(tp=2), max_batch=2, max_seq_len=32, quantize="int8"
    )
    attn = tp2.params["layers"][0]["attn"]
    kernel, scale = attn["q_kernel"].get_value(), attn["q_kernel_scale"].get_value()
    assert kernel.dtype == jnp.int8 and scale.dtype == jnp.float32
    assert scale.sharding.spec == kernel.sharding.spec  # (None, tp, None): heads split
    assert tp2.options.quantize == "int8" and tp2.model_config is CONFIG
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_params(tp2.model_config, tp2.params, "int8")
    # Quantized parameters say what they are: an engine over them runs int8 unasked, and
    # refuses options that ask for another mode.
    assert (
        jaxpar.InferenceEngine(CONFIG, tp2.params, max_batch=2, max_seq_len=32).options.quantize
        == "int8"
    )
    with pytest.raises(ConfigError, match=r"quantized \(int8\) but options.quantize='fp8'"):
        jaxpar.InferenceEngine(
            CONFIG,
            tp2.params,
            max_batch=2,
            max_seq_len=32,
            options=ExecutionOptions(quantize="fp8"),
        )


@pytest.mark.sweep
def test_int4_engine_runs_sharded_or_is_refused_clearly():
    """int4 under tp2 (o_kernel groups split with their heads) generates what int4 on one
    device does; on jax 0.10, whose int4 placement its own programs refuse, the engine
    says so before compiling anything."""
    kw = dict(max_batch=2, max_seq_len=32, quantize="int4")
    if jax.__version_info__ < (0, 11):
        with pytest.raises(ConfigError, match="jax >= 0.11"):
            jaxpar.InferenceEngine(CONFIG, _float_params(), **kw)
        return
    one = jaxpar.InferenceEngine(CONFIG, _float_params(), **kw)
    tp2 = jaxpar.InferenceEngine(CONFIG, _float_params(), ParallelConfig(tp=2), **kw)
    assert tp2.generate([PROMPT], 8).tokens == one.generate([PROMPT], 8).tokens


@pytest.mark.sweep
def test_engine_from_hf_quantizes_the_sharded_load():
    """A checkpoint read straight into dp2-tp2 shards, each kernel quantized where it lies
    as soon as it is read, generates what the one-device load quantized does."""
    path = Path(__file__).parent / "fixtures" / "hf" / "llama"
    kw = dict(max_batch=2, max_seq_len=32, quantize="int8")
    one = jaxpar.engine_from_hf(path, **kw)
    sharded = jaxpar.engine_from_hf(path, ParallelConfig(dp=2, tp=2), **kw)
    prompts = [[1, 2, 3], [4, 5]]
    assert sharded.generate(prompts, 8).tokens == one.generate(prompts, 8).tokens
    assert sharded.options.quantize == "int8" and sharded.model_config == one.model_config
    # Quantized tensor by tensor as read: the same as quantizing the whole float load.
    float_config, float_params = jaxpar.load_hf_checkpoint(path)
    want = quantize_params(float_config, float_params, "int8")
    assert sharded.model_config == float_config  # the checkpoint's config.json, unquantized
    for a, b in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
