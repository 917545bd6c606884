"""GPT-OSS sharded and served equal transformers; its MXFP4 experts load as the floats they encode.

The fixture (``scripts/make_hf_fixtures.py``, ``gpt_oss``) has 4 layers, a 4-token window on
layers 0 and 2 (shorter than the 7- and 11-token prompts and the 16 greedy tokens), attention
sinks, YaRN, 8 experts top-2 with router and expert biases and a SwiGLU clamp that binds.
One-device equality with transformers is ``test_hf_fixtures.py``; here every strategy the
family allows gives the same prefill logits (1e-4) and the same 16 greedy tokens (through the
serving core: paged decode with sinks on each head shard), the continuous batcher's chunked
prefill and prefix hits give every request its offline tokens, and the validator refuses
what the tables forbid.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors.numpy import load_file, save_file

from jaxpar import ParallelConfig
from jaxpar.cli import main
from jaxpar.engine import ContinuousBatcher, InferenceEngine
from jaxpar.engine._kv_budget import KVBudget
from jaxpar.errors import CheckpointError, ConfigError, IllegalStrategyError
from jaxpar.models import (
    ExecutionOptions,
    ModelRun,
    load_hf_checkpoint,
    params_quantization,
)
from jaxpar.models import _moe_route as route
from jaxpar.models._hf_config import config_from_hf
from jaxpar.models._hf_mxfp4 import FP4_VALUES, Mxfp4Tensors, dequantize
from jaxpar.spec import validate
from tests._engine_util import check_matches_hf
from tests._tiers import sweep

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "gpt_oss"
PAGE = 4


def _hf_config() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


@pytest.mark.parametrize(
    "parallel",
    sweep(
        [
            # 2 kv heads < tp=4: one per device (each held twice), each shard its heads' sinks.
            ParallelConfig(dp=2, tp=4),
            # Queries split over sp in prefill (a shard's window reaches into the other's
            # keys); experts over ep, their intermediate over tp (the down bias counts once).
            ParallelConfig(sp=2, ep=2, tp=2),
        ],
        lambda parallel: parallel == ParallelConfig(sp=2, ep=2, tp=2),
    ),
    ids=str,
)
def test_sharded_gpt_oss_matches_transformers(parallel):
    check_matches_hf(FIXTURE, parallel)


@pytest.mark.sweep
def test_served_over_pages_equals_whole_sequence_prefill():
    """Chunked prefill and prefix hits (prefill with context, sinks in its softmax) and paged
    decode under the continuous batcher, stacked layers (windows as traced values): each
    request's greedy tokens are the argmaxes of one whole-sequence prefill of its prompt and
    tokens (no cache at all: the path checked against transformers)."""
    config, params = load_hf_checkpoint(FIXTURE, layer_loop="scan")
    engine = InferenceEngine(
        config,
        params,
        ParallelConfig(),
        max_batch=4,
        max_seq_len=40,
        options=ExecutionOptions(layer_loop="scan"),
    )
    assert engine.run.layer_loop == "scan"
    budget = KVBudget(page_size=PAGE, tokens=160)
    batcher = ContinuousBatcher(engine, prefill_batch=2, kv_budget=budget, max_prefill_tokens=8)
    rng = np.random.default_rng(5)
    system = rng.integers(3, config.vocab_size, 9).tolist()  # two full pages, cached
    prompts = [system + rng.integers(3, config.vocab_size, n).tolist() for n in (2, 13, 6)]
    with batcher:
        got = [batcher.submit(prompts[0], max_tokens=10).result(timeout=120)]
        streams = [
            batcher.submit(p, max_tokens=n) for p, n in zip(prompts[1:], (6, 8), strict=True)
        ]
        got += [s.result(timeout=120) for s in streams]
    assert batcher.stats.prompt_tokens_cached > 0  # later prompts continued cached pages
    assert batcher.stats.prefill_chunks >= 1  # the 22-token prompt came in chunks
    padded, lengths = engine.pad_prompts([p + t[:-1] for p, t in zip(prompts, got, strict=True)])
    logits = np.asarray(engine.prefill_logits(padded, lengths))
    for row, (prompt, tokens) in enumerate(zip(prompts, got, strict=True)):
        window = logits[row, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        assert window.argmax(-1).tolist() == tokens, row


def test_config_mapping():
    c = config_from_hf(_hf_config(), source="gpt_oss")
    assert c.arch == "gpt_oss" and c.is_moe and (c.n_experts, c.moe.top_k) == (8, 2)
    assert c.window.layers == (True, False, True, False) and c.window.size == 4
    assert c.attention.sinks and c.moe.router_bias and c.ffn.bias and c.moe.norm_topk_prob
    assert (c.moe.swiglu_limit, c.moe.swiglu_alpha) == (1.0, 1.702)
    assert c.attention.qkv_bias and c.attention.out_bias and c.head_dim == 12 and not c.embed.tied
    assert c.norms.scale_f32 and not c.norms.offset
    assert type(c.rope.scaling).__name__ == "YarnRopeScaling"
    # Older files: no layer_types (every other layer slides), no swiglu_alpha (1.702).
    old = {k: v for k, v in _hf_config().items() if k not in ("layer_types", "swiglu_alpha")}
    c_old = config_from_hf({**old, "swiglu_limit": 7.0}, source="old")
    assert c_old.window.layers == (True, False, True, False)
    assert (c_old.moe.swiglu_limit, c_old.moe.swiglu_alpha) == (7.0, 1.702)


def test_bf16_norms_scale_in_float32_as_transformers():
    """GPT-OSS's RMS norm multiplies its weight into the float32 normalised vector and casts
    once (``(w * x_f32).to(bf16)``); Llama's casts first, then scales in bfloat16. The two
    round differently in bfloat16 (f32 fixtures cannot tell), so the mapping must say which."""
    from jaxpar.models._layers import RMSNorm

    bf16 = dataclasses.replace(
        config_from_hf(_hf_config(), source="gpt_oss"), dtype="bfloat16", param_dtype="bfloat16"
    )
    norm = RMSNorm(bf16, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(1.0, 0.5, bf16.d_model), jnp.bfloat16)
    norm.scale.set_value(w)
    x = jnp.asarray(rng.normal(size=(64, bf16.d_model)), jnp.bfloat16)
    x32 = np.asarray(x, np.float32)
    n32 = x32 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + bf16.norms.eps)
    f32_scale = (np.asarray(w, np.float32) * n32).astype(jnp.bfloat16)
    cast_first = n32.astype(jnp.bfloat16) * np.asarray(w)
    got = np.asarray(norm(x))
    np.testing.assert_array_equal(got, f32_scale)
    assert np.any(got != cast_first)  # the other order would have been caught


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq'"),
    ],
    ids=["layer_types", "window", "rope", "awq"],
)
def test_unsupported_options_are_refused_naming_the_field(change, match):
    with pytest.raises(CheckpointError, match=match):
        config_from_hf({**_hf_config(), **change}, source="gpt_oss")


def test_mxfp4_is_gpt_oss_only():
    llama = json.loads((FIXTURE.parent / "llama" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="mxfp4' is supported for GptOssForCausalLM only"):
        config_from_hf({**llama, "quantization_config": {"quant_method": "mxfp4"}}, source="x")


def test_sinks_refuse_named_kernels():
    """No fused kernel adds a sink logit: naming one for a model with sinks is refused."""
    base = config_from_hf(_hf_config(), source="gpt_oss")
    named = (
        ("prefill_attention", "pallas_tpu"),
        ("decode_attention", "cudnn"),
        ("paged_attention", "pallas_gpu"),
    )
    for name, kernel in named:
        with pytest.raises(ConfigError, match=f"{name}='{kernel}' cannot add attention sinks"):
            ModelRun(base, ExecutionOptions(**{name: kernel}))


def test_validator_refuses_what_the_tables_forbid():
    config = config_from_hf(_hf_config(), source="gpt_oss")
    # tp must divide the 4 query heads; ep must divide the 8 experts.
    with pytest.raises(IllegalStrategyError, match="heads=4 does not divide over tp=8") as err:
        validate(config, ParallelConfig(tp=8), n_devices=8, batch=8, max_seq_len=32)
    assert 'rule "tp-decomposable" (sharding_specs/rules.toml' in str(err.value)
    with pytest.raises(IllegalStrategyError, match="8 experts do not divide over ep=16") as err:
        validate(config, ParallelConfig(ep=16), n_devices=16, batch=16, max_seq_len=32)
    assert 'rule "ep-divides-experts"' in str(err.value)


# --- MXFP4 ----------------------------------------------------------------------------------


def _e2m1(code: int) -> float:
    """The E2M1 value of a 4-bit code, from the format's definition (sign, 2-bit exponent
    with bias 1, 1-bit mantissa; exponent 0 is subnormal)."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


def _pack(codes_ERA: np.ndarray) -> np.ndarray:
    """4-bit codes [E, R, A] -> MXFP4 blocks [E, R, A / 32, 16], low nibble first."""
    e, r, a = codes_ERA.shape
    byte = codes_ERA[..., 0::2] | (codes_ERA[..., 1::2] << 4)
    return byte.astype(np.uint8).reshape(e, r, a // 32, 16)


def test_fp4_table_and_dequantize_known_values():
    assert [float(v) for v in FP4_VALUES] == [_e2m1(c) for c in range(16)]
    codes = np.arange(32, dtype=np.uint8) % 16  # every code, twice
    blocks = _pack(codes.reshape(1, 1, 32))[0, 0]
    scales = np.array([127 + 3], np.uint8)  # 2 ** 3
    np.testing.assert_array_equal(dequantize(blocks, scales), [8 * _e2m1(c) for c in codes])


def _mxfp4_twin(dst: Path, seed: int) -> tuple[Path, Path]:
    """The fixture with its expert projections (``gate_up_proj`` contracts D = 32,
    ``down_proj`` F = 32: one block each) replaced by random MXFP4 values: one copy stored
    as blocks and scales (with GPT-OSS's quantization_config), one in float32."""
    rng = np.random.default_rng(seed)
    lut = np.array([_e2m1(c) for c in range(16)], np.float32)
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    packed, dense = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, a, r = tensors[name].shape  # W [E, A, R], stored transposed in blocks
        codes = rng.integers(0, 16, (e, r, a), dtype=np.uint8)
        scales = rng.integers(121, 125, (e, r, a // 32), dtype=np.uint8)  # 2^-6 .. 2^-3
        w_ERA = lut[codes] * np.exp2(np.repeat(scales, 32, axis=-1).astype(np.float32) - 127)
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = _pack(codes), scales
        dense[name] = np.ascontiguousarray(w_ERA.transpose(0, 2, 1))
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    dirs = dst / "mxfp4", dst / "float"
    for d, weights, extra in zip(
        dirs, (packed, dense), ({"quantization_config": qc}, {}), strict=True
    ):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**_hf_config(), **extra}))
        save_file(weights, str(d / "model.safetensors"))
    return dirs


def _flat(params) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


def test_mxfp4_experts_load_as_the_floats_they_encode(tmp_path):
    """Packed known values read back exactly where the float checkpoint puts them (gate and
    up columns de-interleaved, the contracted dim transposed), on one device and as each
    device's slice with experts and their intermediate split (4 x 2 devices: down_proj's
    contracted F read 8 of a block's 32 at a time). transformers' own MXFP4 loading is
    ``gpt_oss_mxfp4`` in ``test_hf_fixtures.py``."""
    mx_dir, float_dir = _mxfp4_twin(tmp_path, seed=3)
    config_mx, params_mx = load_hf_checkpoint(mx_dir)
    config_f, params_f = load_hf_checkpoint(float_dir)
    assert config_mx == config_f
    assert params_quantization(params_mx) is None  # dequantized at load: float experts
    want, got = _flat(params_f), _flat(params_mx)
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    rules = {"mlp": "x", "heads": "x", "experts": "y"}

    def sharding(path, axes):
        return NamedSharding(mesh, PartitionSpec(*(rules.get(a) for a in axes)))

    _, sharded = load_hf_checkpoint(mx_dir, shardings=sharding)
    for key, value in _flat(sharded).items():
        np.testing.assert_array_equal(value, want[key], err_msg=key)


def test_mxfp4_slices_decode_only_their_blocks():
    """Slices of the encoded ``W [E, A, R]`` equal the same slices of the whole decoded
    tensor, across block boundaries of the contracted dim, reading only covering blocks."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 5, 3, 16), dtype=np.uint8)
    scales = rng.integers(120, 130, (2, 5, 3), dtype=np.uint8)
    stored = {"w_blocks": blocks, "w_scales": scales}
    reads = []

    def read(name, slices):
        reads.append((name, slices))
        return stored[name][slices]

    mx = Mxfp4Tensors({n: a.shape for n, a in stored.items()}, dict.fromkeys(stored, "U8"), read)
    assert mx.shapes == {"w": (2, 96, 5)} and mx.stored == set(stored)
    whole = dequantize(blocks, scales).transpose(0, 2, 1)
    for index in [
        (slice(0, 2), slice(0, 96), slice(0, 5)),
        (slice(1, 2), slice(20, 70), slice(2, 4)),
    ]:
        reads.clear()
        np.testing.assert_array_equal(mx.read("w", index), whole[index])
    assert reads[0][1][2] == slice(0, 3)  # A 20..70 covers blocks 0, 1 and 2
    reads.clear()
    mx.read("w", (slice(0, 1), slice(32, 64), slice(0, 5)))
    assert reads[0][1][2] == slice(1, 2)  # exactly block 1


def test_mxfp4_refuses_broken_pairs(tmp_path):
    mx_dir, _ = _mxfp4_twin(tmp_path, seed=4)
    tensors = load_file(str(mx_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.gate_up_proj_scales"]
    save_file(tensors, str(mx_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="gate_up_proj_blocks' has no .*gate_up_proj_scales"):
        load_hf_checkpoint(mx_dir)


@pytest.mark.sweep
def test_explain_names_sinks_and_clamped_experts(capsys):
    """``jaxpar explain`` compiles GPT-OSS under ep·tp: no collective above the minimum but
    the padded MoE exchange's named buffer (the sinks and biases add none), and the
    execution says what GPT-OSS adds."""
    argv = ["explain", "--hf", str(FIXTURE), "--ep", "4", "--tp", "2", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    for phase in ("prefill", "decode"):
        report = data["phases"][phase]["collectives"]
        assert set(report["exceptions"]) <= {"moe-dispatch-buffer"}, report["exceptions"]
        assert report["ratio_explained"] <= 1.05
        text = " | ".join(s["text"] for s in data["phases"][phase]["execution"])
        assert "sink logit per head" in text and "4-token sliding window on 2 of the layers" in text
        assert "router top-2 (biased logits)" in text
        assert "clamped SwiGLU (limit 1, alpha 1.702) with expert biases" in text


@pytest.mark.sweep
def test_plan_on_hub_shapes(capsys):
    """gpt-oss-20b's shapes (config.json only, its MXFP4 experts counted as bf16) planned
    on 8 H100s."""
    hub = str(FIXTURE.parent.parent / "configs" / "gpt-oss-20b")
    args = ["plan", "--hf", hub, "--devices", "8", "--hardware", "h100", "--json"]
    assert (
        main(
            [*args, "--dtype", "bfloat16", "--batch", "8", "--prompt-len", "64", "--gen-len", "16"]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["plans"] and "--hf" in plan["command"]


def test_served_prefill_rows_divide_over_ep():
    """A MoE's prefill batch divides over dp and ep (ep carries batch in every module), so
    the batcher's smallest prefill bucket is dp*ep rows, not dp: ``jaxpar serve --ep 2``
    compiled a 1-row prefill at warm-up, which ep cannot split (IndivisibleError)."""
    config, params = load_hf_checkpoint(FIXTURE)
    engine = InferenceEngine(
        config, params, ParallelConfig(ep=2, tp=2), max_batch=8, max_seq_len=16
    )
    batcher = ContinuousBatcher(engine, kv_budget=KVBudget(page_size=PAGE, tokens=64))
    assert batcher.row_buckets() == [2, 8] and batcher.prefill_batch == 8
    with pytest.raises(ConfigError, match=r"prefill_batch=3 .* batch shards \(2"):
        ContinuousBatcher(engine, prefill_batch=3, kv_budget=KVBudget(page_size=PAGE, tokens=64))


def test_grouped_and_masked_experts_agree_with_biases_and_clamp():
    """The accelerator path (``ragged_dot``) and XLA:CPU's masked matmuls compute GPT-OSS's
    biased, clamped experts alike, and equal a per-row reference; rows past the groups
    (padding) give zeros in both."""
    rng = np.random.default_rng(0)
    e, d, f, rows = 3, 8, 6, 12
    sizes = np.array([4, 0, 5], np.int32)  # 9 rows in groups, 3 of padding
    x = rng.standard_normal((rows, d), np.float32)
    gate, up = (rng.standard_normal((e, d, f), np.float32) for _ in range(2))
    down = rng.standard_normal((e, f, d), np.float32)
    expert = route.expert_of_rows(jnp.asarray(sizes), rows)
    assert np.asarray(expert).tolist() == [0] * 4 + [2] * 5 + [3] * 3
    gate_b, up_b = (rng.standard_normal((e, f), np.float32) for _ in range(2))
    pad = np.zeros((1, f), np.float32)
    gate_rows, up_rows = (np.concatenate([b, pad])[np.asarray(expert)] for b in (gate_b, up_b))
    glu = functools.partial(route.clamped_glu, limit=0.7, alpha=1.702)
    args = (jnp.asarray(x), jnp.asarray(sizes), gate, up, down, gate_rows, up_rows)
    grouped = np.asarray(route.grouped_swiglu(*args, glu=glu))
    masked = np.asarray(route.masked_swiglu(*args, glu=glu))
    want = np.zeros((rows, d), np.float32)
    for r, j in enumerate(np.asarray(expert)):
        if j == e:
            continue
        g = np.minimum(x[r] @ gate[j] + gate_b[j], 0.7)
        u = np.clip(x[r] @ up[j] + up_b[j], -0.7, 0.7)
        want[r] = ((u + 1) * g / (1 + np.exp(-1.702 * g))) @ down[j]
    np.testing.assert_allclose(grouped, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(masked, want, atol=1e-5, rtol=0)
