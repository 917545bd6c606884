"""Hugging Face checkpoint import: round trips, sharded placement, and bad checkpoints.

Checkpoints are written here from jaxpar parameters with the Hugging Face tensor names and
orientations spelled out by hand (independently of the loader's recipes), so a round trip
checks the mapping both ways; the committed transformers fixtures check it against the
real library (``test_hf_fixtures.py``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors.numpy import save_file

from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.models import (
    AttentionConfig,
    ExecutionOptions,
    ModelConfig,
    NormConfig,
    init_params,
    load_hf_checkpoint,
    preset,
)
from jaxpar.models._decoder import with_layer_loop

LLAMA_QWEN = dataclasses.replace(
    preset("tiny-gqa"), arch="qwen2", attention=AttentionConfig(qkv_bias=True), n_layers=2
)
# Qwen3: q/k norms, head_dim 16 (8 x 16 != d_model 64); the second with attention_bias.
QWEN3 = dataclasses.replace(
    preset("tiny-gqa"), arch="qwen3", norms=NormConfig(qk=True), head_dim=16
)
QWEN3_BIAS = dataclasses.replace(
    QWEN3, n_layers=2, attention=AttentionConfig(qkv_bias=True, out_bias=True)
)
QWEN3_MOE = dataclasses.replace(
    preset("tiny-moe"),
    arch="qwen3_moe",
    norms=NormConfig(qk=True),
    n_kv_heads=4,
    head_dim=16,
    n_layers=2,
)
# Not renormalised.
QWEN3_MOE_RAW = dataclasses.replace(
    QWEN3_MOE, moe=dataclasses.replace(QWEN3_MOE.moe, norm_topk_prob=False)
)


def _flat(params: nnx.State) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


def _linear(kernel: np.ndarray, n_in: int) -> np.ndarray:
    """Our [*in, *out] kernel as a torch Linear weight [out, in]."""
    return kernel.reshape(int(np.prod(kernel.shape[:n_in])), -1).T


def _llama_tensors(c: ModelConfig, p: dict[str, np.ndarray], moe: str) -> dict[str, np.ndarray]:
    t = {
        "model.embed_tokens.weight": p["embed/token_table"],
        "model.norm.weight": p["final_norm/scale"],
    }
    if not c.embed.tied:
        t["lm_head.weight"] = p["lm_head/kernel"].T
    for i in range(c.n_layers):
        pre = f"model.layers.{i}."
        t[pre + "input_layernorm.weight"] = p["layers/attn_norm/scale"][i]
        t[pre + "post_attention_layernorm.weight"] = p["layers/ffn_norm/scale"][i]
        t.update(_attention_tensors(c, p, i, pre + "self_attn."))
        if not c.is_moe:
            gate_up_DCF = p["layers/ffn/gate_up_kernel"][i]  # gate and up fused: [D, 2, F]
            t[pre + "mlp.gate_proj.weight"] = gate_up_DCF[:, 0].T
            t[pre + "mlp.up_proj.weight"] = gate_up_DCF[:, 1].T
            t[pre + "mlp.down_proj.weight"] = p["layers/ffn/down_kernel"][i].T
        else:
            t.update(_expert_tensors(c, p, i, pre, moe))
    return t


def _attention_tensors(c: ModelConfig, p: dict[str, np.ndarray], i: int, pre: str) -> dict:
    t = {}
    kv_DCKH = p["layers/attn/kv_kernel"][i]  # K and V fused: [D, 2, K, H]
    q_DNH, k_DKH, v_DKH = p["layers/attn/q_kernel"][i], kv_DCKH[:, 0], kv_DCKH[:, 1]
    for n, kernel in zip("qkv", (q_DNH, k_DKH, v_DKH), strict=True):
        t[pre + f"{n}_proj.weight"] = _linear(kernel, 1)
    if c.attention.qkv_bias:
        kv_bias = p["layers/attn/kv_bias"][i]
        for n, bias in zip("qkv", (p["layers/attn/q_bias"][i], *kv_bias), strict=True):
            t[pre + f"{n}_proj.bias"] = bias.reshape(-1)
    t[pre + "o_proj.weight"] = _linear(p["layers/attn/o_kernel"][i], 2)
    if c.attention.out_bias:
        t[pre + "o_proj.bias"] = p["layers/attn/o_bias"][i]
    if c.norms.qk:  # Qwen3: one [H] scale each
        for n in "qk":
            t[pre + f"{n}_norm.weight"] = p[f"layers/attn/{n}_norm/scale"][i]
    return t


def _expert_tensors(c: ModelConfig, p: dict[str, np.ndarray], i: int, pre: str, moe: str):
    t = {}
    gate, up, down = (p[f"layers/ffn/experts/{n}_kernel"][i] for n in ("gate", "up", "down"))
    router = p["layers/ffn/router/kernel"][i].T
    if moe == "legacy":
        t[pre + "block_sparse_moe.gate.weight"] = router
        for e in range(c.n_experts):
            ex = pre + f"block_sparse_moe.experts.{e}."
            t[ex + "w1.weight"], t[ex + "w3.weight"] = gate[e].T, up[e].T
            t[ex + "w2.weight"] = down[e].T
    elif moe == "per_expert":  # Qwen3-MoE on the Hub
        t[pre + "mlp.gate.weight"] = router
        for e in range(c.n_experts):
            ex = pre + f"mlp.experts.{e}."
            t[ex + "gate_proj.weight"], t[ex + "up_proj.weight"] = gate[e].T, up[e].T
            t[ex + "down_proj.weight"] = down[e].T
    else:
        t[pre + "mlp.gate.weight"] = router
        t[pre + "mlp.experts.gate_up_proj"] = np.concatenate(
            [gate.transpose(0, 2, 1), up.transpose(0, 2, 1)], axis=1
        )
        t[pre + "mlp.experts.down_proj"] = down.transpose(0, 2, 1)
    return t


def _gpt2_tensors(c: ModelConfig, p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    d, pre = c.d_model, "transformer."
    t = {
        pre + "wte.weight": p["embed/token_table"],
        pre + "wpe.weight": p["embed/position_table"],
        pre + "ln_f.weight": p["final_norm/scale"],
        pre + "ln_f.bias": p["final_norm/bias"],
    }
    for i in range(c.n_layers):
        h = f"{pre}h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("ffn_norm", "ln_2")):
            t[h + f"{theirs}.weight"] = p[f"layers/{ours}/scale"][i]
            t[h + f"{theirs}.bias"] = p[f"layers/{ours}/bias"][i]
        q_DNH, kv_DCNH = p["layers/attn/q_kernel"][i], p["layers/attn/kv_kernel"][i]
        t[h + "attn.c_attn.weight"] = np.concatenate(
            [q_DNH.reshape(d, d), kv_DCNH[:, 0].reshape(d, d), kv_DCNH[:, 1].reshape(d, d)], axis=1
        )
        q_bias, kv_bias = p["layers/attn/q_bias"][i], p["layers/attn/kv_bias"][i]
        t[h + "attn.c_attn.bias"] = np.concatenate([q_bias.reshape(-1), kv_bias.reshape(-1)])
        t[h + "attn.c_proj.weight"] = p["layers/attn/o_kernel"][i].reshape(d, d)
        t[h + "attn.c_proj.bias"] = p["layers/attn/o_bias"][i]
        for n, theirs in (("up", "c_fc"), ("down", "c_proj")):
            t[h + f"mlp.{theirs}.weight"] = p[f"layers/ffn/{n}_kernel"][i]
            t[h + f"mlp.{theirs}.bias"] = p[f"layers/ffn/{n}_bias"][i]
    return t


def _hf_config(c: ModelConfig) -> dict:
    if c.arch == "gpt2":
        return dict(
            architectures=["GPT2LMHeadModel"],
            vocab_size=c.vocab_size,
            n_embd=c.d_model,
            n_layer=c.n_layers,
            n_head=c.n_heads,
            n_positions=c.max_position_embeddings,
            n_inner=c.d_ff,
            layer_norm_epsilon=c.norms.eps,
            tie_word_embeddings=True,
        )
    cls = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
    }[c.arch]
    out = dict(
        architectures=[cls],
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        intermediate_size=c.d_ff,
        rms_norm_eps=c.norms.eps,
        rope_theta=c.rope.theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.embed.tied,
        hidden_act="silu",
    )
    if c.arch in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = c.attention.qkv_bias
    if c.arch == "qwen3_moe":
        out.update(
            num_experts=c.n_experts,
            num_experts_per_tok=c.moe.top_k,
            moe_intermediate_size=c.d_ff,
            intermediate_size=4 * c.d_ff,  # the dense MLP's width, unused: every layer sparse
            norm_topk_prob=c.moe.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    elif c.is_moe:
        out.update(num_local_experts=c.n_experts, num_experts_per_tok=c.moe.top_k)
    return out


def _write(root: Path, c: ModelConfig, moe: str = "fused", shards: int = 1, dtype=None) -> dict:
    """Writes config.json and safetensors for random params; returns our flat params.

    The tensors are written from the stacked form (``layer_loop="scan"``, ``[L, ...]``
    per parameter); the returned params are in ``c``'s own form.
    """
    params = init_params(c, seed=7)
    p = _flat(params)
    stacked = _flat(with_layer_loop(c, params, "scan"))
    tensors = _gpt2_tensors(c, stacked) if c.arch == "gpt2" else _llama_tensors(c, stacked, moe)
    tensors = {k: np.ascontiguousarray(v, dtype or np.float32) for k, v in tensors.items()}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(_hf_config(c)))
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"))
        return p
    names, weight_map = sorted(tensors), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(root / file))
        weight_map.update(dict.fromkeys(part, file))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return p


CASES = {
    "llama": (preset("tiny-gqa"), "fused", 1),
    "qwen2_sharded": (LLAMA_QWEN, "fused", 3),
    "mixtral_fused": (preset("tiny-moe"), "fused", 1),
    "mixtral_legacy": (preset("tiny-moe"), "legacy", 2),
    "gpt2": (preset("tiny-gpt2"), "fused", 1),
    "qwen3": (QWEN3, "fused", 1),
    "qwen3_bias_sharded": (QWEN3_BIAS, "fused", 2),
    "qwen3_moe_per_expert": (QWEN3_MOE, "per_expert", 2),
    "qwen3_moe_fused": (QWEN3_MOE_RAW, "fused", 1),
}


@pytest.mark.parametrize("case", CASES)
def test_round_trip(tmp_path: Path, case: str) -> None:
    config, moe, shards = CASES[case]
    want = _write(tmp_path, config, moe, shards)
    loaded_config, params = load_hf_checkpoint(tmp_path)
    assert loaded_config == config
    assert jax.tree.structure(params) == jax.tree.structure(init_params(config))
    got = _flat(params)
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize("case", ["llama", "mixtral_legacy", "gpt2", "qwen3_moe_per_expert"])
def test_round_trip_stacked(tmp_path: Path, case: str) -> None:
    """``layer_loop="scan"`` loads the same weights, stacked ``[L, ...]``."""
    config, moe, shards = CASES[case]
    written = _write(tmp_path, config, moe, shards)
    scan_config, params = load_hf_checkpoint(tmp_path, layer_loop="scan")
    assert scan_config == config  # the checkpoint's: the layer form is the run's
    stacked = _flat(with_layer_loop(config, _state(written, config), "scan"))
    got = _flat(params)
    assert got.keys() == stacked.keys() and any(k.startswith("layers/attn/") for k in got)
    for name, value in stacked.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def _state(flat: dict[str, np.ndarray], config: ModelConfig) -> nnx.State:
    """Flat ``{"a/0/b": value}`` back into the params state of ``config``."""
    template = nnx.to_flat_state(init_params(config))
    return nnx.from_flat_state(
        [(path, var.replace(jnp.asarray(flat["/".join(map(str, path))]))) for path, var in template]
    )


def test_bfloat16_checkpoint_and_dtype_override(tmp_path: Path) -> None:
    _write(tmp_path, preset("tiny-dense"), dtype=ml_dtypes.bfloat16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    config, params = load_hf_checkpoint(tmp_path)
    assert config.dtype == config.param_dtype == jnp.bfloat16
    assert {v.dtype for v in _flat(params).values()} == {np.dtype(jnp.bfloat16)}
    # Another dtype is the run's: the config stays the checkpoint's, the weights convert.
    f32, params = load_hf_checkpoint(tmp_path, dtype="float32")
    assert f32 == config and f32.dtype == jnp.bfloat16
    assert {v.dtype for v in _flat(params).values()} == {np.dtype(np.float32)}
    _, same = load_hf_checkpoint(tmp_path, options=ExecutionOptions(dtype="float32"))
    assert {v.dtype for v in _flat(same).values()} == {np.dtype(np.float32)}
    with pytest.raises(ConfigError, match="dtype=.*contradicts options.dtype"):
        load_hf_checkpoint(tmp_path, dtype="float16", options=ExecutionOptions(dtype="float32"))


def _mesh_sharding(mesh: Mesh):
    rules = {"heads": "x", "kv_heads": "x", "mlp": "x", "vocab": "x", "experts": "y", "layers": "y"}

    def sharding(path: tuple[str, ...], axes: tuple[str | None, ...]) -> NamedSharding:
        spec, used = [], set()
        for name in axes:  # each mesh axis at most once, first come first served
            mesh_axis = rules.get(name)
            spec.append(None if mesh_axis in used else mesh_axis)
            used.add(mesh_axis)
        return NamedSharding(mesh, PartitionSpec(*spec))

    return sharding


@pytest.mark.parametrize(
    ("case", "loop"),
    [
        ("mixtral_fused", "scan"),
        ("mixtral_fused", "unrolled"),
        ("gpt2", "scan"),
        ("qwen3_moe_per_expert", "unrolled"),
    ],
)
def test_sharded_placement_reads_slices(tmp_path: Path, case: str, loop: str) -> None:
    config, moe, shards = CASES[case]
    want = _write(tmp_path, config, moe, shards)
    if loop == "scan":
        want = _flat(with_layer_loop(config, _state(want, config), "scan"))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    fn = _mesh_sharding(mesh)
    _, params = load_hf_checkpoint(tmp_path, shardings=fn, layer_loop=loop)
    for path, var in nnx.to_flat_state(params):
        arr = var.get_value()
        assert arr.sharding == fn(path, var.get_metadata()["out_sharding"]), path
        np.testing.assert_array_equal(np.asarray(arr), want["/".join(map(str, path))])
    # The same shardings as a params-shaped pytree.
    tree = jax.tree.map(lambda a: a.sharding, params)
    _, again = load_hf_checkpoint(tmp_path, shardings=tree, layer_loop=loop)
    layers = again["layers"] if loop == "scan" else again["layers"][1]
    q = layers["attn"]["q_kernel"].get_value()
    stacked = ("y",) if loop == "scan" else ()
    assert q.sharding.spec == PartitionSpec(*stacked, None, "x", None)


# --- bad checkpoints -------------------------------------------------------------------


def _tensors(root: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(root / "model.safetensors"))


def _rewrite(root: Path, tensors: dict[str, np.ndarray]) -> None:
    save_file(tensors, str(root / "model.safetensors"))


@pytest.fixture
def good(tmp_path: Path) -> Path:
    _write(tmp_path, preset("tiny-dense"))
    return tmp_path


def test_wrong_shape_names_tensor_and_shapes(good: Path) -> None:
    t = _tensors(good)
    name = "model.layers.1.self_attn.k_proj.weight"
    t[name] = t[name][:32]
    _rewrite(good, t)
    with pytest.raises(
        CheckpointError, match=rf"{name}.*expected shape \(64, 64\), found \(32, 64\)"
    ):
        load_hf_checkpoint(good)


def test_missing_tensor_is_named(good: Path) -> None:
    t = _tensors(good)
    del t["model.layers.3.mlp.up_proj.weight"]
    _rewrite(good, t)
    with pytest.raises(CheckpointError, match="lacks tensor 'model.layers.3.mlp.up_proj.weight'"):
        load_hf_checkpoint(good)


def test_extra_tensor_is_named(good: Path) -> None:
    t = _tensors(good)
    t["model.layers.0.self_attn.q_norm.weight"] = np.ones(8, np.float32)
    _rewrite(good, t)
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.q_norm"):
        load_hf_checkpoint(good)


def test_known_buffers_are_ignored(good: Path) -> None:
    t = _tensors(good)
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    _rewrite(good, t)
    load_hf_checkpoint(good)


def test_unknown_architecture_lists_supported(good: Path) -> None:
    cfg = json.loads((good / "config.json").read_text())
    (good / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertModel"]}))
    with pytest.raises(CheckpointError, match="BertModel.*LlamaForCausalLM.*GPT2LMHeadModel"):
        load_hf_checkpoint(good)


def test_corrupt_file_is_named(good: Path) -> None:
    (good / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="corrupt safetensors file .*model.safetensors"):
        load_hf_checkpoint(good)


def test_truncated_file_is_named(good: Path) -> None:
    data = (good / "model.safetensors").read_bytes()
    (good / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf_checkpoint(good)


def test_nan_is_named(good: Path) -> None:
    t = _tensors(good)
    t["model.norm.weight"][3] = np.nan
    _rewrite(good, t)
    with pytest.raises(CheckpointError, match="'model.norm.weight'.*NaN/Inf"):
        load_hf_checkpoint(good)


def test_missing_config_key_and_file(good: Path) -> None:
    cfg = json.loads((good / "config.json").read_text())
    del cfg["hidden_size"]
    (good / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing key 'hidden_size'"):
        load_hf_checkpoint(good)
    (good / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_checkpoint(good)


def test_index_naming_absent_tensor(tmp_path: Path) -> None:
    _write(tmp_path, preset("tiny-dense"), shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.extra.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'model.layers.0.extra.weight'"):
        load_hf_checkpoint(tmp_path)


def test_each_device_reads_only_its_slice(tmp_path: Path, monkeypatch) -> None:
    from jaxpar.models import _hf

    _write(tmp_path, preset("tiny-dense"))
    reads: list[tuple[str, int]] = []
    original = _hf._Checkpoint.reader

    def spying_reader(self, dtype):
        read = original(self, dtype)

        def spy(name, slices):
            out = read(name, slices)
            reads.append((name, out.size))
            return out

        return spy

    monkeypatch.setattr(_hf._Checkpoint, "reader", spying_reader)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    load_hf_checkpoint(tmp_path, shardings=_mesh_sharding(mesh))
    # q_kernel [L=4, D, N=8, H] is split 2-way over layers and 4-way over heads: each of
    # the 8 devices reads 2 heads of each of its 2 layers; together the reads cover every
    # q_proj tensor exactly once.
    q = [size for name, size in reads if name.endswith("q_proj.weight")]
    assert set(q) == {2 * 8 * 64} and sum(q) == 4 * 64 * 8 * 8


# --- Qwen3 / Qwen3-MoE config.json mapping ---------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
_DROP = object()  # a key to take out of config.json


def _fixture_config(name: str, **change) -> dict:
    """A committed fixture's config.json with keys changed (or dropped: ``_DROP``)."""
    hf = json.loads((FIXTURES / name / "config.json").read_text())
    hf.update(change)
    return {k: v for k, v in hf.items() if v is not _DROP}


def test_qwen3_config_mapping() -> None:
    from jaxpar.models import config_from_hf

    c = config_from_hf(_fixture_config("qwen3"), source="qwen3")
    assert (
        c.arch,
        c.norms.qk,
        c.attention.qkv_bias,
        c.attention.out_bias,
        c.head_dim,
        c.d_model,
    ) == (
        "qwen3",
        True,
        False,
        False,
        16,
        32,
    )
    assert c.window.size is None and c.embed.tied and not c.is_moe
    # transformers' Qwen3Config defaults head_dim to 128, not hidden_size / heads.
    assert config_from_hf(_fixture_config("qwen3", head_dim=_DROP), source="x").head_dim == 128
    biased = config_from_hf(_fixture_config("qwen3", attention_bias=True), source="x")
    assert biased.attention.qkv_bias and biased.attention.out_bias
    # use_sliding_window without layer_types: layers from max_window_layers on slide.
    slide = dict(use_sliding_window=True, sliding_window=8, layer_types=_DROP)
    every = config_from_hf(_fixture_config("qwen3", max_window_layers=0, **slide), source="x")
    assert every.window.size == 8 and every.window.layers is None  # every layer
    mixed = config_from_hf(_fixture_config("qwen3", max_window_layers=1, **slide), source="x")
    assert mixed.window.size == 8 and mixed.window.layers == (False, True)
    named = dict(slide, layer_types=["sliding_attention", "full_attention"])
    assert config_from_hf(_fixture_config("qwen3", **named), source="x").window.layers == (
        True,
        False,
    )
    with pytest.raises(
        CheckpointError, match="layer_types must list 2 entries .* with \\['chunked'\\]"
    ):
        bad = dict(slide, layer_types=["chunked", "full_attention"])
        config_from_hf(_fixture_config("qwen3", **bad), source="x")


def test_qwen3_moe_config_mapping() -> None:
    from jaxpar.models import config_from_hf

    c = config_from_hf(_fixture_config("qwen3_moe"), source="qwen3_moe")
    assert (c.arch, c.n_experts, c.moe.top_k, c.d_ff, c.moe.norm_topk_prob, c.norms.qk) == (
        "qwen3_moe",
        64,
        8,
        4,  # moe_intermediate_size, not the dense MLP's intermediate_size
        True,
        True,
    )
    # The Hub's configs say num_experts (transformers 5.x saves num_local_experts), and
    # transformers' default norm_topk_prob is False.
    hub = _fixture_config(
        "qwen3_moe", num_local_experts=_DROP, num_experts=64, norm_topk_prob=_DROP
    )
    c = config_from_hf(hub, source="x")
    assert c.n_experts == 64 and not c.moe.norm_topk_prob


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(mlp_only_layers=[1]), r"mlp_only_layers=\[1\] .*mixed dense and sparse"),
        (dict(decoder_sparse_step=2), r"decoder_sparse_step=2 .*mixed dense and sparse"),
        (dict(num_local_experts=0), "num_local_experts=0 makes every layer a dense MLP"),
        (dict(use_sliding_window=True, sliding_window=8), "use_sliding_window=true"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(rope_parameters={"rope_type": "longrope", "factor": 4.0}), "rope type 'longrope'"),
    ],
)
def test_qwen3_moe_unsupported_config_is_named(change: dict, match: str) -> None:
    from jaxpar.models import config_from_hf

    with pytest.raises(CheckpointError, match=match):
        config_from_hf(_fixture_config("qwen3_moe", **change), source="config.json")
