"""Shared helpers for engine tests: presets, prompts, single-device references."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import jax
import numpy as np

from jaxpar.engine import InferenceEngine, engine_from_hf
from jaxpar.models._config import preset
from jaxpar.models._decoder import init_params
from jaxpar.spec import ParallelConfig, make_mesh
from tests._prompts import MAX_BATCH, MAX_SEQ_LEN, NEW_TOKENS, PROMPTS  # noqa: F401


@functools.cache
def model(name: str):
    config = preset(name)
    return config, init_params(config, seed=0)


def engine(name: str, parallel: ParallelConfig, **kw) -> InferenceEngine:
    config, params = model(name)
    mesh = make_mesh(parallel, devices=jax.devices()[: parallel.size])
    kw.setdefault("max_batch", MAX_BATCH)
    kw.setdefault("max_seq_len", MAX_SEQ_LEN)
    return InferenceEngine(config, params, parallel, mesh=mesh, **kw)


@functools.cache
def reference(name: str) -> tuple[np.ndarray, list[list[int]]]:
    """Single-device prefill logits at the last prompt position, and 16 greedy tokens."""
    eng = engine(name, ParallelConfig())
    tokens, lengths = eng.pad_prompts(PROMPTS)
    logits = np.asarray(eng.prefill(tokens, lengths)[0])
    return logits, eng.generate(PROMPTS, NEW_TOKENS).tokens


def factorizations(total: int, n: int) -> list[tuple[int, ...]]:
    """Every ordered n-tuple of positive ints whose product is ``total``."""
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    return [c for c in itertools.product(divisors, repeat=n) if np.prod(c) == total]


def hf_reference(fixture: Path):
    """A transformers fixture's ``reference.npz`` and its prompts (token-id lists)."""
    ref = np.load(fixture / "reference.npz")
    prompts = [ref[f"tokens_{i}"].tolist() for i in range(int(ref["n_prompts"]))]
    return ref, prompts


def check_matches_hf(fixture: Path, parallel: ParallelConfig) -> InferenceEngine:
    """``engine_from_hf`` of ``fixture`` under ``parallel`` equals transformers: every
    prompt's prefill logits within 1e-4 (f32) and its 16 greedy tokens identical (the
    fixtures ran with EOS disabled). Returns the engine for further checks."""
    ref, prompts = hf_reference(fixture)
    mesh = make_mesh(parallel, jax.devices()[: parallel.size])
    eng = engine_from_hf(fixture, parallel, max_batch=4, max_seq_len=32, mesh=mesh)
    tokens, lengths = eng.pad_prompts(prompts)
    logits = np.asarray(eng.prefill_logits(tokens, lengths))
    for i, prompt in enumerate(prompts):
        np.testing.assert_allclose(
            logits[i, : len(prompt)], ref[f"logits_{i}"], atol=1e-4, rtol=0, err_msg=f"row {i}"
        )
    gen = eng.generate(prompts, 16, stop_tokens=())
    assert gen.tokens == [ref[f"greedy_{i}"].tolist() for i in range(len(prompts))]
    return eng
