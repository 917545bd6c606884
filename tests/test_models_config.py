"""ModelConfig invariants, presets, RoPE scaling, and logical-axis metadata on parameters."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.models import (
    PRESETS,
    ExecutionOptions,
    Llama3RopeScaling,
    ModelRun,
    YarnRopeScaling,
    abstract_model,
    apply_rope,
    init_model,
    param_logical_axes,
    preset,
    rope_attention_factor,
    rope_inv_freq,
)
from jaxpar.spec._dims import ModelDims
from jaxpar.spec._enums import LOGICAL_AXES

TINY = ["tiny-dense", "tiny-gqa", "tiny-moe", "tiny-gpt2"]
LEGAL_NAMES = set(LOGICAL_AXES) | {"expert_batch", None}
MESH_NAMES = {"dp", "pp", "sp", "ep", "tp"}


def _leaves(state: nnx.State) -> list[tuple[tuple, nnx.Variable]]:
    return list(nnx.to_flat_state(state))


def _check_axes(state: nnx.State) -> None:
    for path, var in _leaves(state):
        axes = var.get_metadata().get("out_sharding")
        name = ".".join(map(str, path))
        assert axes is not None, f"{name} has no logical axis metadata"
        assert len(axes) == len(var.get_value().shape), f"{name}: {axes} vs rank"
        assert set(axes) <= LEGAL_NAMES, f"{name}: {axes}"
        assert not set(axes) & MESH_NAMES, f"{name} names a mesh axis: {axes}"
        if path[0] == "layers" and isinstance(path[1], int):  # layers/<i>/...: one layer
            assert "layers" not in axes, f"per-layer {name} has no 'layers' axis: {axes}"
        elif path[0] == "layers":  # stacked [L, ...] (layer_loop="scan")
            assert axes[0] == "layers", f"stacked {name} must lead with 'layers': {axes}"


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
@pytest.mark.parametrize("name", TINY)
def test_every_param_has_logical_axes(name: str, layer_loop: str) -> None:
    options = ExecutionOptions(layer_loop=layer_loop)
    _check_axes(nnx.state(init_model(preset(name), options=options)))


def test_llama_1b_axes_and_size_abstractly() -> None:
    model = abstract_model(preset("llama-1b"))
    state = nnx.state(model)
    _check_axes(state)
    n_params = sum(math.prod(v.get_value().shape) for _, v in _leaves(state))
    assert 1.2e9 < n_params < 1.3e9, n_params
    assert all(v.get_value().dtype == jnp.bfloat16 for _, v in _leaves(state))


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
def test_expected_axes_of_key_params(layer_loop: str) -> None:
    config = ModelRun(preset("tiny-moe"), ExecutionOptions(layer_loop=layer_loop))
    specs = nnx.to_flat_state(param_logical_axes(config))
    got = {path: tuple(var.get_value()) for path, var in specs}
    # Per layer: layers/<i>/...; stacked: layers/... with a leading "layers" axis.
    at, lead = (("layers", 0), ()) if layer_loop == "unrolled" else (("layers",), ("layers",))
    assert got[(*at, "attn", "q_kernel")] == (*lead, "embed", "heads", "head_dim")
    assert got[(*at, "attn", "kv_kernel")] == (*lead, "embed", None, "kv_heads", "head_dim")
    assert got[(*at, "attn", "o_kernel")] == (*lead, "heads", "head_dim", "embed")
    assert got[(*at, "ffn", "router", "kernel")] == (*lead, "embed", None)
    assert got[(*at, "ffn", "experts", "down_kernel")] == (*lead, "experts", "mlp", "embed")
    assert got[("embed", "token_table")] == ("vocab", "embed")
    assert got[("lm_head", "kernel")] == ("embed", "vocab")
    assert got[("final_norm", "scale")] == ("embed",)


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
def test_qk_norm_scales_are_per_head_dim(layer_loop: str) -> None:
    """Qwen3's q/k norms: one ``[H]`` scale each, axis head_dim (split by no strategy),
    and N x H need not equal D."""
    qwen3 = dataclasses.replace(preset("tiny-gqa"), arch="qwen3", qk_norm=True, head_dim=16)
    config = ModelRun(qwen3, ExecutionOptions(layer_loop=layer_loop))
    specs = nnx.to_flat_state(param_logical_axes(config))
    got = {path: tuple(var.get_value()) for path, var in specs}
    at, lead = (("layers", 0), ()) if layer_loop == "unrolled" else (("layers",), ("layers",))
    for x in "qk":
        assert got[(*at, "attn", f"{x}_norm", "scale")] == (*lead, "head_dim")
    shapes = {p: v.get_value().shape for p, v in nnx.to_flat_state(nnx.state(init_model(config)))}
    lead_shape = () if layer_loop == "unrolled" else (config.n_layers,)
    assert shapes[(*at, "attn", "q_norm", "scale")] == (*lead_shape, 16)
    assert shapes[(*at, "attn", "o_kernel")] == (*lead_shape, 8, 16, 64)  # N x H = 128 != D


def test_presets_satisfy_model_dims_and_divide() -> None:
    for name in TINY:
        c = preset(name)
        assert isinstance(c, ModelDims)
        sizes = [c.n_heads, c.d_ff, c.vocab_size] + ([c.n_experts] if c.is_moe else [])
        sizes += [] if name == "tiny-gqa" else [c.n_kv_heads]
        for size in sizes:
            assert size % 8 == 0, (name, size)
    assert preset("tiny-gqa").n_kv_heads == 2
    assert preset("tiny-moe").is_moe and not preset("tiny-dense").is_moe


def test_unknown_preset_lists_names() -> None:
    with pytest.raises(ConfigError, match="tiny-dense.*llama-1b"):
        preset("nope")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(arch="bert"), "unknown arch"),
        (dict(n_kv_heads=3), "multiple of n_kv_heads"),
        (dict(norm="batch"), "norm="),
        (dict(head_dim=7), "even head_dim"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(top_k=2), "need n_experts"),
        (dict(norm_topk_prob=False), "norm_topk_prob.*need n_experts"),
        (dict(qk_norm=True, norm="layer"), "qk_norm .*norm='rms'"),
        (
            dict(arch="qwen3_moe"),
            "'mixtral' and 'qwen3_moe' and 'deepseek_v3' and 'gpt_oss' are mixtures of experts",
        ),
        (dict(dtype="int32"), "floating"),
        (dict(d_model=0), "d_model must be positive"),
        (dict(sliding_window=4, sliding_layers=(True, False)), "2 flags for n_layers=4"),
        (dict(sliding_layers=(True, False, True, False)), "sliding_window is None"),
        (dict(rope_local_theta=100.0), "rope_local_theta .*no sliding_window"),
        (dict(rope_linear_factor=0.0), "rope_linear_factor=0.0"),
        (dict(attn_softcap=-1.0), "attn_softcap must be None or positive"),
        (dict(norm_offset=True, norm="layer"), "norm_offset and sandwich_norm .*norm='rms'"),
        (dict(swiglu_limit=7.0), "set both or neither"),
        (dict(swiglu_limit=7.0, swiglu_alpha=1.702), "shape the experts: need n_experts"),
        (dict(router_bias=True), "router_bias needs n_experts"),
    ],
)
def test_config_invariants(change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(preset("tiny-dense"), **change)


def test_moe_invariants() -> None:
    moe = preset("tiny-moe")
    with pytest.raises(ConfigError, match="top_k"):
        dataclasses.replace(moe, top_k=9)

    # Rows per expert peer (a run's: the capacity factor is an execution option):
    # ceil(cf * tokens * top_k / peers), capped at the dropless bound tokens * min(top_k,
    # experts per peer).
    def run(cf):
        return ModelRun(moe, ExecutionOptions(moe_capacity_factor=cf))

    assert run(1.0).expert_capacity(16, peers=4) == 16 * 2 // 4
    assert run(None).expert_capacity(16, peers=4) == 16 * min(2, 8 // 4)
    assert run(None).expert_capacity(16, peers=8) == 16 * min(2, 8 // 8)
    assert run(100.0).expert_capacity(16, peers=4) == run(None).expert_capacity(16, peers=4)


def test_check_max_seq_len() -> None:
    preset("tiny-dense").check_max_seq_len(10_000)  # RoPE: no table to outrun
    preset("tiny-gpt2").check_max_seq_len(128)
    with pytest.raises(ConfigError, match="exceeds the 128 learned positions"):
        preset("tiny-gpt2").check_max_seq_len(129)


def test_rope_scaling_from_mapping_and_hashable() -> None:
    raw = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    c = dataclasses.replace(preset("tiny-dense"), rope_scaling=raw)
    assert isinstance(c.rope.scaling, Llama3RopeScaling)
    hash(c)
    with pytest.raises(ConfigError, match="lacks key"):
        dataclasses.replace(preset("tiny-dense"), rope_scaling={"rope_type": "llama3"})
    with pytest.raises(ConfigError, match="'dynamic' is not supported; legal: 'llama3', 'yarn'"):
        dataclasses.replace(preset("tiny-dense"), rope_scaling={"rope_type": "dynamic"})


def _llama3_reference(head_dim: int, theta: float, s: Llama3RopeScaling) -> np.ndarray:
    """The Llama 3 reference formula, one frequency at a time in float64."""
    out = []
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wl:
            out.append(freq)
        elif wavelen > low_wl:
            out.append(freq / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * freq / s.factor + smooth * freq)
    return np.array(out)


def test_llama3_rope_scaling_matches_reference() -> None:
    c = preset("llama-1b")
    got = rope_inv_freq(c.head_dim, c.rope.theta, c.rope.scaling)
    want = _llama3_reference(c.head_dim, c.rope.theta, c.rope.scaling)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    plain = rope_inv_freq(c.head_dim, c.rope.theta)
    # All three regimes occur: kept, divided by factor, and interpolated.
    ratio = plain / got
    assert np.any(np.isclose(ratio, 1.0)) and np.any(np.isclose(ratio, 32.0))
    assert np.any((ratio > 1.01) & (ratio < 31.9))


def _yarn_reference(head_dim: int, theta: float, s: YarnRopeScaling) -> np.ndarray:
    """YaRN's frequencies from the paper (arXiv 2309.00071, section 3.2), one plane at a
    time in float64: r(d) = L / wavelength(d) turns over the original context L; the
    plane keeps its frequency when r > beta_fast, takes freq / factor when r < beta_slow,
    and blends linearly over the plane index in between."""

    def index_turning(turns: float) -> float:
        return (
            head_dim
            * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = index_turning(s.beta_fast), index_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    out = []
    for d in range(head_dim // 2):
        freq = theta ** (-2 * d / head_dim)
        keep = 1 - min(max((d - low) / (high - low), 0.0), 1.0)
        out.append(freq * keep + freq / s.factor * (1 - keep))
    return np.array(out)


@pytest.mark.parametrize(
    "raw",
    [
        # GPT-OSS's: no truncation of the ramp.
        dict(
            rope_type="yarn",
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
        # DeepSeek-V3's: mscale / mscale_all_dim, the truncated ramp.
        dict(
            rope_type="yarn",
            factor=40.0,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=4096,
        ),
    ],
)
def test_yarn_rope_scaling_matches_the_paper(raw: dict) -> None:
    c = dataclasses.replace(
        preset("tiny-dense"),
        head_dim=64,
        rope_theta=150000.0,
        rope_scaling=raw,
        max_position_embeddings=131072,
    )
    s = c.rope.scaling
    assert isinstance(s, YarnRopeScaling)
    hash(c)
    got = rope_inv_freq(c.head_dim, c.rope.theta, s)
    np.testing.assert_allclose(got, _yarn_reference(c.head_dim, c.rope.theta, s), rtol=2e-6)
    ratio = rope_inv_freq(c.head_dim, c.rope.theta) / got
    assert np.any(np.isclose(ratio, 1.0)) and np.any(np.isclose(ratio, s.factor))
    assert np.any((ratio > 1.01) & (ratio < s.factor * 0.99))  # the ramp
    # cos/sin factor: 0.1 ln(factor) + 1, or its ratio to itself when both mscales are equal.
    want = 1.0 if raw.get("mscale") else 0.1 * math.log(raw["factor"]) + 1
    assert math.isclose(rope_attention_factor(s), want)
    assert rope_attention_factor(None) == 1.0


def test_yarn_config_errors_and_defaults() -> None:
    base = preset("tiny-dense")
    # transformers' defaults: original context = max_position_embeddings, betas 32 / 1.
    c = dataclasses.replace(base, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert c.rope.scaling == YarnRopeScaling(
        factor=4.0, original_max_position_embeddings=base.max_position_embeddings
    )
    explicit = dict(rope_type="yarn", factor=4.0, attention_factor=0.5)
    assert dataclasses.replace(base, rope_scaling=explicit).rope_scaling.attention_factor == 0.5
    with pytest.raises(ConfigError, match="factor must be >= 1"):
        dataclasses.replace(base, rope_scaling={"rope_type": "yarn", "factor": 0.5})
    with pytest.raises(ConfigError, match="rope_local_theta with YaRN"):
        dataclasses.replace(
            base,
            sliding_window=8,
            rope_local_theta=10.0,
            rope_scaling={"rope_type": "yarn", "factor": 4.0},
        )


def test_apply_rope_scales_cos_and_sin() -> None:
    inv = rope_inv_freq(8, 10000.0)
    x = jax.random.normal(jax.random.key(1), (1, 3, 2, 8))
    pos = jnp.array([[0, 2, 7]])
    np.testing.assert_allclose(
        np.asarray(apply_rope(x, pos, inv, 1.25)),
        1.25 * np.asarray(apply_rope(x, pos, inv)),
        rtol=1e-6,
        atol=1e-6,
    )


def test_apply_rope_rotate_half() -> None:
    """Position p rotates the plane (i, i + H/2) by p * inv_freq[i]."""
    h = 8
    inv = rope_inv_freq(h, 10000.0)
    x = jax.random.normal(jax.random.key(0), (1, 3, 2, h))
    pos = jnp.array([[0, 1, 5]])
    y = np.asarray(apply_rope(x, pos, inv))
    xn = np.asarray(x)
    for t, p in enumerate([0, 1, 5]):
        for i in range(h // 2):
            a = p * inv[i]
            x1, x2 = xn[0, t, :, i], xn[0, t, :, i + h // 2]
            np.testing.assert_allclose(y[0, t, :, i], x1 * np.cos(a) - x2 * np.sin(a), atol=1e-6)
            np.testing.assert_allclose(
                y[0, t, :, i + h // 2], x2 * np.cos(a) + x1 * np.sin(a), atol=1e-6
            )


def test_presets_dict_is_complete() -> None:
    assert set(PRESETS) == {"tiny-dense", "tiny-gqa", "tiny-moe", "tiny-gpt2", "llama-1b"}
