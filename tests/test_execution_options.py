"""The config split (issue 23 item 6): ``ModelConfig`` is the checkpoint's architecture and
no engine rewrites it; ``ExecutionOptions`` is how one engine runs it, validated up front,
its ``"auto"`` values resolved once for the platform of the mesh's devices.

Engines are only built here (validation, layouts, placement): nothing compiles.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.engine import AbstractEngine, InferenceEngine, engine_from_hf
from jaxpar.engine._load import run_platform
from jaxpar.errors import ConfigError
from jaxpar.models import (
    AttentionConfig,
    ExecutionOptions,
    ModelConfig,
    ModelRun,
    abstract_model,
    config_from_hf,
    init_params,
    params_layer_loop,
    params_quantization,
    preset,
    with_layer_loop,
)
from jaxpar.spec import ParallelConfig, make_mesh

LLAMA = Path(__file__).parent / "fixtures" / "hf" / "llama"
BF16_GQA = dataclasses.replace(preset("tiny-gqa"), dtype="bfloat16", param_dtype="bfloat16")
# 255 tokens: tp=2 pads the vocabulary (the engine's run holds 256 rows).
ODD_MOE = dataclasses.replace(preset("tiny-moe"), n_layers=2, vocab_size=255)


def _mesh(parallel: ParallelConfig):
    return make_mesh(parallel, jax.devices()[: parallel.size])


@pytest.fixture(scope="module")
def odd_moe_params():
    return init_params(ODD_MOE, seed=0)


@pytest.fixture
def configs_made(monkeypatch) -> list[ModelConfig]:
    """Every ModelConfig constructed while the test runs (``dataclasses.replace`` too)."""
    made: list[ModelConfig] = []
    original = ModelConfig.__post_init__

    def record(self):
        original(self)
        made.append(self)

    monkeypatch.setattr(ModelConfig, "__post_init__", record)
    return made


@pytest.mark.parametrize(
    ("strategy", "options"),
    [
        ("tp=2", ExecutionOptions(moe_capacity_factor=1.25, quantize="int8")),
        ("pp=2,ep=2", ExecutionOptions(layer_loop="unrolled", dtype="bfloat16")),
        ("ep=2,tp=2", ExecutionOptions(layer_loop="scan", moe_dispatch="padded")),
    ],
    ids=str,
)
def test_engine_never_rewrites_its_model_config(configs_made, odd_moe_params, strategy, options):
    """Quantized, restacked for the pipeline, in another dtype, vocabulary padded for tp,
    "auto" resolved: the engine holds the config it was given and makes no other."""
    parallel = ParallelConfig.parse(strategy)
    engine = InferenceEngine(
        ODD_MOE,
        odd_moe_params,
        parallel,
        max_batch=4,
        max_seq_len=32,
        mesh=_mesh(parallel),
        options=options,
    )
    assert configs_made == []
    assert engine.model_config is ODD_MOE and engine.program.model_config is ODD_MOE
    assert engine.run.config is ODD_MOE
    assert engine.run.vocab_size == (256 if parallel.tp == 2 else 255)
    assert engine.admission.vocab_size == 255  # what callers see: the true vocabulary
    # The run is what the options say, resolved: no "auto" left.
    resolved = engine.options
    assert "auto" not in (resolved.prefill_attention, resolved.decode_attention)
    assert resolved.moe_dispatch == "padded"  # XLA:CPU compiles no ragged all-to-all
    assert resolved.layer_loop == ("scan" if parallel.pp > 1 else options.layer_loop)
    assert params_layer_loop(engine.params) == resolved.layer_loop
    assert params_quantization(engine.params) == options.quantize
    if options.dtype is not None:
        embed = engine.params["embed"]["token_table"].get_value()
        assert embed.dtype == options.dtype != ODD_MOE.param_dtype


def test_engine_from_hf_holds_what_config_json_says(configs_made):
    """Whatever the options (int8, a pipeline's stacked layers, bfloat16), the engine's
    model_config equals the config.json's own, and it is the only config built."""
    checkpoint = config_from_hf(json.loads((LLAMA / "config.json").read_text()), source="x")
    configs_made.clear()
    parallel = ParallelConfig(pp=2)
    options = ExecutionOptions(quantize="int8", dtype="bfloat16")
    engine = engine_from_hf(
        LLAMA, parallel, max_batch=2, max_seq_len=32, mesh=_mesh(parallel), options=options
    )
    assert engine.model_config == checkpoint
    assert configs_made and all(c == checkpoint for c in configs_made)  # read, never rewritten
    assert (engine.options.layer_loop, engine.options.quantize) == ("scan", "int8")
    assert engine.run.dtype == np.dtype("bfloat16") != checkpoint.dtype


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(prefill_attention="flash"), "prefill_attention='flash' .*legal: 'auto', 'xla'"),
        (dict(decode_attention="splash"), "decode_attention='splash' .*'pallas_gpu'"),
        (dict(paged_attention="nope"), "paged_attention='nope'"),
        (dict(layer_loop="while"), "layer_loop='while' .*'unrolled', 'scan'"),
        (dict(moe_dispatch="dense"), "moe_dispatch='dense' .*'padded', 'ragged'"),
        (dict(quantize="int2"), "quantize='int2'; legal: None, int8, fp8, int4"),
        (dict(moe_capacity_factor=0.0), "moe_capacity_factor must be None .*or > 0, got 0.0"),
        (dict(moe_capacity_factor=1.0, moe_dispatch="ragged"), "ragged' is dropless"),
        (dict(dtype="int8"), "dtype must be a floating dtype"),
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype='int4'; legal"),
        (dict(kv_cache_dtype="int8", decode_attention="cudnn"), "'cudnn' reads no KV cache scales"),
        (dict(kv_cache_dtype="fp8", paged_attention="pallas_tpu"), "'pallas_tpu' reads no KV"),
    ],
)
def test_options_refuse_what_no_engine_runs(options, match):
    with pytest.raises(ConfigError, match=match):
        ExecutionOptions(**options)


def test_options_the_model_cannot_take_are_refused_before_anything_is_built(monkeypatch):
    """MoE options on a dense model, and a named fused kernel on a soft-capped one, are
    refused by the engine before the strategy is laid out or a parameter placed."""
    dense = preset("tiny-dense")

    def never(*args, **kwargs):
        raise AssertionError("built before the options were checked")

    monkeypatch.setattr(AbstractEngine, "build", never)
    for options in (
        ExecutionOptions(moe_capacity_factor=1.25),
        ExecutionOptions(moe_dispatch="padded"),
    ):
        with pytest.raises(ConfigError, match="need a mixture of experts; arch 'llama' is dense"):
            InferenceEngine(dense, {}, max_batch=2, max_seq_len=16, options=options)
    capped = dataclasses.replace(dense, attention=AttentionConfig(softcap=30.0))
    with pytest.raises(ConfigError, match="decode_attention='cudnn' cannot soft-cap"):
        InferenceEngine(
            capped,
            {},
            max_batch=2,
            max_seq_len=16,
            options=ExecutionOptions(decode_attention="cudnn"),
        )
    sinks = dataclasses.replace(preset("tiny-moe"), attention=AttentionConfig(sinks=True))
    with pytest.raises(
        ConfigError, match="paged_attention='pallas_gpu' cannot add attention sinks"
    ):
        InferenceEngine(
            sinks,
            {},
            max_batch=2,
            max_seq_len=16,
            options=ExecutionOptions(paged_attention="pallas_gpu"),
        )
    # The engine's older keyword and the options must not disagree.
    with pytest.raises(ConfigError, match="quantize='int4' contradicts options.quantize='int8'"):
        InferenceEngine(
            dense,
            {},
            max_batch=2,
            max_seq_len=16,
            options=ExecutionOptions(quantize="int8"),
            quantize="int4",
        )


@pytest.mark.parametrize("pretend", ["tpu", "gpu"])
def test_auto_comes_from_the_mesh_devices_not_the_default_backend(monkeypatch, pretend):
    """A bf16 model on a CPU mesh gets CPU's choices (XLA everywhere, padded MoE exchange,
    float32 for a bf16 checkpoint) while jax.default_backend() claims an accelerator;
    lowering for an accelerator (``platform=``) gets that accelerator's kernels."""
    monkeypatch.setattr(jax, "default_backend", lambda: pretend)
    parallel = ParallelConfig(tp=2)
    engine = AbstractEngine.build(
        BF16_GQA, parallel, max_batch=4, max_seq_len=32, mesh=_mesh(parallel)
    )
    opts = engine.options
    assert (opts.prefill_attention, opts.decode_attention, opts.paged_attention) == ("xla",) * 3
    assert run_platform(engine.mesh) == run_platform() == "cpu"
    assert jaxpar.engine.compute_dtype({"torch_dtype": "bfloat16"}) == "float32"
    moe = AbstractEngine.build(
        dataclasses.replace(ODD_MOE, vocab_size=256),
        ParallelConfig(ep=2),
        max_batch=4,
        max_seq_len=32,
        mesh=_mesh(ParallelConfig(ep=2)),
    )
    assert moe.options.moe_dispatch == "padded"
    # What the same options become for the accelerators themselves (the choice is real).
    cuda = AbstractEngine.build(
        BF16_GQA, parallel, max_batch=4, max_seq_len=32, mesh=_mesh(parallel), platform="cuda"
    )
    assert (cuda.options.prefill_attention, cuda.options.decode_attention) == ("cudnn",) * 2
    assert cuda.options.paged_attention == "pallas_gpu"
    # Quantized matmuls: row reductions on XLA:CPU, the backend's dot on accelerators.
    assert moe.options.matmul == "rows" and cuda.options.matmul == "dot"
    assert ExecutionOptions(matmul="dot").resolve(BF16_GQA, "cpu").matmul == "dot"
    tpu = ExecutionOptions().resolve(BF16_GQA, "tpu")
    assert (tpu.prefill_attention, tpu.decode_attention, tpu.paged_attention) == (
        "pallas_tpu",
        "xla",
        "pallas_tpu",
    )
    assert tpu.matmul == "dot"
    # A named decode kernel carries to the paged cache; float32 stays on XLA.
    named = ExecutionOptions(decode_attention="pallas_gpu").resolve(BF16_GQA, "gpu")
    assert named.paged_attention == "pallas_gpu"
    assert ExecutionOptions().resolve(preset("tiny-gqa"), "gpu").prefill_attention == "xla"


def test_a_run_is_static_hashable_data_and_reads_through():
    """A ModelRun lives in NNX graphdefs: frozen, hashable, equal by value, copyable and
    picklable; architecture fields and options are read through it by name."""
    run = ModelRun(BF16_GQA, ExecutionOptions(layer_loop="scan", dtype="float32"))
    same = ModelRun(BF16_GQA, ExecutionOptions(layer_loop="scan", dtype="float32"))
    assert run == same and hash(run) == hash(same)
    assert pickle.loads(pickle.dumps(run)) == run == copy.deepcopy(run)
    assert (run.n_heads, run.layer_loop, run.dtype, run.param_dtype) == (
        8,
        "scan",
        *["float32"] * 2,
    )
    assert run.config.dtype == np.dtype("bfloat16")  # the checkpoint's, untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.options = ExecutionOptions()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        run.no_such_field  # noqa: B018
    graphdef, _ = nnx.split(abstract_model(run))
    assert hash(graphdef) == hash(nnx.split(abstract_model(same))[0])
    assert graphdef != nnx.split(abstract_model(BF16_GQA))[0]  # the options are in it


def test_parameters_say_their_form_and_the_engine_takes_any():
    """Stacked or per-layer, float or quantized: read off the tree, converted once."""
    config = preset("tiny-gqa")
    params = init_params(config, seed=3)
    stacked = with_layer_loop(config, params, "scan")
    assert (params_layer_loop(params), params_layer_loop(stacked)) == ("unrolled", "scan")
    assert params_quantization(params) is None
    one = ParallelConfig()
    engine = InferenceEngine(config, stacked, one, max_batch=2, max_seq_len=16, mesh=_mesh(one))
    assert engine.options.layer_loop == "unrolled"  # the options' form, not the params'
    for a, b in zip(jax.tree.leaves(engine.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_bfloat16_checkpoint_runs_in_float32_when_the_options_say():
    """The run's dtype converts the parameters (bfloat16 is floating to jnp, not to numpy);
    the config keeps the checkpoint's dtype."""
    params = init_params(BF16_GQA, seed=0)
    one = ParallelConfig()
    engine = InferenceEngine(
        BF16_GQA,
        params,
        one,
        max_batch=2,
        max_seq_len=16,
        mesh=_mesh(one),
        options=ExecutionOptions(dtype="float32"),
    )
    assert {x.dtype for x in jax.tree.leaves(engine.params)} == {np.dtype("float32")}
    assert engine.run.dtype == np.dtype("float32") and engine.model_config is BF16_GQA
    assert engine.model_config.dtype == np.dtype("bfloat16")
