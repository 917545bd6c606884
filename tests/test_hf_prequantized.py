"""Pre-quantized fp8 checkpoints (compressed-tensors per channel / per tensor, fbgemm_fp8):
the fp8 weights and scales load bit for bit, the logits match the dequantized model and
transformers, sharded loads equal one device, and other quantization configs are refused
before loading. Fixtures: ``scripts/make_fp8_fixtures.py`` (the ``llama`` fixture's
projections stored in e4m3 with their ``weight_scale``)."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxpar.engine._load import engine_from_hf
from jaxpar.errors import CheckpointError
from jaxpar.models import load_hf_checkpoint, params_quantization
from jaxpar.spec import ParallelConfig, make_mesh
from tests._tiers import sweep

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NAMES = ("llama_fp8_channel", "llama_fp8_tensor", "llama_fbgemm_fp8")
N, K, H, D = 4, 2, 8, 32  # the llama fixture: heads, kv heads, head_dim, hidden
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _stored(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of ``model.safetensors``, parsed from the file's bytes here (the JSON
    header's dtype, shape and offsets), independently of jaxpar's reader."""
    raw = (path / "model.safetensors").read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    dtypes = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        data = np.frombuffer(raw[8 + size + begin : 8 + size + end], dtypes[info["dtype"]])
        out[name] = data.reshape(info["shape"])
    return out


def _per_channel(scale: np.ndarray, rows: int) -> np.ndarray:
    """A stored scale as one float per output row (a per-tensor scale repeated)."""
    return np.broadcast_to(scale.reshape(-1, 1), (rows, 1)) if scale.size == 1 else scale


@functools.cache
def _loaded(name: str):
    config, params = load_hf_checkpoint(FIXTURES / name)
    flat = {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(params)}
    return config, flat, params_quantization(params)


@pytest.mark.parametrize("name", NAMES)
def test_fp8_weights_and_scales_load_bit_for_bit(name):
    config, flat, mode = _loaded(name)
    stored = _stored(FIXTURES / name)
    assert mode == "fp8"  # the parameters say it; the config is the architecture alone
    for i in range(2):
        pre, ours = f"model.layers.{i}.", f"layers.{i}."

        def w(p, mod="self_attn", pre=pre):
            return stored[f"{pre}{mod}.{p}.weight"]

        def s(p, rows, mod="self_attn", pre=pre):
            return _per_channel(stored[f"{pre}{mod}.{p}.weight_scale"], rows)

        # Stored out-major, as the checkpoint's [out, in] tensors (jaxpar's quantized order).
        want = {
            "attn.q_kernel": (w("q_proj").reshape(N, H, D), s("q_proj", N * H).reshape(N, H, 1)),
            "attn.kv_kernel": (
                np.stack([w(x).reshape(K, H, D) for x in ("k_proj", "v_proj")]),
                np.stack([s(x, K * H).reshape(K, H, 1) for x in ("k_proj", "v_proj")]),
            ),
            "attn.o_kernel": (w("o_proj").reshape(D, N, H), s("o_proj", D).reshape(D, 1, 1)),
            "ffn.gate_up_kernel": (
                np.stack([w(x, "mlp") for x in ("gate_proj", "up_proj")]),
                np.stack([s(x, 64, "mlp").reshape(64, 1) for x in ("gate_proj", "up_proj")]),
            ),
            "ffn.down_kernel": (w("down_proj", "mlp"), s("down_proj", D, "mlp").reshape(D, 1)),
        }
        for key, (values, scales) in want.items():
            got, got_scale = flat[ours + key], flat[ours + key + "_scale"]
            assert got.dtype == ml_dtypes.float8_e4m3fn and got_scale.dtype == np.float32
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8), values.view(np.uint8))
            np.testing.assert_array_equal(
                np.asarray(got_scale).view(np.uint32), scales.view(np.uint32)
            )
    # Not quantized in the checkpoint, nor in jaxpar: the embedding and the LM head.
    np.testing.assert_array_equal(flat["embed.token_table"], stored["model.embed_tokens.weight"])
    np.testing.assert_array_equal(flat["lm_head.kernel"], stored["lm_head.weight"].T)


def _dequantized_checkpoint(name: str, root: Path) -> Path:
    """The fixture with every fp8 weight replaced by ``float32(w_fp8) * scale`` (computed
    here, in float32) and no quantization_config: jaxpar's dequantized reference."""
    stored = _stored(FIXTURES / name)
    out = {}
    for key, value in stored.items():
        if key.endswith(("_scale", "_scale_ub")):
            continue
        if value.dtype == ml_dtypes.float8_e4m3fn:
            scale = _per_channel(stored[key + "_scale"], value.shape[0]).astype(np.float32)
            value = value.astype(np.float32) * scale
        out[key] = np.ascontiguousarray(value, np.float32)
    dst = root / f"{name}_dequantized"
    dst.mkdir()
    save_file(out, dst / "model.safetensors")
    config = json.loads((FIXTURES / name / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@functools.cache
def _logits(
    path: Path, parallel: ParallelConfig | None = None, greedy: bool = False
) -> tuple[np.ndarray, list, list | None]:
    """Prefill logits of the llama fixture's prompts, and with ``greedy`` 12 greedy tokens
    (cached: the one-device runs serve several tests)."""
    parallel = parallel or ParallelConfig()
    ref = np.load(FIXTURES / "llama" / "reference.npz")
    prompts = [ref[f"tokens_{i}"].tolist() for i in range(int(ref["n_prompts"]))]
    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    eng = engine_from_hf(path, parallel, max_batch=4, max_seq_len=48, mesh=mesh)
    tokens, lengths = eng.pad_prompts(prompts)
    logits = np.asarray(eng.prefill_logits(tokens, lengths))
    tokens = eng.generate(prompts, 12, stop_tokens=()).tokens if greedy else None
    return logits, prompts, tokens


# The quantized matmul widens fp8 to float32 and scales the dot's output; the reference
# multiplies the weight by its scale first. Both are float32: they differ by rounding only
# (measured: at most 5.5e-6 on logits up to 4.9 in magnitude; transformers' 5.7e-6; the
# sharded loads 5.1e-6 from one device's).
BOUND = 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_the_dequantized_reference(name, tmp_path):
    got, prompts, tokens = _logits(FIXTURES / name)
    want, _, want_tokens = _logits(_dequantized_checkpoint(name, tmp_path))
    for i, prompt in enumerate(prompts):
        np.testing.assert_allclose(
            got[i, : len(prompt)], want[i, : len(prompt)], atol=BOUND, rtol=0
        )
    assert tokens == want_tokens
    # The fp8 rounding is real: the float llama fixture's logits differ by far more.
    ref = np.load(FIXTURES / "llama" / "reference.npz")
    assert np.abs(got[0, : len(prompts[0])] - ref["logits_0"]).max() > 100 * BOUND


@pytest.mark.parametrize("name", ["llama_fp8_channel", "llama_fp8_tensor"])
def test_logits_match_transformers_compressed_tensors(name):
    """transformers (with compressed-tensors, activations left unquantized) loaded the
    compressed-tensors fixtures and wrote their float32 logits (scripts/make_fp8_fixtures.py;
    its greedy tokens are checked by tests/test_hf_fixtures.py)."""
    ref = np.load(FIXTURES / name / "reference.npz")
    got, prompts, _ = _logits(FIXTURES / name)
    for i, prompt in enumerate(prompts):
        np.testing.assert_allclose(got[i, : len(prompt)], ref[f"logits_{i}"], atol=BOUND, rtol=0)


@pytest.mark.parametrize(
    ("name", "parallel"),
    sweep(
        [
            ("llama_fp8_channel", ParallelConfig(dp=2, tp=2)),
            ("llama_fp8_tensor", ParallelConfig(tp=4)),
        ],
        # The fast tier: per-tensor scales broadcast, then split by tp with their kernels.
        lambda case: case[0] == "llama_fp8_tensor",
    ),
    ids=str,
)
def test_sharded_load_equals_one_device(name, parallel):
    """Logits within 1e-4 and the same 12 greedy tokens (the per-tensor scales broadcast,
    then split by tp=4 with their kernels)."""
    one, prompts, tokens = _logits(FIXTURES / name, None, True)
    got, _, got_tokens = _logits(FIXTURES / name, parallel, True)
    for i, prompt in enumerate(prompts):
        np.testing.assert_allclose(got[i, : len(prompt)], one[i, : len(prompt)], atol=1e-4, rtol=0)
    assert got_tokens == tokens


def test_scales_are_sharded_with_their_kernels():
    parallel = ParallelConfig(dp=2, tp=2)
    mesh = make_mesh(parallel, jax.devices()[:4])
    eng = engine_from_hf(
        FIXTURES / "llama_fp8_tensor", parallel, max_batch=2, max_seq_len=32, mesh=mesh
    )
    attn = eng.params["layers"][0]["attn"]
    for name in ("q_kernel", "o_kernel"):
        kernel, scale = attn[name].get_value(), attn[f"{name}_scale"].get_value()
        assert kernel.dtype == ml_dtypes.float8_e4m3fn and scale.dtype == np.float32
        # a scale dim the kernel contracts is size 1 and unsplit; the others split as the kernel's
        for k, (n, axis) in enumerate(zip(scale.shape, scale.sharding.spec, strict=False)):
            assert axis == (None if n == 1 else kernel.sharding.spec[k])
    assert "tp" in attn["q_kernel_scale"].get_value().sharding.spec


def _copy(tmp_path: Path, name: str = "llama_fp8_channel") -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _set_quant(path: Path, qc: dict) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("qc", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "mxfp4"}, "'mxfp4'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size [128, 128]"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_other_quantization_configs_are_refused_before_loading(tmp_path, monkeypatch, qc, named):
    path = _copy(tmp_path)
    _set_quant(path, qc)
    (path / "model.safetensors").write_bytes(b"not read")  # refused before any tensor
    with pytest.raises(CheckpointError, match="quant_method") as err:
        load_hf_checkpoint(path)
    assert named in str(err.value) and "compressed-tensors" in str(err.value)
    with pytest.raises(CheckpointError, match="quant_method"):
        engine_from_hf(path, max_batch=1, max_seq_len=16)


def test_block_and_int_compressed_tensors_schemes_are_refused(tmp_path):
    path = _copy(tmp_path)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    weights.update(strategy="block", block_structure=[128, 128])
    _set_quant(path, qc)
    with pytest.raises(CheckpointError, match=r"strategy 'block' \(block_structure \[128, 128\]"):
        load_hf_checkpoint(path)
    weights.update(strategy="channel", type="int", block_structure=None)
    _set_quant(path, qc)
    with pytest.raises(CheckpointError, match="8-bit int weights"):
        load_hf_checkpoint(path)


def test_blockwise_scale_tensor_is_refused_naming_it(tmp_path):
    """A config claiming per-channel scales over a checkpoint holding block-wise ones."""
    path = _copy(tmp_path)
    tensors = _stored(path)
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = np.ones((1, 1, 2), np.float32)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{name}: weight_scale of shape \\[1, 1, 2\\]"):
        load_hf_checkpoint(path)


def test_quantizing_a_prequantized_checkpoint_again_is_refused():
    with pytest.raises(CheckpointError, match="pre-quantized .*quantize='int8'"):
        load_hf_checkpoint(FIXTURES / "llama_fp8_channel", quantize="int8")
    _, params = load_hf_checkpoint(FIXTURES / "llama_fp8_channel", quantize="fp8")
    assert params_quantization(params) == "fp8"


def test_plan_counts_the_stored_fp8_bytes():
    """``jaxpar plan --hf`` on a pre-quantized checkpoint plans fp8 kernels: the projection
    kernels take a quarter of their float32 bytes (a float32 scale per output channel
    aside); the embedding and LM head are the same in both."""
    from jaxpar.cli import _parser as build_parser
    from jaxpar.cli._common import model_config
    from jaxpar.plan import param_bytes

    def config(name):  # as `jaxpar plan/explain --hf DIR` derive it
        argv = ["explain", "--hf", str(FIXTURES / name)]  # plan and explain read it alike
        return model_config(build_parser().parse_args(argv))

    fp8, f32 = config("llama_fp8_channel"), config("llama")
    assert (fp8.quantize, f32.quantize) == ("fp8", None)  # the runs'; the configs have none
    embed_and_head = 2 * 256 * D * 4
    kernels = 2 * (D * (N + 2 * K) * H + N * H * D + 3 * D * 64)  # q, kv, o, gate/up, down
    scales = 2 * ((N + 2 * K) * H + D + 2 * 64 + D) * 4
    norms = (2 * 2 + 1) * D * 4
    assert param_bytes(f32, ParallelConfig()) == embed_and_head + 4 * kernels + norms
    assert param_bytes(fp8, ParallelConfig()) == embed_and_head + kernels + scales + norms
