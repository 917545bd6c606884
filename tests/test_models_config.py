"""ModelConfig invariants, presets, RoPE scaling, and logical-axis metadata on parameters."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.models import (
    ARCHS,
    PRESETS,
    AttentionConfig,
    EmbedConfig,
    ExecutionOptions,
    FfnConfig,
    Llama3RopeScaling,
    MlaConfig,
    ModelConfig,
    ModelRun,
    MoeConfig,
    NormConfig,
    RopeConfig,
    WindowConfig,
    YarnRopeScaling,
    abstract_model,
    apply_rope,
    init_model,
    param_logical_axes,
    preset,
    rope_attention_factor,
    rope_inv_freq,
)
from jaxpar.models._hf_config import config_from_hf, hf_config_of
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
    qwen3 = dataclasses.replace(
        preset("tiny-gqa"), arch="qwen3", norms=NormConfig(qk=True), head_dim=16
    )
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
        (dict(head_dim=7), "even head_dim"),
        (dict(positional="alibi"), "positional='alibi'; legal: rope, learned"),
        (
            dict(arch="qwen3_moe"),
            "'mixtral' and 'qwen3_moe' and 'deepseek_v3' and 'gpt_oss' are mixtures of experts",
        ),
        (dict(dtype="int32"), "floating"),
        (dict(d_model=0), "d_model must be positive"),
        # Groups given as mappings are built into their dataclasses (and checked by them).
        (dict(norms={"kind": "batch"}), "norms.kind='batch'; legal: rms, layer"),
        (dict(rope={"thetaa": 1.0}), r"rope: unknown field\(s\) thetaa; legal: theta, scaling"),
        (dict(norms=1e-5), "norms must be a NormConfig"),
        # What ties a group to the sizes or to another group.
        (dict(window={"size": 4, "layers": (True, False)}), "window.layers has 2 flags for n_"),
        (dict(rope={"local_theta": 100.0}), "rope.local_theta .*needs window.size"),
        (
            dict(positional="learned", rope=RopeConfig(linear_factor=2.0)),
            r"rope.linear_factor: only meaningful with positional='rope'",
        ),
        (dict(moe=MoeConfig(top_k=2)), r"moe.top_k: expert settings; they need n_experts > 0"),
        (dict(moe=MoeConfig(norm_topk_prob=False)), "moe.norm_topk_prob: .*need n_experts"),
        (
            dict(moe=MoeConfig(swiglu_limit=7.0, swiglu_alpha=1.702)),
            "moe.swiglu_limit, moe.swiglu_alpha: .*need n_experts",
        ),
        (dict(moe=MoeConfig(router_bias=True)), "moe.router_bias: .*need n_experts"),
        (
            dict(
                mla=MlaConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
            ),
            "n_kv_heads must be 1 and head_dim mla.kv_lora_rank \\+ mla.qk_rope_head_dim = 24",
        ),
    ],
)
def test_config_invariants(change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(preset("tiny-dense"), **change)


_MLA = MlaConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(attention=AttentionConfig(qkv_bias=True)), "MLA has no q/k/v/o biases"),
        (dict(norms=NormConfig(qk=True)), "norms.qk and window.size must be unset"),
        (dict(window=WindowConfig(size=8)), "MLA has no .*sliding window"),
        (dict(attention=AttentionConfig(softcap=30.0)), "attention.softcap .* unsupported"),
        (dict(positional="learned"), "MLA needs positional='rope'"),
    ],
)
def test_mla_config_invariants(change: dict, match: str) -> None:
    mla = dataclasses.replace(
        preset("tiny-moe"), n_kv_heads=1, head_dim=24, mla=_MLA, moe=MoeConfig(top_k=2)
    )
    assert mla.is_mla and mla.cache_kv_dims == (8, 16)
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(mla, **change)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: NormConfig(kind="batch"), "norms.kind='batch'; legal: rms, layer"),
        (lambda: NormConfig(eps=0.0), "norms.eps must be positive, got 0.0"),
        (lambda: NormConfig(kind="layer", qk=True), "norms.qk: RMS-norm options; .*'rms'"),
        (
            lambda: NormConfig(kind="layer", offset=True, sandwich=True),
            "norms.offset, norms.sandwich: RMS-norm options",
        ),
        (lambda: FfnConfig(activation="relu"), "ffn.activation='relu'; legal: silu, gelu_tanh"),
        (lambda: AttentionConfig(scale=0.0), "attention.scale must be None or positive"),
        (lambda: AttentionConfig(softcap=-1.0), "attention.softcap must be None or positive"),
        (lambda: RopeConfig(theta=0.0), "rope.theta must be positive, got 0.0"),
        (lambda: RopeConfig(local_theta=-1.0), "rope.local_theta must be None or positive"),
        (lambda: RopeConfig(linear_factor=0.0), "rope.linear_factor must be None or positive"),
        (
            lambda: RopeConfig(linear_factor=2.0, scaling=preset("llama-1b").rope.scaling),
            "rope.linear_factor and rope.scaling are exclusive",
        ),
        (lambda: WindowConfig(size=0), "window.size must be None or positive, got 0"),
        (lambda: WindowConfig(layers=(True, False)), "window.layers marks .* window.size is None"),
        (lambda: EmbedConfig(logit_softcap=0.0), "embed.logit_softcap must be None or positive"),
        (lambda: MlaConfig(q_lora_rank=8), "mla.q_lora_rank: .* need mla.kv_lora_rank"),
        (lambda: MlaConfig(rope_interleave=True), "mla.rope_interleave: .* need mla.kv_lora_rank"),
        (
            lambda: dataclasses.replace(_MLA, v_head_dim=0),
            "mla.v_head_dim must be positive, got 0",
        ),
        (lambda: dataclasses.replace(_MLA, q_lora_rank=0), "mla.q_lora_rank must be None or pos"),
        (lambda: dataclasses.replace(_MLA, qk_rope_head_dim=7), "mla.qk_rope_head_dim must be ev"),
        (lambda: MoeConfig(router="hash"), "moe.router='hash'; legal: softmax, sigmoid_grouped"),
        (lambda: MoeConfig(top_k=-1), "moe.top_k must be >= 0"),
        (lambda: MoeConfig(shared_d_ff=-1), "moe.shared_d_ff must be >= 0"),
        (lambda: MoeConfig(first_dense_layers=1), "moe.first_dense_layers > 0 needs .*dense_d_ff"),
        (lambda: MoeConfig(groups=2), "moe.groups, .* belong to moe.router='sigmoid_grouped'"),
        (
            lambda: MoeConfig(router="sigmoid_grouped", groups=2, topk_groups=3),
            r"moe.topk_groups=3 lie in \[1, 2\]",
        ),
        (
            lambda: MoeConfig(router="sigmoid_grouped", routed_scaling_factor=0.0),
            "moe.routed_scaling_factor must be > 0",
        ),
        (lambda: MoeConfig(swiglu_limit=7.0), "set both or neither"),
        (lambda: MoeConfig(swiglu_limit=7.0, swiglu_alpha=-1.0), "must be positive"),
    ],
)
def test_group_invariants(make, match: str) -> None:
    """Each group checks its own fields, naming them as a config reader spells them."""
    with pytest.raises(ConfigError, match=match):
        make()


def test_groups_default_to_a_plain_model_and_take_lists() -> None:
    c = ModelConfig(
        arch="llama", vocab_size=8, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4,
        d_ff=8, window={"size": 4, "layers": [True, False]},
    )  # fmt: skip
    assert c.window == WindowConfig(size=4, layers=(True, False))
    assert [c.layer_slides(i) for i in range(2)] == [True, False]
    assert (c.norms, c.ffn, c.attention, c.embed) == (
        NormConfig(), FfnConfig(), AttentionConfig(), EmbedConfig()
    )  # fmt: skip
    assert not c.is_mla and not c.is_moe and c.moe == MoeConfig()
    hash(c)


def test_moe_invariants() -> None:
    moe = preset("tiny-moe")
    with pytest.raises(ConfigError, match=r"moe.top_k must be in \[1, n_experts=8\], got 9"):
        dataclasses.replace(moe, moe=MoeConfig(top_k=9))
    with pytest.raises(ConfigError, match=r"moe.first_dense_layers must be in \[0, n_layers=4\)"):
        dataclasses.replace(moe, moe=MoeConfig(top_k=2, first_dense_layers=4, dense_d_ff=8))
    with pytest.raises(ConfigError, match="experts are SwiGLU: .*ffn.activation='silu'"):
        dataclasses.replace(moe, ffn=FfnConfig(activation="gelu_tanh"))
    grouped = dict(router="sigmoid_grouped", top_k=2)
    with pytest.raises(ConfigError, match="moe.groups=3 must divide n_experts=8"):
        dataclasses.replace(moe, moe=MoeConfig(groups=3, **grouped))
    with pytest.raises(ConfigError, match="best two experts: >= 2 each"):
        dataclasses.replace(moe, moe=MoeConfig(groups=8, **grouped))
    with pytest.raises(ConfigError, match="moe.top_k=3 exceeds the 2 experts"):
        dataclasses.replace(
            moe, moe=MoeConfig(groups=4, topk_groups=1, router="sigmoid_grouped", top_k=3)
        )
    ok = dataclasses.replace(moe, moe=MoeConfig(groups=4, topk_groups=2, **grouped))
    assert ok.moe.router == "sigmoid_grouped" and ok.layer_is_moe(0)

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
    c = dataclasses.replace(preset("tiny-dense"), rope=RopeConfig(scaling=raw))
    assert isinstance(c.rope.scaling, Llama3RopeScaling)
    assert c.rope == RopeConfig(scaling=Llama3RopeScaling.from_mapping(raw))
    hash(c)
    with pytest.raises(ConfigError, match="lacks key"):
        RopeConfig(scaling={"rope_type": "llama3"})
    legal = "legal: 'llama3', 'yarn', 'linear', 'dynamic'"
    with pytest.raises(ConfigError, match=f"'longrope' is not supported; {legal}"):
        dataclasses.replace(preset("tiny-dense"), rope={"scaling": {"rope_type": "longrope"}})


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
        rope=RopeConfig(theta=150000.0, scaling=raw),
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
    # A RoPE group given as a mapping completes the scaling from the model's context.
    c = dataclasses.replace(base, rope={"scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert c.rope.scaling == YarnRopeScaling(
        factor=4.0, original_max_position_embeddings=base.max_position_embeddings
    )
    with pytest.raises(ConfigError, match="lacks 'original_max_position_embeddings'"):
        RopeConfig(scaling={"rope_type": "yarn", "factor": 4.0})  # no model to complete it
    explicit = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    explicit["attention_factor"] = 0.5
    assert RopeConfig(scaling=explicit).scaling.attention_factor == 0.5
    with pytest.raises(ConfigError, match=r"rope.scaling \(yarn\): factor must be >= 1"):
        dataclasses.replace(base, rope={"scaling": {"rope_type": "yarn", "factor": 0.5}})
    with pytest.raises(ConfigError, match="rope.local_theta with a YaRN rope.scaling"):
        RopeConfig(local_theta=10.0, scaling=explicit)


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


FIXTURES = Path(__file__).parent / "fixtures"
CONFIG_JSONS = sorted(FIXTURES.glob("**/config.json"))
#: Keys a fixture may state otherwise than hf_config_of writes them: the dense width
#: Qwen3-MoE never runs, the ``rope_scaling`` spelling (compared parsed, as the config).
_RESTATED = {"intermediate_size", "rope_scaling"}


@pytest.mark.parametrize("path", CONFIG_JSONS, ids=lambda p: str(p.parent.relative_to(FIXTURES)))
def test_config_json_round_trip(path: Path) -> None:
    """Every family fixture's config.json -> ModelConfig -> config.json -> the same
    ModelConfig, and the written file agrees with the fixture on the keys both state."""
    raw = json.loads(path.read_text())
    config = config_from_hf(raw, source=str(path))
    written = json.loads(json.dumps(hf_config_of(config)))
    assert config_from_hf(written, source="written") == config
    differ = {k for k in raw.keys() & written.keys() if raw[k] != written[k]}
    # A null in the fixture is the family's default, which the written file spells out.
    assert {k for k in differ if raw[k] is not None} <= _RESTATED, differ


def test_round_trip_covers_every_family() -> None:
    archs = {config_from_hf(json.loads(p.read_text()), source=str(p)).arch for p in CONFIG_JSONS}
    assert archs == set(ARCHS)


def test_hf_config_of_refuses_what_no_config_json_says() -> None:
    # Llama's attention_bias puts biases on q, k, v and o alike: q/k/v alone has no spelling.
    biased = dataclasses.replace(preset("tiny-dense"), attention=AttentionConfig(qkv_bias=True))
    with pytest.raises(ConfigError, match="LlamaForCausalLM config.json .*attention.out_bias"):
        hf_config_of(biased)
    assert config_from_hf(hf_config_of(preset("tiny-gpt2")), source="x") == preset("tiny-gpt2")
