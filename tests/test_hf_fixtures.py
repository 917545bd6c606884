"""Equivalence with Hugging Face transformers on the committed tiny fixtures.

Each ``tests/fixtures/hf/<name>/`` holds a checkpoint and ``reference.npz`` made by
``scripts/make_hf_fixtures.py`` (transformers, float32, CPU). All prompts of a fixture run
together as one right-padded batch: prefill logits must match at every real position, and
16 greedy decode steps must reproduce the reference tokens (and their logits).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.models import (
    ExecutionOptions,
    KVCache,
    ModelRun,
    abstract_model,
    check_room,
    load_hf_checkpoint,
    params_quantization,
)
from tests._tiers import sweep

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
FIXTURE_DIRS = sorted(p.parent for p in FIXTURES.glob("*/reference.npz"))
LOGIT_TOL = 1e-4
N_GREEDY = 16


def test_fixtures_present() -> None:
    """Fails, rather than silently skipping everything, when the fixtures are gone."""
    assert FIXTURES.is_dir(), f"missing fixture directory {FIXTURES}"
    assert FIXTURE_DIRS, f"no */reference.npz under {FIXTURES}; run scripts/make_hf_fixtures.py"


def _reference(fixture: Path) -> list[dict[str, np.ndarray]]:
    with np.load(fixture / "reference.npz") as ref:
        return [
            {key: ref[f"{key}_{i}"] for key in ("tokens", "logits", "greedy", "greedy_logits")}
            for i in range(int(ref["n_prompts"]))
        ]


# The fast tier's checkpoints: one of each architecture family; their variants (rope
# scalings, windows, fused or legacy layouts, stored formats) run in the full tier.
FAST_FIXTURES = ("llama", "gpt2", "gemma2", "qwen3_moe", "gpt_oss", "deepseek_v3")


@pytest.mark.parametrize(
    "fixture", sweep(FIXTURE_DIRS, lambda p: p.name in FAST_FIXTURES), ids=lambda p: p.name
)
def test_matches_transformers(fixture: Path) -> None:
    config, params = load_hf_checkpoint(fixture)
    # A pre-quantized checkpoint's parameters say their mode; the model is built to match.
    run = ModelRun(config, ExecutionOptions(quantize=params_quantization(params)))
    graphdef, _ = nnx.split(abstract_model(run))
    prompts = _reference(fixture)
    lengths = np.array([len(p["tokens"]) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), lengths.max()), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, : lengths[row]] = p["tokens"]

    @jax.jit
    def prefill(state, tokens_BT, lengths_B):
        return nnx.merge(graphdef, state).prefill(tokens_BT, lengths_B, all_logits=True)

    @jax.jit
    def decode(state, tokens_B, cache):
        return nnx.merge(graphdef, state).decode(tokens_B, cache)

    logits_BTV, k, v = prefill(params, jnp.asarray(tokens), jnp.asarray(lengths))
    logits_BTV = np.asarray(logits_BTV)
    for row, p in enumerate(prompts):
        np.testing.assert_allclose(
            logits_BTV[row, : lengths[row]],
            p["logits"],
            atol=LOGIT_TOL,
            rtol=0,
            err_msg=f"{fixture.name}: prefill logits of prompt {row}",
        )

    max_seq_len = int(lengths.max()) + N_GREEDY
    cache = KVCache.from_prefill(k, v, jnp.asarray(lengths), max_seq_len)
    step_logits = logits_BTV[np.arange(len(prompts)), lengths - 1]
    generated, gen_logits = [], []
    for _ in range(N_GREEDY):
        next_B = np.argmax(step_logits, axis=-1).astype(np.int32)
        generated.append(next_B)
        gen_logits.append(step_logits)
        check_room(np.asarray(cache.lengths_B), 1, max_seq_len)
        step_logits, cache = decode(params, jnp.asarray(next_B), cache)
        step_logits = np.asarray(step_logits)
    generated_BN = np.stack(generated, axis=1)
    gen_logits_BNV = np.stack(gen_logits, axis=1)
    for row, p in enumerate(prompts):
        np.testing.assert_array_equal(
            generated_BN[row], p["greedy"], err_msg=f"{fixture.name}: greedy tokens, prompt {row}"
        )
        np.testing.assert_allclose(
            gen_logits_BNV[row],
            p["greedy_logits"],
            atol=LOGIT_TOL,
            rtol=0,
            err_msg=f"{fixture.name}: decode logits of prompt {row}",
        )
