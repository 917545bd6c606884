"""The Pallas kernels inside the whole model and engine, under the real shardings.

``interpret_kernels()`` runs every Pallas kernel the engine traces in interpret mode, so
the splash prefill (TPU) and the GPU decode kernel run here on CPU devices inside the
engine's own programs: sharded, pipelined, handed off. Each is compared with the same
engine on XLA attention, and the dtype of every layer's output is asserted (not cast away):
a kernel that returned float32 turned the residual stream float32 from its layer on.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.engine import InferenceEngine
from jaxpar.models import (
    DecoderLayer,
    ExecutionOptions,
    ModelRun,
    init_params,
    interpret_kernels,
    preset,
)
from jaxpar.spec import ParallelConfig, make_mesh
from tests._tiers import sweep

SEQ = 128  # prompts pad to 128 tokens: whole splash blocks
STEPS = 2
PROMPTS = [list(range(3, 3 + 100)), list(range(7, 7 + 90)), [5] * 77, list(range(50, 50 + 120))]


def _config(dtype: str, arch: dict | None = None, **attention) -> ModelRun:
    """tiny-gqa at head_dim 16 in ``dtype`` (with the ``arch`` changes), run with the
    attention implementations named."""
    base = preset("tiny-gqa")
    config = dataclasses.replace(
        base,
        dtype=dtype,
        param_dtype=dtype,
        head_dim=16,
        max_position_embeddings=SEQ,
        **(arch or {}),
    )
    return ModelRun(config, ExecutionOptions(**attention))


@pytest.fixture
def layer_dtypes(monkeypatch) -> dict[str, list]:
    """The dtype of every layer's hidden output, per phase, as the steps are traced."""
    seen: dict[str, list] = {"prefill": [], "decode": []}
    for phase in seen:
        original = getattr(DecoderLayer, phase)

        def record(self, *args, _original=original, _phase=phase, **kwargs):
            out = _original(self, *args, **kwargs)
            seen[_phase].append(jnp.dtype(out[0].dtype))
            return out

        monkeypatch.setattr(DecoderLayer, phase, record)
    return seen


def _run(config, params, strategy: str):
    parallel = ParallelConfig.parse(strategy)
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    engine = InferenceEngine(config, params, parallel, max_batch=4, max_seq_len=SEQ, mesh=mesh)
    tokens, lengths = engine.pad_prompts(PROMPTS)
    assert tokens.shape[1] == SEQ
    logits, cache, first = engine.prefill(tokens, lengths)
    all_logits, token = [np.asarray(logits, np.float32)], np.asarray(first)
    for _ in range(STEPS):
        logits, cache = engine.decode(cache, token)
        all_logits.append(np.asarray(logits, np.float32))
        token = np.argmax(all_logits[-1], axis=-1).astype(np.int32)
    return np.stack(all_logits)


# bf16 under every layout the kernels run in (dp, sp's query offsets, tp, the pipeline's
# stage shard_map); f32 for the tight comparison.
CASES = [("bfloat16", "dp=2,sp=2,tp=2"), ("bfloat16", "pp=2,tp=2"), ("float32", "tp=2")]


# The fast tier: bf16 over dp, sp and tp (the kernels inside the pipeline's shard_map:
# tests/test_attention_ops.py's pp test; f32's tight comparison: the full tier).
@pytest.mark.parametrize(("dtype", "strategy"), sweep(CASES, lambda case: "sp=2" in case[1]))
def test_engine_with_interpreted_kernels_equals_xla(strategy, dtype, layer_dtypes):
    kernels = _config(dtype, prefill_attention="pallas_tpu", decode_attention="pallas_gpu")
    xla = _config(dtype, prefill_attention="xla", decode_attention="xla")
    params = init_params(xla, seed=0)
    n_layers = kernels.n_layers if ParallelConfig.parse(strategy).pp == 1 else 1

    def assert_layers_keep_dtype():
        for phase, dtypes in layer_dtypes.items():
            assert len(dtypes) >= n_layers, (phase, dtypes)
            assert set(dtypes) == {jnp.dtype(dtype)}, (phase, dtypes)
            dtypes.clear()

    reference = _run(xla, params, strategy)
    assert_layers_keep_dtype()  # the XLA path, as CPU and TPU decode run it
    with interpret_kernels():
        got = _run(kernels, params, strategy)
    assert_layers_keep_dtype()
    if dtype == "float32":
        np.testing.assert_allclose(got, reference, atol=1e-4, rtol=0)
    else:
        # bf16 activations round differently between a fused kernel and XLA's einsums.
        scale = float(np.max(np.abs(reference)))
        assert float(np.max(np.abs(got - reference))) < 0.03 * scale
    # Greedy choices agree at every step.
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(reference, -1))


def test_interpret_kernels_is_what_runs_the_kernels():
    """Outside the context the Pallas GPU kernel cannot be traced on a CPU host."""
    config = _config("float32", decode_attention="pallas_gpu")
    params = init_params(config, seed=0)
    with pytest.raises(Exception, match="(?i)triton|gpu|interpret|cuda"):
        _run(config, params, "tp=2")
