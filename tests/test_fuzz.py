"""Fuzzed strategies: every draw validates and matches one device, or is refused before
compile with a jaxpar exception. Never a raw JAX/XLA error, never a hang.

Default: 200 examples. ``JAXPAR_FUZZ_EXAMPLES=2000 scripts/test.sh tests/test_fuzz.py`` for more.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpar.engine import InferenceEngine
from jaxpar.errors import JaxparError
from jaxpar.models import ModelConfig, init_params
from jaxpar.spec import ParallelConfig, make_mesh

MODELS = {
    "dense": ModelConfig(arch="llama", vocab_size=64, d_model=16, n_layers=2, n_heads=4,
                         n_kv_heads=2, head_dim=4, d_ff=32),
    "moe": ModelConfig(arch="mixtral", vocab_size=64, d_model=16, n_layers=2, n_heads=4,
                       n_kv_heads=4, head_dim=4, d_ff=16, n_experts=4, top_k=2),
    "gpt2": ModelConfig(arch="gpt2", vocab_size=96, d_model=16, n_layers=1, n_heads=2,
                        n_kv_heads=2, head_dim=8, d_ff=64, norm="layer", activation="gelu_tanh",
                        gated_ffn=False, positional="learned", max_position_embeddings=64,
                        qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=True),
}
MAX_SEQ_LEN = 32
_engines: dict[tuple, InferenceEngine] = {}
_params = {name: init_params(cfg, seed=1) for name, cfg in MODELS.items()}


def _engine(name: str, parallel: ParallelConfig, max_batch: int) -> InferenceEngine:
    key = (name, parallel, max_batch)
    if key not in _engines:
        mesh = make_mesh(parallel, jax.devices()[: parallel.size])
        _engines[key] = InferenceEngine(
            MODELS[name], _params[name], parallel, max_batch=max_batch,
            max_seq_len=MAX_SEQ_LEN, mesh=mesh,
        )
    return _engines[key]


degree = st.sampled_from([1, 2, 4])


@st.composite
def draws(draw):
    name = draw(st.sampled_from(sorted(MODELS)))
    dp, sp, ep, tp = (draw(degree) for _ in range(4))
    max_batch = draw(st.sampled_from([2, 4, 8]))
    n_prompts = draw(st.integers(1, max_batch))
    lengths = draw(st.lists(st.integers(1, 14), min_size=n_prompts, max_size=n_prompts))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, MODELS[name].vocab_size, size=n).tolist() for n in lengths]
    phase = draw(st.sampled_from(["prefill", "decode"]))
    return name, (dp, sp, ep, tp), max_batch, prompts, phase


@settings(
    max_examples=int(os.environ.get("JAXPAR_FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
@given(draws())
def test_fuzzed_strategy_matches_or_is_refused(case):
    name, (dp, sp, ep, tp), max_batch, prompts, phase = case
    try:
        parallel = ParallelConfig(dp=dp, sp=sp, ep=ep, tp=tp)
        if parallel.size > jax.device_count():
            make_mesh(parallel)  # must refuse with a MeshError
            raise AssertionError("a mesh larger than the device count was accepted")
        engine = _engine(name, parallel, max_batch)
    except JaxparError:
        return  # refused before compile, with a jaxpar exception (anything else fails)
    reference = _engine(name, ParallelConfig(), max_batch)
    if phase == "prefill":
        tokens, lengths = reference.pad_prompts(prompts)
        np.testing.assert_allclose(
            np.asarray(engine.prefill(tokens, lengths)[0]),
            np.asarray(reference.prefill(tokens, lengths)[0]),
            atol=1e-4, rtol=0,
        )
    else:
        assert engine.generate(prompts, 4).tokens == reference.generate(prompts, 4).tokens
