"""Linear and dynamic NTK RoPE scalings against transformers' formulas
(``tests/fixtures/rope_scalings.npz``, made by ``scripts/make_rope_fixture.py``) at
positions past the original context, and through a model: a checkpoint naming them loads,
and under dynamic NTK each row rotates on its own length (its logits do not depend on its
batch-mates), plain RoPE within the original context.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.engine import InferenceEngine
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.models import (
    DynamicRopeScaling,
    LinearRopeScaling,
    apply_rope,
    config_from_hf,
    dynamic_inv_freq,
    rope_inv_freq,
)
from jaxpar.models._decoder import init_params
from jaxpar.models._hf_config import hf_config_of
from jaxpar.spec import ParallelConfig

FIXTURE = Path(__file__).parent / "fixtures" / "rope_scalings.npz"
HF_LLAMA = Path(__file__).parent / "fixtures" / "hf" / "llama" / "config.json"


@pytest.fixture(scope="module")
def ref():
    return np.load(FIXTURE)


def _cos_sin(inv_freq, positions) -> tuple[np.ndarray, np.ndarray]:
    """jaxpar's rotation of unit vectors: x = [1, 0] gives [cos, sin] of each plane."""
    h = 2 * np.asarray(inv_freq).shape[-1]
    x = jnp.concatenate([jnp.ones(h // 2), jnp.zeros(h // 2)])[None, None, None]
    x = jnp.broadcast_to(x, (1, len(positions), 1, h))
    out = np.asarray(apply_rope(x, jnp.asarray(positions)[None], inv_freq))[0, :, 0]
    return out[:, : h // 2], out[:, h // 2 :]


def test_linear_matches_transformers(ref):
    s = LinearRopeScaling(factor=float(ref["linear_factor"]))
    inv = rope_inv_freq(int(ref["head_dim"]), float(ref["theta"]), s)
    np.testing.assert_allclose(inv, ref["linear_inv_freq"], rtol=1e-6)
    cos, sin = _cos_sin(inv, ref["positions"])
    h2 = int(ref["head_dim"]) // 2
    np.testing.assert_allclose(cos, ref["linear_cos"][:, :h2], atol=2e-5)
    np.testing.assert_allclose(sin, ref["linear_sin"][:, :h2], atol=2e-5)


def test_dynamic_matches_transformers_at_each_length(ref):
    s = DynamicRopeScaling(
        factor=float(ref["dynamic_factor"]), original_max_position_embeddings=int(ref["original"])
    )
    h, theta = int(ref["head_dim"]), float(ref["theta"])
    lengths = ref["dynamic_lengths"]
    inv_LH = np.asarray(dynamic_inv_freq(h, theta, s, jnp.asarray(lengths)))
    plain = rope_inv_freq(h, theta)
    for i, n in enumerate(lengths.tolist()):
        np.testing.assert_allclose(inv_LH[i], ref[f"dynamic_{n}_inv_freq"], rtol=2e-6)
        if n <= int(ref["original"]):  # within the original context: plain RoPE
            np.testing.assert_array_equal(inv_LH[i], plain)
        cos, sin = _cos_sin(inv_LH[i], ref["positions"])
        np.testing.assert_allclose(cos, ref[f"dynamic_{n}_cos"][:, : h // 2], atol=2e-5)
        np.testing.assert_allclose(sin, ref[f"dynamic_{n}_sin"][:, : h // 2], atol=2e-5)
    assert not np.allclose(inv_LH[-1], plain)  # past it the base has grown


def _hf_config(scaling: dict) -> dict:
    hf = json.loads(HF_LLAMA.read_text())
    hf.pop("rope_parameters")
    return {**hf, "rope_theta": 10000.0, "max_position_embeddings": 16, "rope_scaling": scaling}


@pytest.mark.parametrize(
    "scaling, expected",
    [
        ({"rope_type": "linear", "factor": 4.0}, LinearRopeScaling(factor=4.0)),
        (
            {"type": "dynamic", "factor": 2.0},
            DynamicRopeScaling(factor=2.0, original_max_position_embeddings=16),
        ),
    ],
)
def test_checkpoint_configs_load_and_round_trip(scaling, expected):
    config = config_from_hf(_hf_config(scaling), source="test")
    assert config.rope.scaling == expected
    again = config_from_hf(hf_config_of(config), source="round trip")
    assert again.rope.scaling == expected


def test_bad_scalings_are_refused_naming_the_key():
    with pytest.raises(CheckpointError, match="'dynamic' lacks key 'factor'"):
        config_from_hf(_hf_config({"rope_type": "dynamic"}), source="test")
    with pytest.raises(ConfigError, match="factor must be positive"):
        LinearRopeScaling(factor=0.0)


def test_dynamic_rows_rotate_on_their_own_length():
    config = config_from_hf(_hf_config({"rope_type": "dynamic", "factor": 2.0}), source="t")
    config = dataclasses.replace(config, max_position_embeddings=64)
    params = init_params(config, seed=0)
    eng = InferenceEngine(config, params, ParallelConfig(), max_batch=2, max_seq_len=64)
    long = [(5 * i + 3) % 250 + 1 for i in range(40)]  # past the original 16 positions
    short = long[:9]
    both = np.asarray(eng.prefill_logits(*eng.pad_prompts([long, short])))
    alone_long = np.asarray(eng.prefill_logits(*eng.pad_prompts([long])))
    alone_short = np.asarray(eng.prefill_logits(*eng.pad_prompts([short])))
    np.testing.assert_allclose(both[0, :40], alone_long[0, :40], atol=1e-5)
    np.testing.assert_allclose(both[1, :9], alone_short[0, :9], atol=1e-5)
    # The short prompt, within the original context, is plain RoPE's; the long one is not.
    plain = dataclasses.replace(config, rope=dataclasses.replace(config.rope, scaling=None))
    eng_plain = InferenceEngine(plain, params, ParallelConfig(), max_batch=2, max_seq_len=64)
    ref = np.asarray(eng_plain.prefill_logits(*eng_plain.pad_prompts([long, short])))
    np.testing.assert_allclose(both[1, :9], ref[1, :9], atol=1e-5)
    assert np.abs(both[0, 30:40] - ref[0, 30:40]).max() > 1e-3
